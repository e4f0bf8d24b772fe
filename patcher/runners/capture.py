"""Per-module capture for `dsadapt bisect`: forward hooks on a live model, no source patching.

Standalone: stdlib + torch only (a runner imports it from its own directory; it never
imports `patcher`). The orchestrator passes a *capture spec* (JSON, written from the
engine's table in ``patcher/engines/<engine>_bisect.py`` or the reference's table in
``patcher/rules/modules.py``) that names, for each comparison point, where it lives in the model:

    {"schema": "dsadapt.capture-spec/1",
     "layers": "model.layers",                      # ModuleList of decoder layers
     "rows": {"ids": "input_ids", "positions": "positions"},   # root forward kwargs (engines)
     "points": [
       {"point": "input_norm", "path": "model.layers.{i}.input_layernorm", "take": 0},
       {"point": "attn.core", "path": "model.layers.{i}.self_attn.o_proj", "take": "input0"},
       {"point": "router.ids", "path": "model.layers.{i}.mlp.experts.router",
        "method": "select_experts", "take": 1},
       {"point": "attn.q_rope", "function": "pkg.module:function_name", "take": 0},
       {"point": "logits", "path": "logits_processor", "take": 0, "rows": "last"},
       ...]}

- ``path`` is an attribute path from the root module (``{i}`` = each decoder layer);
  a forward hook records the output. Objects shared between layers (vLLM reuses one
  rotary-embedding module) are hooked once and attributed to the layer that is running.
- ``method`` wraps that bound method of the object at run time (an instance attribute;
  the class is untouched) — for values that are not a module's output (vLLM's expert
  selection inside its fused MoE).
- ``function`` wraps a module-level function for the duration of the capture (the HF
  reference's RoPE helpers).
- ``take``: an output index (0 also takes a plain tensor), ``"sum"`` (the sum of a tuple:
  vLLM/LMDeploy return ``(hidden_states, residual)`` from fused add-norm layers), or
  ``"input0"`` (the first input: what a projection receives).
- ``token_axis`` (default 0): the axis holding tokens; values are stored as
  ``[tokens, features]`` float32 (integer tensors keep their dtype).
- ``rows``: ``"all"`` (default; one row per token of the forward call) or ``"last"``
  (one row per call: the logits of the sampled position).

A forward pre-hook on each decoder layer tells the recorder which layer is running; a
pre-hook on the root module (engines) records each forward call's token ids and positions,
so every captured row maps to (prompt, position). `Recorder.finish` checks that mapping
against the known token sequences and returns the capture document saved with `save`.

Parallel engines (tensor parallel ranks in worker processes): the engine hands each rank's
model to `worker_install` / `worker_prompt` / `worker_finish` (picklable by reference: vLLM's
``LLM.apply_model`` runs them in every worker); each rank records what *it* computes and saves
its own document, rank 0 at the capture path and rank r at ``<path>.rank<r>`` (`rank_path`),
each stating ``meta.rank`` and ``meta.world_size`` (torch.distributed's, 0 / 1 without it).
Which values are a rank's shard, a partial sum or the reduced tensor is the engine table's
business (``Site.tp`` in patcher/rules/modules.py), not the recorder's.
"""

from __future__ import annotations

import importlib
import json
import math
import re
from dataclasses import dataclass, field
from typing import Any

SCHEMA = "dsadapt.capture/1"
SPEC_SCHEMA = "dsadapt.capture-spec/1"


class CaptureError(RuntimeError):
    """The capture spec does not fit the model, or rows cannot be mapped to positions."""


def load_spec(path: str) -> dict:
    with open(path) as f:
        spec = json.load(f)
    if spec.get("schema") != SPEC_SCHEMA:
        raise CaptureError(f"{path}: not a {SPEC_SCHEMA} document")
    return spec


# ----------------------------------------------------------------------------- model access


def resolve(root, path: str):
    """The object at a dotted attribute path ('' is the root; numbers index sequences)."""
    obj = root
    for part in [p for p in path.split(".") if p]:
        obj = obj[int(part)] if part.isdigit() and not hasattr(obj, part) else getattr(obj, part)
    return obj


def _try_resolve(root, path: str):
    try:
        return resolve(root, path)
    except (AttributeError, IndexError, KeyError, TypeError):
        return None


def take(value, how, args=None, kwargs=None):
    """Extract the captured tensor from a hook's output (or inputs)."""
    import torch

    if how == "input0":
        if args:
            return args[0]
        return next(iter((kwargs or {}).values()), None)
    if how == "sum":
        if isinstance(value, (tuple, list)):
            parts = [v for v in value if isinstance(v, torch.Tensor)]
            return sum(parts[1:], parts[0]) if parts else None
        return value
    if isinstance(value, (tuple, list)):
        return value[int(how)] if int(how) < len(value) else None
    return value if int(how) == 0 else None


def apply_transforms(t, transforms):
    """The spec's per-point conversions to the reference's conventions, on ``[tokens, F]``:
    ``interleave`` (rotary vectors laid out as halves -> DeepSeek's interleaved pairs, per
    ``dim``-sized chunk) and ``scale`` (multiply by ``by``)."""
    for tr in transforms:
        if not t.is_floating_point():
            break
        if tr["op"] == "interleave":
            dim = int(tr["dim"])
            if t.shape[1] % dim:
                raise CaptureError(f"cannot interleave {t.shape[1]} features in chunks of {dim}")
            t = t.reshape(t.shape[0], -1, 2, dim // 2).transpose(-1, -2).reshape(t.shape[0], -1)
        elif tr["op"] == "scale":
            t = t * float(tr["by"])
        else:
            raise CaptureError(f"unknown transform {tr['op']!r}")
    return t


def as_rows(t, token_axis: int = 0):
    """A tensor as ``[tokens, features]`` on CPU: float32 for floating point, else as is."""

    t = t.detach()
    if token_axis:
        t = t.movedim(token_axis, 0)
    t = t.reshape(t.shape[0], -1) if t.dim() != 1 else t.reshape(t.shape[0], 1)
    # a copy: engines modify outputs in place after the hook (vLLM's float16 residual scaling,
    # the sampler's min_tokens mask on the logits)
    t = t.to("cpu", copy=True)
    return t.float() if t.is_floating_point() else t


# ----------------------------------------------------------------------------- recording


@dataclass
class Call:
    prompt: str
    ids: list[int]
    positions: list[int]


class _Hooks:
    """What a `Recorder` and a `Perturber` share: the hooks and wrappers to undo, and which decoder
    layer is running (a forward pre-hook on each layer of the spec's ``layers``)."""

    spec: dict
    handles: list
    restores: list
    layer: int | None

    def _track_layers(self, root, spec: dict) -> int:
        layers = _try_resolve(root, spec.get("layers", "")) if spec.get("layers") else None
        if layers is None:
            return 0
        for i, layer in enumerate(layers):
            self.handles.append(layer.register_forward_pre_hook(self._layer_pre(i)))
        return len(layers)

    def _install_root(self, root) -> int:
        """The layer tracking and the root forward's pre-hook (`_root_pre`, where the spec names the
        root's ``rows``); returns how many layers are tracked."""
        n_layers = self._track_layers(root, self.spec)
        rows = self.spec.get("rows")
        if rows:
            self.handles.append(resolve(root, rows.get("path", "")).register_forward_pre_hook(
                self._root_pre(rows), with_kwargs=True))
        return n_layers

    def _root_pre(self, rows: dict):
        raise NotImplementedError

    def _layer_pre(self, i: int):
        def hook(module, args):
            self.layer = i
        return hook

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        for undo in reversed(self.restores):
            undo()
        self.handles.clear()
        self.restores.clear()


def point_paths(point: dict, n_layers: int) -> list[str]:
    """The module paths of a spec point: one per layer where its path holds ``{i}``."""
    path = point["path"]
    return [path.replace("{i}", str(i)) for i in range(n_layers)] if "{i}" in path else [path]


def root_inputs(rows: dict, args, kwargs):
    """(token ids, positions) of a root forward call, as the spec's ``rows`` names them (None where
    the call has none)."""
    ids = kwargs.get(rows.get("ids", "input_ids"))
    pos = kwargs.get(rows.get("positions", "positions"))
    if ids is None and args:
        ids = args[0]
    if pos is None and len(args) > 1:
        pos = args[1]
    return ids, pos


@dataclass
class Recorder(_Hooks):
    """Records hook outputs per forward call. `prompt` is set by the driver before it runs
    a prompt; engines' root pre-hook (or the HF driver's `begin_call`) opens a call."""

    spec: dict
    prompt: str | None = None
    layer: int | None = None
    calls: list[Call] = field(default_factory=list)
    records: list[tuple[int, int | None, str, Any, str]] = field(default_factory=list)
    handles: list = field(default_factory=list)
    restores: list = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    active: bool = True

    # -- calls
    def begin_call(self, ids, positions) -> None:
        if not self.active:
            return
        self.calls.append(Call(self.prompt or "", [int(x) for x in ids], [int(x) for x in positions]))
        self.layer = None

    def record(self, point: str, tensor, token_axis: int = 0, rows: str = "all", layered: bool = True,
               transforms: list | None = None) -> None:
        import torch

        if not self.active or not self.calls or not isinstance(tensor, torch.Tensor):
            return
        if rows == "last":
            t = tensor.detach().reshape(-1, tensor.shape[-1])[-1:].to("cpu", copy=True)
            t = t.float() if t.is_floating_point() else t
        else:
            t = as_rows(tensor, token_axis)
        self.records.append((len(self.calls) - 1, self.layer if layered else None, point,
                             apply_transforms(t, transforms or ()), rows))

    # -- installation
    def install(self, root) -> None:
        """Register every hook and wrapper the spec asks for."""
        n_layers = self._install_root(root)
        groups: dict[tuple, list[dict]] = {}
        for p in self.spec["points"]:
            if "function" in p:
                groups.setdefault(("function", p["function"]), []).append(p)
                continue
            paths = point_paths(p, n_layers)
            found = False
            for path in paths:
                obj = _try_resolve(root, path)
                if obj is None:
                    continue
                found = True
                kind = ("method", id(obj), p["method"]) if "method" in p else ("module", id(obj))
                groups.setdefault(kind + (), []).append({**p, "_obj": obj})
            if not found:
                self.missing.append(p["point"])
        for key, entries in groups.items():
            if key[0] == "function":
                self._wrap_function(key[1], entries)
            elif key[0] == "method":
                self._wrap_method(entries[0]["_obj"], key[2], _dedup(entries))
            else:
                self.handles.append(entries[0]["_obj"].register_forward_hook(self._module_hook(_dedup(entries)),
                                                                              with_kwargs=True))

    def _root_pre(self, rows: dict):
        def hook(module, args, kwargs):
            ids, pos = root_inputs(rows, args, kwargs)
            if ids is None or pos is None:
                raise CaptureError("the root forward has no token ids / positions to map rows with")
            self.begin_call(ids.reshape(-1).tolist(), pos.reshape(-1).tolist())
        return hook

    def _emit(self, entries, output, args=None, kwargs=None) -> None:
        for e in entries:
            layered = "{i}" in e.get("path", "") or bool(e.get("layered"))
            if layered and "layers_only" in e and self.layer not in e["layers_only"]:
                continue
            self.record(e["point"], take(output, e.get("take", 0), args, kwargs), e.get("token_axis", 0),
                        e.get("rows", "all"), layered, e.get("transforms"))

    def _module_hook(self, entries):
        def hook(module, args, kwargs, output):
            self._emit(entries, output, args, kwargs)
        return hook

    def _wrap_method(self, obj, name: str, entries) -> None:
        original = getattr(obj, name)
        had_own = name in getattr(obj, "__dict__", {})

        def wrapper(*args, **kwargs):
            out = original(*args, **kwargs)
            self._emit(entries, out, args, kwargs)
            return out

        setattr(obj, name, wrapper)
        self.restores.append(lambda: setattr(obj, name, original) if had_own else delattr(obj, name))

    def _wrap_function(self, target: str, entries) -> None:
        mod_name, _, attr = target.partition(":")
        try:
            mod = importlib.import_module(mod_name)
            original = getattr(mod, attr)
        except (ImportError, AttributeError):
            self.missing.extend(e["point"] for e in entries)
            return

        def wrapper(*args, **kwargs):
            out = original(*args, **kwargs)
            self._emit(entries, out, args, kwargs)
            return out

        setattr(mod, attr, wrapper)
        self.restores.append(lambda: setattr(mod, attr, original))

    # -- result
    def finish(self, sequences: dict[str, list[int]], meta: dict | None = None) -> dict:
        """The capture document. Every call's token ids must equal the prompt's known
        sequence at the call's positions (otherwise rows would be misattributed)."""
        import torch

        order = list(sequences)
        index = {pid: k for k, pid in enumerate(order)}
        dropped: dict[str, int] = {}
        stray: list[int] = []
        for c, call in enumerate(self.calls):
            n = _real_rows(call, sequences[call.prompt]) if call.prompt in sequences else 0
            if n == 0:
                # a forward that is not this prompt's (an engine step issued ahead, a warm-up):
                # its rows cannot be mapped to positions, so none of them is used
                stray.append(c)
            call.ids, call.positions = call.ids[:n], call.positions[:n]
        if self.calls and len(stray) == len(self.calls):
            c0 = self.calls[0]
            raise CaptureError(f"no forward call matches its prompt's tokens (first: prompt {c0.prompt!r}, "
                               f"positions {c0.positions[:8]}): rows cannot be mapped to positions")
        grouped: dict[tuple, list] = {}
        for c, layer, point, t, rows in self.records:
            call = self.calls[c]
            n = len(call.positions)
            if n == 0:
                continue
            if rows == "last":
                if t.shape[0] < 1:
                    continue
                t, pos = t[-1:], call.positions[-1:]
            elif t.shape[0] >= n:
                t, pos = t[:n], call.positions
            else:
                dropped[point] = dropped.get(point, 0) + 1
                continue
            phase = 0 if call.positions[0] == 0 else 1
            g = grouped.setdefault((layer, point), [[], [], [], []])
            g[0].append(t)
            g[1].extend([index[call.prompt]] * t.shape[0])
            g[2].extend(pos)
            g[3].extend([phase] * t.shape[0])
        points = []
        for (layer, point), (ts, prompts, pos, phase) in grouped.items():
            width = {t.shape[1] for t in ts}
            if len(width) != 1:
                dropped[point] = dropped.get(point, 0) + len(ts)
                continue
            points.append({"layer": layer, "point": point, "value": torch.cat(ts),
                           "prompt": torch.tensor(prompts, dtype=torch.long),
                           "pos": torch.tensor(pos, dtype=torch.long),
                           "phase": torch.tensor(phase, dtype=torch.long)})
        return {"schema": SCHEMA, "prompts": order, "sequences": {p: list(sequences[p]) for p in order},
                "calls": len(self.calls), "stray_calls": len(stray), "points": points, "missing": sorted(set(self.missing)),
                "dropped": dropped, "meta": dict(meta or {})}


def _dedup(entries: list[dict]) -> list[dict]:
    seen, out = set(), []
    for e in entries:
        key = (e["point"], str(e.get("take", 0)), json.dumps(e.get("transforms")), str(e.get("layers_only")))
        if key not in seen:
            seen.add(key)
            out.append(e)
    return out


def _real_rows(call: Call, seq: list[int]) -> int:
    """How many leading rows of a call are real tokens of `seq`: consecutive positions
    whose token ids match (engines may pad a step with rows at position 0)."""
    n = 0
    for k, (t, p) in enumerate(zip(call.ids, call.positions)):
        if p >= len(seq) or seq[p] != t or (k and p != call.positions[k - 1] + 1):
            break
        n += 1
    return n


def save(doc: dict, path: str) -> None:
    import torch

    torch.save(doc, path)


_LAYER_RE = re.compile(r"\{i\}")


def spec_layers(spec: dict) -> bool:
    return any(_LAYER_RE.search(p.get("path", "")) for p in spec.get("points", []))


# ----------------------------------------------------------------------------- parallel ranks


def rank_info() -> tuple[int, int]:
    """(rank, world size) of this process in torch.distributed, (0, 1) when it is not initialized."""
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return int(dist.get_rank()), int(dist.get_world_size())
    except Exception:  # noqa: BLE001 - a capture never fails on a missing process group
        pass
    return 0, 1


def rank_path(path: str, rank: int) -> str:
    """Where rank `rank` saves its capture: the capture path itself for rank 0."""
    return path if rank == 0 else f"{path}.rank{rank}"


#: The recorder of this process (one per rank), between `worker_install` and `worker_finish`.
_WORKER: dict[str, Any] = {}


def worker_install(spec_path: str, model) -> int:
    """Install a recorder for the spec on this rank's `model`; returns the rank."""
    rank, world = rank_info()
    rec = Recorder(load_spec(spec_path))
    rec.install(model)
    _WORKER["rec"] = rec
    return rank


def worker_prompt(prompt: str, model) -> int:
    """The prompt the next forward calls belong to."""
    _WORKER["rec"].prompt = prompt
    return rank_info()[0]


def worker_finish(path: str, sequences: dict, meta: dict, model) -> str:
    """Stop recording, remove the hooks, and save this rank's capture document (`rank_path`);
    returns where it was saved."""
    rec = _WORKER.pop("rec")
    rec.active = False
    rec.remove()
    rank, world = rank_info()
    doc = rec.finish(sequences, meta={**meta, "rank": rank, "world_size": world})
    out = rank_path(path, rank)
    save(doc, out)
    return out


def worker_abort(model) -> None:
    """Remove this rank's hooks after a failed capture (nothing saved)."""
    rec = _WORKER.pop("rec", None)
    if rec is not None:
        rec.active = False
        rec.remove()


# ----------------------------------------------------------------------------- perturbations
#
# `dsadapt power` plants perturbations of known size inside the engine's forward, through the
# same capture spec (the engine's table says where each comparison point lives): a *plan* is a
# list of items
#
#     {"point": "attn.core", "layers": [0, 1, 2, 3] | null, "phase": "prefill" | "decode" | "both",
#      "kind": "scale" | "noise", "eps": 0.01, "seed": 0}
#
# and each item changes the value at that point (the very tensor the capture would record) on
# the rows of its phase: ``scale`` multiplies it by 1 + eps, ``noise`` adds eps x the row's RMS x
# N(0, 1) (seeded). A row's phase is the code path that computed it (`row_phases`). What was
# changed is counted (`Perturber.stats`): rows per phase and the relative change the tensors
# actually took (low-precision rounding can take back part of a small eps), so a perturbation
# that never reached the model reads as not planted, never as not detected.

PERTURB_KINDS = ("scale", "noise")
PERTURB_PHASES = ("prefill", "decode", "both")


def row_phases(positions) -> tuple[list[int], list[int]]:
    """(phase of each row, phase of each sequence run) of one forward call: 0 prefill, 1 decode.

    Rows come in runs of consecutive positions, one run per sequence. A run of one row at a
    position > 0 is a decode step; any other run (a prompt, a chunk of one, a prefix computed
    again) went through the prefill path. Two sequences decoding side by side at neighbouring
    positions would read as one run (the gate's prompt set never has them: its batch members'
    lengths differ by more than one)."""
    rows: list[int] = []
    runs: list[int] = []
    pos = [int(p) for p in positions]
    k = 0
    while k < len(pos):
        j = k + 1
        while j < len(pos) and pos[j] == pos[j - 1] + 1:
            j += 1
        phase = 1 if j - k == 1 and pos[k] > 0 else 0
        rows.extend([phase] * (j - k))
        runs.append(phase)
        k = j
    return rows, runs


def check_plan(plan) -> list[dict]:
    """The plan's items, or CaptureError saying which field is wrong."""
    if not isinstance(plan, list):
        raise CaptureError("a perturbation plan is a list of items")
    for item in plan:
        if not isinstance(item, dict) or not isinstance(item.get("point"), str):
            raise CaptureError(f"perturbation item {item!r}: needs a point")
        if item.get("kind", "scale") not in PERTURB_KINDS:
            raise CaptureError(f"perturbation kind {item.get('kind')!r}: one of {', '.join(PERTURB_KINDS)}")
        if item.get("phase", "both") not in PERTURB_PHASES:
            raise CaptureError(f"perturbation phase {item.get('phase')!r}: one of {', '.join(PERTURB_PHASES)}")
        eps = item.get("eps")
        if not isinstance(eps, (int, float)) or not 0 <= float(eps) < 1:
            raise CaptureError(f"perturbation eps {eps!r}: a number in [0, 1)")
    return plan


@dataclass
class _Tally:
    rows: list[int] = field(default_factory=lambda: [0, 0])      # rows changed, per phase
    change2: list[float] = field(default_factory=lambda: [0.0, 0.0])  # ||after - before||^2, per phase
    norm2: list[float] = field(default_factory=lambda: [0.0, 0.0])    # ||before||^2, per phase
    unmapped: int = 0                                            # tensors whose rows fit no call's rows


@dataclass
class Perturber(_Hooks):
    """Changes the values of a plan's points on the rows of their phase (see above). Install it
    before a `Recorder` on the same model: the recorder then records the perturbed values."""

    spec: dict
    plan: list[dict]
    layer: int | None = None
    phases: list[int] = field(default_factory=list)
    runs: list[int] = field(default_factory=list)
    tallies: dict[str, _Tally] = field(default_factory=dict)
    missing: list[str] = field(default_factory=list)
    handles: list = field(default_factory=list)
    restores: list = field(default_factory=list)
    calls: int = 0

    def __post_init__(self) -> None:
        import torch

        check_plan(self.plan)
        self._gen = {i: torch.Generator().manual_seed(int(item.get("seed", 0)))
                     for i, item in enumerate(self.plan)}

    # -- installation
    def install(self, root) -> None:
        n_layers = self._install_root(root)
        for k, item in enumerate(self.plan):
            self.tallies.setdefault(item["point"], _Tally())
            entries = [p for p in self.spec["points"] if p["point"] == item["point"]]
            found = False
            seen: set[tuple] = set()
            for e in entries:
                if "function" in e:
                    found |= self._wrap_function(e, k)
                    continue
                paths = point_paths(e, n_layers)
                for path in paths:
                    obj = _try_resolve(root, path)
                    if obj is None:
                        continue
                    key = (id(obj), e.get("method"), str(e.get("take", 0)), str(e.get("layers_only")))
                    if key in seen:  # one object shared by every layer (vLLM's rotary embedding)
                        found = True
                        continue
                    seen.add(key)
                    found = True
                    if "method" in e:
                        self._wrap_method(obj, e, k)
                    elif e.get("take") == "input0":
                        self.handles.append(obj.register_forward_pre_hook(self._input_hook(e, k), with_kwargs=True))
                    else:
                        self.handles.append(obj.register_forward_hook(self._output_hook(e, k)))
            if not found:
                self.missing.append(item["point"])

    def _root_pre(self, rows: dict):
        def hook(module, args, kwargs):
            _ids, pos = root_inputs(rows, args, kwargs)
            if pos is None:
                raise CaptureError("the root forward has no positions to tell prefill from decode rows")
            self.phases, self.runs = row_phases(pos.reshape(-1).tolist())
            self.layer = None
            self.calls += 1
        return hook

    # -- what changes
    def _applies(self, entry: dict, item: dict) -> bool:
        layered = "{i}" in entry.get("path", "") or bool(entry.get("layered"))
        if not layered:
            return True
        if "layers_only" in entry and self.layer not in entry["layers_only"]:
            return False
        wanted = item.get("layers")
        return wanted is None or self.layer in wanted

    def _mask(self, n: int, entry: dict, item: dict, tally: _Tally):
        """Which of a tensor's `n` rows (along its token axis) are in the item's phase, and the
        phase of each (None: its rows map to no call)."""
        import torch

        phases = self.phases
        if entry.get("rows") == "last" and n == len(self.runs) and n != len(phases):
            phases = self.runs
        elif n != len(phases):
            if len(set(phases)) == 1:  # a call in one phase: every row of it is in that phase
                phases = [phases[0]] * n
            elif n > len(phases):  # rows padded after the call's real ones
                phases = phases + [-1] * (n - len(phases))
            else:
                tally.unmapped += 1
                return None, None
        ph = torch.tensor(phases, dtype=torch.long)
        want = item.get("phase", "both")
        keep = ph >= 0 if want == "both" else ph == PERTURB_PHASES.index(want)
        return keep, ph

    def _change(self, t, entry: dict, k: int, count: bool = True):
        """`t` with the item's change on its rows in the item's phase (a new tensor), or `t`;
        `count` False: a further part of a value already counted (the residual of a sum)."""
        import torch

        item = self.plan[k]
        eps = float(item.get("eps", 0.0))
        if not isinstance(t, torch.Tensor) or not t.is_floating_point() or not self._applies(entry, item):
            return t
        tally = self.tallies[item["point"]]
        axis = int(entry.get("token_axis", 0))
        if t.dim() <= axis or not self.phases:
            tally.unmapped += 1
            return t
        keep, ph = self._mask(t.shape[axis], entry, item, tally)
        if keep is None or not bool(keep.any()):
            return t
        x = t.movedim(axis, 0)
        keep = keep.to(x.device)
        rows = x[keep].double()
        flat = rows.reshape(rows.shape[0], -1)
        if item.get("kind", "scale") == "noise":
            rms = flat.square().mean(-1, keepdim=True).sqrt()
            z = torch.randn(flat.shape, generator=self._gen[k], dtype=torch.float64).to(flat.device)
            new = (flat + eps * rms * z).reshape(rows.shape)
        else:
            new = rows * (1.0 + eps)
        # rounded to the engine's dtype: a change smaller than half its spacing (bfloat16: 2^-9 of the
        # value) is rounded away, and the change the run took (`stats`) says so
        new = new.to(x.dtype) if eps else x[keep]
        out = x.clone()
        out[keep] = new
        if not count:
            return out.movedim(0, axis)
        took = (new.detach().double() - rows.detach()).reshape(rows.shape[0], -1).square().sum(-1)
        size = flat.detach().square().sum(-1)
        row_phase = ph.to(x.device)[keep]
        for p in (0, 1):
            sel = row_phase == p
            if bool(sel.any()):
                tally.rows[p] += int(sel.sum())
                tally.change2[p] += float(took[sel].sum())
                tally.norm2[p] += float(size[sel].sum())
        return out.movedim(0, axis)

    def _apply(self, value, entry: dict, k: int):
        """The hook's output with the item's change where the entry's ``take`` says."""
        import torch

        how = entry.get("take", 0)
        if isinstance(value, torch.Tensor):
            return self._change(value, entry, k) if how in (0, "0", "sum") else value
        if not isinstance(value, (tuple, list)):
            return value
        parts = list(value)
        if how == "sum":  # (hidden, residual) whose sum is the value: scale each part, noise the first
            tensors = [i for i, v in enumerate(parts) if isinstance(v, torch.Tensor)]
            if tensors and self.plan[k].get("kind", "scale") == "noise":
                total = sum((parts[i] for i in tensors[1:]), parts[tensors[0]])
                parts[tensors[0]] = self._change(total, entry, k) - (total - parts[tensors[0]])
            for n, i in enumerate(tensors if self.plan[k].get("kind", "scale") != "noise" else ()):
                parts[i] = self._change(parts[i], entry, k, count=n == 0)
        else:
            i = int(how)
            if i < len(parts):
                parts[i] = self._change(parts[i], entry, k)
        return type(value)(parts) if isinstance(value, tuple) else parts

    # -- hooks
    def _output_hook(self, entry: dict, k: int):
        def hook(module, args, output):
            return self._apply(output, entry, k)
        return hook

    def _input_hook(self, entry: dict, k: int):
        def hook(module, args, kwargs):
            if args:
                return (self._change(args[0], entry, k), *args[1:]), kwargs
            if kwargs:
                name = next(iter(kwargs))
                return args, {**kwargs, name: self._change(kwargs[name], entry, k)}
            return None
        return hook

    def _wrap_method(self, obj, entry: dict, k: int) -> None:
        name = entry["method"]
        original = getattr(obj, name)
        had_own = name in getattr(obj, "__dict__", {})

        def wrapper(*args, **kwargs):
            return self._apply(original(*args, **kwargs), entry, k)

        setattr(obj, name, wrapper)
        self.restores.append(lambda: setattr(obj, name, original) if had_own else delattr(obj, name))

    def _wrap_function(self, entry: dict, k: int) -> bool:
        mod_name, _, attr = entry["function"].partition(":")
        try:
            mod = importlib.import_module(mod_name)
            original = getattr(mod, attr)
        except (ImportError, AttributeError):
            return False

        def wrapper(*args, **kwargs):
            return self._apply(original(*args, **kwargs), entry, k)

        setattr(mod, attr, wrapper)
        self.restores.append(lambda: setattr(mod, attr, original))
        return True

    # -- what it did
    def stats(self, reset: bool = False) -> dict:
        """Per point: rows changed and the relative change they took (sqrt of summed squared
        change over summed squared value), per phase; the points the model does not have; the
        forward calls seen."""
        out: dict[str, Any] = {"calls": self.calls, "missing": sorted(set(self.missing)), "points": {}}
        for point, t in self.tallies.items():
            out["points"][point] = {
                "rows": {"prefill": t.rows[0], "decode": t.rows[1]},
                "change": {name: (math.sqrt(t.change2[p] / t.norm2[p]) if t.norm2[p] > 0 else None)
                           for p, name in enumerate(("prefill", "decode"))},
                "unmapped": t.unmapped}
        if reset:
            self.tallies = {p: _Tally() for p in self.tallies}
            self.calls = 0
        return out


def worker_perturb(plan: list, spec_path: str, model) -> int:
    """Install the perturbation `plan` on this rank's `model` (vLLM's ``LLM.apply_model``);
    returns the rank. Any earlier perturbation is removed first."""
    old = _WORKER.pop("perturb", None)
    if old is not None:
        old.remove()
    p = Perturber(load_spec(spec_path), list(plan))
    p.install(model)
    _WORKER["perturb"] = p
    return rank_info()[0]


def worker_perturb_stats(model) -> dict:
    """What the installed perturbation changed since the last call (`Perturber.stats`, reset)."""
    p = _WORKER.get("perturb")
    return p.stats(reset=True) if isinstance(p, Perturber) else {}


def worker_unperturb(model) -> dict:
    """Remove the installed perturbation; returns what it changed since the last stats call."""
    p = _WORKER.pop("perturb", None)
    if not isinstance(p, Perturber):
        return {}
    p.remove()
    return p.stats()
