"""The H200 power plan (tools/device/power_h200.chains) and what comes back from it: every line a
power run of a built-in model on the bundle's own stack in bfloat16 or float16, each model's
attention and MoE cells in bfloat16 covered, the call's time budget within the device's limit; and
tools/device/summarize.py turning a power run's --json output into a summary row (its MDEs)."""

from __future__ import annotations

import json
import subprocess
import sys

from conftest import REPO_ROOT

DEVICE = REPO_ROOT / "tools" / "device"


def _lines() -> list[list[str]]:
    text = (DEVICE / "power_h200.chains").read_text()
    return [ln.split() for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]


def test_the_power_plan_covers_every_built_in_model_in_bfloat16_within_200_s_of_a_shared_call():
    seen = set()
    for chain, stack, cmd, *args in _lines():
        assert stack == "main" and cmd == "power" and chain.startswith("p"), (chain, stack, cmd)
        opts: dict[str, list[str]] = {}
        for i in range(0, len(args) - 1):
            if args[i].startswith("--"):
                opts.setdefault(args[i], []).append(args[i + 1])
        assert opts["--dtype"] == ["bfloat16"] and opts["--model"][0] in ("v3", "v2", "v2-lite")
        # every command leaves its report before the device script's default CMD_S (200 s) stops it
        assert float(opts["--time-limit"][0]) <= 150
        seen |= {(opts["--model"][0], f, ph) for f in opts["--family"] for ph in opts["--phase"]}
    assert {(m, f, "decode") for m in ("v3", "v2", "v2-lite") for f in ("attention", "moe")} <= seen
    assert {("v3", f, "prefill") for f in ("attention", "moe")} <= seen
    chains = [ln[0] for ln in _lines()]
    # one command per chain (a second would pass 200 s), at most four engines beside the others'
    assert len(set(chains)) == len(chains) <= 4 and "first" not in chains


def test_summarize_reads_a_power_run(tmp_path):
    chain = tmp_path / "results" / "a"
    chain.mkdir(parents=True)
    doc = {"schema": "dsadapt.power-report/1", "dtype": "bfloat16", "model": "v3", "passed": True, "reasons": [],
           "search": {"eps_min": 0.002, "eps_max": 0.2, "resolution": 3},
           "cells": [{"target": "attention", "phase": "decode", "status": "flagged", "flagged_at": 0.0063},
                     {"target": "moe", "phase": "decode", "status": "not flagged", "flagged_at": None}],
           "report_path": "reports/x.json"}
    (chain / "01-main-power.json").write_text(json.dumps(doc))
    (chain / "01-main-power.meta.json").write_text(json.dumps({"chain": "a", "stack": "main", "command": "power",
                                                               "rc": 0, "seconds": 190}))
    r = subprocess.run([sys.executable, str(DEVICE / "summarize.py"), str(tmp_path / "results"),
                        str(tmp_path / "summary.json")], capture_output=True, text=True, check=True)
    assert "bfloat16 pass: MDE attention/decode 0.0063, moe/decode > 0.2" in r.stdout, r.stdout
    assert json.loads((tmp_path / "summary.json").read_text())[0]["checks"][0]["verdict"] == "pass"


def test_power_table_rows_and_publishing(tmp_path):
    import importlib.util

    spec = importlib.util.spec_from_file_location("power_table", REPO_ROOT / "tools" / "power_table.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    work = tmp_path / "work" / "reports" / "vllm" / "v0.32.0"
    work.mkdir(parents=True)
    doc = {"schema": "dsadapt.power-report/1", "pin": "vllm@v0.32.0", "variant": "cpu", "model": "v3",
           "dtype": "bfloat16", "search": {"eps_min": 1e-5, "eps_max": 0.3, "resolution": 1.5}, "settings": 9,
           "cells": [{"target": "attention", "point": "attn.core", "phase": "decode", "status": "flagged",
                      "flagged_at": 0.0063, "clear_at": 0.0042,
                      "trials": [{"eps": 0.0063, "flagged": True, "by": ["modules"], "change": 0.0061, "seconds": 20.0,
                                  "named": {"layer": 0, "label": "attn_core", "phase": "decode"}}]}],
           "timings": {"engine_start_s": 12.7, "first_job_s": 60, "total_s": 400, "reference_captures": 2},
           "provenance": {"loadavg": [3.1, 2, 2], "date": "2026-12-02T08:00:00Z"}, "report_path": str(work / "x")}
    src = work / "power-v3-transformers-bfloat16.json"
    src.write_text(json.dumps(doc))
    src.with_suffix(".png").write_bytes(b"png")
    src.with_suffix(".md").write_text("# md\n")
    rows = tool.mde_rows(tool.reports([work]))
    assert rows[2] == ("| vllm@v0.32.0 (cpu) | v3 | bfloat16 | attention (attn.core) | decode | 0.0063 (not 0.0042) | "
                       "modules | L0 attn_core (decode) | 0.0061 |")
    # the check it is set against is measured in the same run: install, reference and the runner's
    # first answer (60 s), and in low precision the control's capture pass and one reference capture
    assert "| 1 | 9 | 12.7 s | 60 s | 20.0 s | 2 (0 s) | 400 s | 60 s | 6.7x | 3.1 |" in tool.cost_rows(tool.reports([work]))[2]
    doc2 = {**doc, "timings": {**doc["timings"], "install_s": 5, "reference_s": 15, "reference_capture_s": 40},
            "control": {"capture_s": 30}}
    assert tool.check_equivalent(doc2) == 5 + 15 + 60 + 30 + 40 / 2
    project = tmp_path / "project"
    (project / "reports" / "vllm" / "v0.32.0").mkdir(parents=True)
    (project / "upstream.lock").write_text("")
    out = tool.publish(src, project / "reports" / "vllm" / "v0.32.0")
    published = json.loads(out.read_text())
    assert published["report_path"] == "reports/vllm/v0.32.0/power-v3-transformers-bfloat16.json"
    assert published["plot_path"] == "reports/vllm/v0.32.0/power-v3-transformers-bfloat16.png"
    assert published["cells"] == doc["cells"] and out.with_suffix(".png").read_bytes() == b"png"
    # a report made through a bundle on another machine names that machine's folder as <bundle>
    device = {**doc, "command": "dsadapt --project /tmp/run/.carry/reports power lmdeploy@v0.18.0",
              "provenance": {**doc["provenance"], "bundle": "/tmp/run/.carry/reports",
                             "model_dir": "/tmp/run/.carry/reports/.w1/models/v3"}}
    src.write_text(json.dumps(device))
    published = json.loads(tool.publish(src, project / "reports" / "vllm" / "v0.32.0").read_text())
    assert "/tmp/run" not in json.dumps(published)
    assert published["provenance"]["model_dir"] == "<bundle>/.w1/models/v3"


def test_publishing_a_json_only_report_makes_its_markdown_and_plot(tmp_path):
    import importlib.util

    spec = importlib.util.spec_from_file_location("power_table", REPO_ROOT / "tools" / "power_table.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    src = REPO_ROOT / "reports" / "vllm" / "v0.32.0" / "power-v3-transformers-bfloat16.json"
    back = tmp_path / "back"
    back.mkdir()
    (back / src.name).write_text(src.read_text())  # as a device call returns it: the JSON alone
    project = tmp_path / "project"
    (project / "reports" / "lmdeploy" / "v0.18.0").mkdir(parents=True)
    (project / "upstream.lock").write_text("")
    out = tool.publish(back / src.name, project / "reports" / "lmdeploy" / "v0.18.0")
    assert "| attention | attn.core | attention | decode |" in out.with_suffix(".md").read_text()
    assert out.with_suffix(".png").stat().st_size > 1000
