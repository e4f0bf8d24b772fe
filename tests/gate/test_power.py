"""`dsadapt power` end to end on a fake engine (tests/fixtures/powerfake: HF transformers standing in
for an engine, found through its entry point), through the real CLI in a subprocess: perturbations
planted by capture.py's Perturber inside the runner's live model, each run judged by the gate's
own rule, the bisection, the report files, the control, and a planted bug in the engine itself.
Fast tier: no engine environment (the fake runs in dsadapt's own interpreter), the built-in tiny
model, a few cells at a coarse resolution (each run is the gate's seven prompts)."""

from __future__ import annotations

import json
from pathlib import Path

from power_support import PIN, fake_power, power_json  # noqa: F401 - the fake project fixture


def _cells(doc: dict) -> dict[tuple[str, str], dict]:
    return {(c["target"], c["phase"]): c for c in doc["cells"]}


def test_float32_bisects_each_cell_to_the_smallest_flagged_eps_with_a_clean_control(fake_power):  # noqa: F811
    r = fake_power["run"]("power", PIN, "--model", "v3", "--dtype", "float32", "--family", "attention",
                          "--phase", "decode", "--phase", "both", "--eps-max", "0.01", "--resolution", "4", "--json")
    assert r.returncode == 0, r.stderr[-3000:]
    doc = power_json(r)
    assert doc["schema"] == "dsadapt.power-report/1" and doc["passed"] and doc["dtype"] == "float32"
    # the control: every hook installed at eps 0 passes the gate, and changes no logprob at all
    assert doc["control"]["passed"] and doc["hooks"]["identical"], (doc["control"], doc["hooks"])
    cells = _cells(doc)
    assert set(cells) == {("attention", "decode"), ("attention", "both")}
    for key, c in cells.items():
        assert c["status"] == "flagged" and c["monotone"], (key, c)
        lo, hi = c["clear_at"], c["flagged_at"]
        assert 1e-5 <= lo < hi <= 0.01 and hi / lo <= 4, (key, lo, hi)
        for t in c["trials"]:
            # float32: the planted change is the asked eps (rows of the cell's phase only), and
            # every eps at or above the MDE is flagged, every one below it is not
            assert t["rows"] > 0 and abs(t["change"] / t["eps"] - 1) < 1e-2, (key, t)
            assert t["flagged"] == (t["eps"] >= hi), (key, t)
            assert not t["flagged"] or t["by"] == ["logits"], t
    # perturbing every row can only be seen sooner than perturbing the decode rows alone
    assert cells[("attention", "both")]["flagged_at"] <= cells[("attention", "decode")]["flagged_at"] * 4
    report = Path(doc["report_path"])
    assert report.name == "power-v3-transformers-float32.json" and report.parent.name == "v0.1.0"
    assert json.loads(report.read_text())["cells"] == doc["cells"]
    md = report.with_suffix(".md").read_text()
    assert "| attention | attn.core | attention | decode |" in md and "Control" in md
    assert report.with_suffix(".png").is_file()


def test_low_precision_judges_modules_and_names_the_planted_point(fake_power):  # noqa: F811
    r = fake_power["run"]("power", PIN, "--model", "v3", "--dtype", "bfloat16", "--family", "attn.kv_a_norm",
                          "--phase", "prefill", "--resolution", "8", "--eps-min", "1e-3", "--eps-max", "0.1",
                          "--json")
    assert r.returncode == 0, r.stderr[-3000:]
    doc = power_json(r)
    assert doc["control"]["passed"], doc["control"]
    (c,) = doc["cells"]
    assert c["status"] == "flagged", c
    at = next(t for t in c["trials"] if t["eps"] == c["flagged_at"])
    # the per-module comparison carries the low-precision verdict and names where it was planted
    assert "modules" in at["by"] and at["named"]["point"] == "attn.kv_a_norm", at
    assert at["named"]["layer"] == 0 and c["named_as_planted"] is True
    assert doc["timings"]["reference_captures"] >= 1


def test_an_engine_that_fails_without_a_perturbation_has_no_power_to_measure(fake_power):  # noqa: F811
    r = fake_power["run"]("power", PIN, "--model", "v3", "--dtype", "float32", "--family", "norm",
                          "--phase", "prefill", "--json", extra_env={"HFFAKE_BUG": "attn.core:decode:0.05"})
    assert r.returncode == 1, r.stderr[-3000:]
    assert "error: hffake@v0.1.0 power run in float32: the unperturbed run fails the gate" in r.stderr
    doc = power_json(r)  # the result was printed: its document stays, the exit code says the rest
    assert doc["schema"] == "dsadapt.power-report/1" and not doc["passed"] and not doc["control"]["passed"]
    assert [c["status"] for c in doc["cells"]] == ["not measured"] and doc["cells"][0]["trials"] == []
    assert doc["settings"] == 3  # the baseline, the control and the cell's first run, queued together
    assert json.loads(Path(doc["report_path"]).read_text())["passed"] is False


def test_an_engine_that_cannot_load_the_model_is_a_verdict_with_its_root_cause(fake_power):  # noqa: F811
    r = fake_power["run"]("power", PIN, "--model", "v3", "--dtype", "float32", "--family", "norm", "--json",
                          extra_env={"HFFAKE_FAIL_LOAD": "1"})
    assert r.returncode == 1, r.stderr[-3000:]
    err = json.loads(r.stdout)["error"]
    assert err["type"] == "EngineRunFailed" and "root cause: ValueError: hffake cannot load this model" in err["message"]


def test_a_time_limit_cuts_the_search_short_and_keeps_its_bracket(fake_power):  # noqa: F811
    r = fake_power["run"]("power", PIN, "--model", "v3", "--dtype", "float32", "--family", "lm_head",
                          "--phase", "decode", "--time-limit", "1", "--json")
    assert r.returncode == 0, r.stderr[-3000:]
    doc = power_json(r)
    (c,) = doc["cells"]
    assert c["status"] == "cut short" and len(c["trials"]) == 1, c  # the first round only
    assert "cut short" in r.stderr


def test_reference_captures_are_made_once_per_new_sequence_and_kept_on_disk(tmp_path):
    import pytest

    torch = pytest.importorskip("torch")
    from patcher.gate.power import ReferenceCaptures

    made = []

    def capture(sequences):  # stands for the HF reference capture: one row per position, value = token
        made.append(dict(sequences))
        ids = list(sequences)
        prompt = torch.tensor([i for i, p in enumerate(ids) for _ in sequences[p]])
        pos = torch.tensor([k for p in ids for k in range(len(sequences[p]))])
        value = torch.tensor([float(t) for p in ids for t in sequences[p]])[:, None]
        doc = {"schema": "dsadapt.capture/1", "prompts": ids, "sequences": sequences, "missing": [],
               "points": [{"layer": 0, "point": "out", "value": value, "prompt": prompt, "pos": pos,
                           "phase": torch.zeros_like(pos)}]}
        return {"float32": doc, "bfloat16": doc}

    refs = ReferenceCaptures(capture, tmp_path / "chunks")
    for run in ({"a": [1, 2, 3], "b": [4, 5]}, {"a": [1, 2, 3], "b": [4, 6]}, {"a": [1, 2, 7], "b": [4, 6]}):
        refs.add(refs.unknown(run))
        docs = refs.docs_for(run)
        assert set(docs) == {"float32", "bfloat16"} and docs["float32"]["sequences"] == run
        e = docs["float32"]["points"][0]
        assert [int(v) for v in e["value"][:, 0]] == run["a"] + run["b"]
    assert [sorted(map(tuple, m.values())) for m in made] == [[(1, 2, 3), (4, 5)], [(4, 6)], [(1, 2, 7)]]
    assert len(refs._loaded) <= refs.KEEP and len(list((tmp_path / "chunks").iterdir())) == 3
    assert refs.docs_for({"x": [4, 5]})["float32"]["sequences"] == {"x": [4, 5]}  # read back from disk
    refs.close()
    assert not list((tmp_path / "chunks").iterdir())
