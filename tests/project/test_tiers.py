"""The suite's two tiers: `make test` (`-m "not long"`) and `make test-long` (`-m long`), both run
by CI. Every entry of the long tier names a test that exists (a renamed test would otherwise fall
silently into the default tier, or an entry outlive its test), and the tier selection agrees with
the table."""

from __future__ import annotations

import ast
import re

from conftest import LONG, REPO_ROOT, in_long_tier

TESTS = REPO_ROOT / "tests"


def _test_functions(path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
            and n.name.startswith("test")}


def test_every_long_tier_entry_names_an_existing_test():
    for entry in LONG:
        file, _, rest = entry.partition("::")
        path = TESTS / file
        assert path.is_file(), entry
        if rest:
            name = re.sub(r"\[.*\]$", "", rest)
            assert name in _test_functions(path), entry
    assert len(set(LONG)) == len(LONG)


def test_the_tier_of_a_test_follows_the_table():
    assert in_long_tier("gate/test_gate_real_shapes.py::test_v2_lite_shape_bisects_clean_in_float32")
    assert in_long_tier("gate/test_gate_vllm.py::test_planted_bug_fails_the_gate[neox_rope]")
    assert in_long_tier("gate/test_gate_vllm.py::test_check_vllm_v2_lite")
    # one planted bug per dtype kind and the demo's check stay in `make test`
    assert not in_long_tier("gate/test_gate_vllm.py::test_planted_bug_fails_the_gate[routed_scaling_factor]")
    assert not in_long_tier("gate/test_gate_vllm.py::test_check_vllm_transformers_style_v3")
    # an entry is a whole name, never a prefix of another test's
    assert not in_long_tier("gate/test_gate_vllm.py::test_check_vllm_v2_lite_other")
    assert not in_long_tier("gate/test_gate_vllm_parallel_x.py::test_a")


def test_ci_runs_both_tiers_and_the_makefile_selects_them():
    ci = (REPO_ROOT / ".ci" / "run").read_text()
    assert "make test " in ci and "make test-long " in ci
    mk = (REPO_ROOT / "Makefile").read_text()
    assert '-m "not long"' in mk and "-m long" in mk
