"""What CI reads besides the output: JUnit XML whose case names say the configuration, so no two
runs of one command share a name (a TP 2 run and the TP 1 run of the same model, a control run, a
seeded prompt set), and Markdown tables."""

from __future__ import annotations

import xml.etree.ElementTree as ET

from patcher.cli.ci import Case, junit_xml, md_table, unique_names
from patcher.cli.commands.check import report_ci
from patcher.gate.equivalence import CheckResult


def _result(tmp_path, **kw) -> CheckResult:
    base = dict(pin="vllm@v0.32.0", engine="vllm", variant="cpu", model="v3", config_style="transformers",
                dtype="bfloat16", unpatched=False, verdict="pass", reasons=[], explanation=[],
                report_path=str(tmp_path / "r.json"), plot_path=None, provenance={}, timings={"total_s": 3.0})
    return CheckResult(**{**base, **kw})


def test_check_cases_of_tp_2_tp_1_controls_and_seeds_have_different_names(tmp_path):
    runs = [_result(tmp_path),
            _result(tmp_path, parallel={"tp": 2, "ep": False, "world_size": 2, "label": "tp2"}),
            _result(tmp_path, parallel={"tp": 2, "ep": True, "world_size": 2, "label": "tp2-ep"}),
            _result(tmp_path, unpatched=True, verdict="fail", reasons=["KeyError"]),
            _result(tmp_path, provenance={"prompt_seed": 3})]
    junit = tmp_path / "check.xml"
    report_ci(runs, junit)
    names = [c.get("name") for c in ET.fromstring(junit.read_text()).iter("testcase")]
    assert names == ["vllm@v0.32.0 cpu v3 transformers bfloat16", "vllm@v0.32.0 cpu v3 transformers bfloat16 tp2",
                     "vllm@v0.32.0 cpu v3 transformers bfloat16 tp2-ep",
                     "vllm@v0.32.0 cpu v3 transformers bfloat16 unpatched",
                     "vllm@v0.32.0 cpu v3 transformers bfloat16 seed3"], names
    assert "  " not in " ".join(names)


def test_a_name_that_still_repeats_is_numbered_never_merged():
    cases = [Case("a", "k"), Case("a", "k", failure="x"), Case("a", "other"), Case("b", "k")]
    assert [c.name for c in unique_names(cases)] == ["a", "a (2)", "a", "b"]
    root = ET.fromstring(junit_xml("s", cases))
    assert [(c.get("classname"), c.get("name")) for c in root.iter("testcase")] == [
        ("k", "a"), ("k", "a (2)"), ("other", "a"), ("k", "b")]
    assert root.find("testsuite").get("failures") == "1"


def test_md_table_escapes_pipes_and_newlines():
    assert md_table(["a"], [["x|y\nz"]]).splitlines()[2] == "| x\\|y z |"
