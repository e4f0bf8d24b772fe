"""The v0.18.0 stack's MoE routing fix, checked on CPU against HF transformers.

LMDeploy's `MoEGate` needs CUDA to be built, so this test takes the gate's methods
(`forward`, `_compute_scores`, `_postprocess_topk_weight`) from the wheel's
`lmdeploy/pytorch/models/deepseek_v2.py` (patched and not), binds them to a plain object
carrying the attributes `__init__` would set, and routes random tokens with both that code
and HF's `DeepseekV2TopkRouter` (float32). The two collaborators that need the engine are
replaced by their CPU equivalents: the router GEMM by `F.linear`, and `SoftmaxTopK` by
LMDeploy's default (non-CUDA) implementation, softmax in float32 then top-k.
"""

from __future__ import annotations

import ast

import pytest
from lmdeploy_support import WHEELS, trees, wheel_path

# the pinned LMDeploy 0.18.0 wheel comes from PyPI (once per machine: tests/shared_envs.py)
pytestmark = pytest.mark.network

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

GATE_FILE = "lmdeploy/pytorch/models/deepseek_v2.py"
METHODS = ("forward", "_compute_scores", "_postprocess_topk_weight")


@pytest.fixture(scope="module")
def gate_sources(tmp_path_factory):
    if wheel_path("v0.18.0") is None:
        pytest.skip(f"{WHEELS['v0.18.0'][0]} could not be found or fetched")
    root = tmp_path_factory.mktemp("lmd018")
    t = trees("v0.18.0", root)
    base, patched = t.base, t.patched
    return {"base": (base / GATE_FILE).read_text(), "patched": (patched / GATE_FILE).read_text()}


def gate_class(source: str):
    """A class holding MoEGate's routing methods, compiled from the upstream source."""
    tree = ast.parse(source)
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "MoEGate")
    funcs = [n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name in METHODS]
    assert sorted(f.name for f in funcs) == sorted(METHODS)
    module = ast.Module(body=funcs, type_ignores=[])
    ns = {"torch": torch, "EPLBManager": None}
    exec(compile(module, GATE_FILE, "exec"), ns)
    return type("MoEGateOnCPU", (), {name: ns[name] for name in METHODS})


def make_gate(cls, weight, top_k, n_group, topk_group, scale, norm_topk_prob=False):
    g = cls()
    g.top_k, g.n_routed_experts, g.routed_scaling_factor = top_k, weight.shape[0], scale
    g.scoring_func, g.topk_method = "softmax", "group_limited_greedy"
    g.n_group, g.topk_group, g.norm_topk_prob = n_group, topk_group, norm_topk_prob
    g.renormalize = top_k > 1 and norm_topk_prob
    g.router_n_groups, g.fake_eplb, g.eplb_dispatch_info = -1, False, None
    g.weight = weight
    g.router_gemm = lambda h, w: torch.nn.functional.linear(h, w)

    def softmax_topk(x):  # lmdeploy/pytorch/backends/default/moe.py, n_groups <= 0
        return torch.topk(torch.softmax(x, dim=-1, dtype=torch.float32), top_k, dim=-1)

    g.softmax_topk = softmax_topk
    return g


def hf_router(weight, top_k, n_group, topk_group, scale):
    from transformers import DeepseekV2Config
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter

    cfg = DeepseekV2Config(hidden_size=weight.shape[1], n_routed_experts=weight.shape[0],
                           num_experts_per_tok=top_k, n_group=n_group, topk_group=topk_group,
                           routed_scaling_factor=scale, topk_method="group_limited_greedy",
                           norm_topk_prob=False)
    router = DeepseekV2TopkRouter(cfg)
    with torch.no_grad():
        router.weight.copy_(weight)
    return router


def dense(weights, ids, n):
    return torch.zeros(ids.shape[0], n).scatter_(1, ids.long(), weights.float())


def route_both(source):
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(16, 64, generator=gen) * 0.5
    hidden = torch.randn(512, 64, generator=gen)
    args = dict(top_k=4, n_group=4, topk_group=2, scale=16.0)
    w, idx = make_gate(gate_class(source), weight, **args).forward(hidden)
    _, w_ref, idx_ref = hf_router(weight, **args)(hidden)
    moved = (idx.sort(-1).values != idx_ref.sort(-1).values).any(-1).sum().item()
    delta = (dense(w, idx, 16) - dense(w_ref, idx_ref, 16)).abs().max().item()
    return moved, delta


def test_v018_patched_gate_matches_hf(gate_sources):
    moved, delta = route_both(gate_sources["patched"])
    assert moved == 0
    assert delta < 1e-5


def test_v018_unpatched_gate_diverges_from_hf(gate_sources):
    """The bug the patch fixes: logits masked with 0.0 before the softmax."""
    moved, delta = route_both(gate_sources["base"])
    assert moved > 0
    assert delta > 0.1
