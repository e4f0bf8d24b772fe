"""Plant a known slowdown into an engine checkout, for calibrating the speed gate (`dsadapt perf`).

    python3 tools/plant_decode_work.py CHECKOUT [--engine vllm|lmdeploy]
    python tools/plant_decode_work.py --product-cost      (with an engine environment's python: torch)

Edits the DeepSeek decoder layer of the checkout (`dsadapt apply` made it; commit and
`dsadapt refresh` afterwards, as for any patch): at the start of every decoder layer's forward
pass, a number of chained 64x64 matrix products on the layer's device and dtype, with an
identity matrix, so the output is exactly unchanged (the gate's logits still pass). The number
comes from DSADAPT_PLANTED_MATMULS (read once, when the model module is imported; 0 or unset:
nothing): "N" is N products at every step whatever the batch; "1:N1,16:N16" sets it by the
step's token count (N1 for a step of one token -- decode at concurrency 1 --, N16 for 16,
straight lines between, the nearest end outside), so that one build can cost the same fraction
of a step at every concurrency although a step of 16 sequences costs more than one of 1 (on a
CPU; a GPU step of a small model costs about the same whatever the batch). A CUDA graph captures
the products of its batch size and replays them at every decode step; it is not a Python sleep,
which a graph would skip. The knob is read from the environment, so one build serves the A/A runs (0) and
every planted strength (N) without rebuilding; the unpatched build has no such code, so only
the patched side pays. tools/calibrate_speed.sh uses it; docs/speed.md has the numbers.

`--product-cost` prints the microseconds one planted product costs here (on the GPU inside a
CUDA graph when there is one, as the engine replays it; else on the CPU, one thread), which is
how tools/device/perf_h200.sh sizes the plant for a target slowdown.
"""

from __future__ import annotations

import argparse
import ast
import re
import sys
from pathlib import Path

#: engine -> the file holding its DeepSeek decoder layer (the class is DeepseekV2DecoderLayer in both)
FILES = {"vllm": "vllm/model_executor/models/deepseek_v2.py",
         "lmdeploy": "lmdeploy/pytorch/models/deepseek_v2.py"}
CLASS = "class DeepseekV2DecoderLayer("
MARK = "DSADAPT_PLANTED_MATMULS"
KNOB = f"""
# planted by tools/plant_decode_work.py (speed-gate calibration, never shipped): {MARK}
# chained 64x64 products per decoder layer and forward pass: "N" (every step), or "T:N,T:N,..." (by the
# step's token count: N at T tokens, straight lines between, the nearest end outside)
def _dsadapt_planted_table(text):
    if ":" not in text:
        return ((1, int(text or 0)),)
    return tuple(sorted((int(t), int(n)) for t, n in (x.split(":") for x in text.split(",") if x.strip())))


_DSADAPT_PLANTED = _dsadapt_planted_table(__import__('os').environ.get('{MARK}') or '0')


def _dsadapt_planted_products(tokens):
    pts = _DSADAPT_PLANTED
    if tokens <= pts[0][0]:
        return pts[0][1]
    for (t0, n0), (t1, n1) in zip(pts, pts[1:]):
        if tokens <= t1:
            return round(n0 + (n1 - n0) * (tokens - t0) / (t1 - t0))
    return pts[-1][1]

"""
WORK = """\
        _dsadapt_n = _dsadapt_planted_products(hidden_states.numel() // hidden_states.shape[-1]) \\
            if any(n for _t, n in _DSADAPT_PLANTED) else 0
        if _dsadapt_n:  # planted: a fixed amount of device work per layer and step (by its token count)
            _eye = torch.eye(64, device=hidden_states.device, dtype=hidden_states.dtype)
            _x = _eye
            for _ in range(_dsadapt_n):
                _x = torch.mm(_x, _eye)
            hidden_states = hidden_states + (_x[0, 0] - 1)  # exactly + 0: keeps the products live
"""


def plant(text: str) -> str:
    """Pure: the module's text with the knob after its imports and the work at the top of the
    decoder layer's forward (ValueError when the file does not have the expected shape)."""
    if MARK in text:
        raise ValueError("already planted")
    start = text.find(CLASS)
    if start < 0:
        raise ValueError(f"no {CLASS.rstrip('(')} in the file")
    m = re.compile(r"\n    def forward\(\s*\n?(.*?)\n(    \)[^\n]*:|[^\n]*\):)\n", re.S).search(text, start)
    if m is None or "hidden_states" not in m.group(0):
        raise ValueError("the decoder layer's forward(...) with a hidden_states argument was not found")
    body = m.end()
    # the knob goes after the last top-level import before the class
    class_line = text.count("\n", 0, start) + 1
    ends = [n.end_lineno for n in ast.parse(text).body
            if isinstance(n, (ast.Import, ast.ImportFrom)) and n.lineno < class_line and n.end_lineno]
    if not ends:
        raise ValueError("no imports before the decoder layer")
    at = len("".join(text.splitlines(keepends=True)[:max(ends)]))
    return text[:at] + KNOB + text[at:body] + WORK + text[body:]


def product_cost(n: int = 200, repeat: int = 20) -> float:
    """Microseconds per planted product (a chain of `n`, the median of `repeat`): inside a CUDA graph
    on the GPU when torch sees one, else eagerly on one CPU thread."""
    import statistics
    import time

    import torch

    eye_of = (lambda: torch.eye(64, device="cuda", dtype=torch.bfloat16)) if torch.cuda.is_available() \
        else (lambda: torch.eye(64))

    def work():
        x = eye = eye_of()
        for _ in range(n):
            x = torch.mm(x, eye)
        return x

    if torch.cuda.is_available():
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            work()
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            work()
        times = []
        for _ in range(repeat):
            torch.cuda.synchronize()
            t = time.perf_counter()
            graph.replay()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
    else:
        torch.set_num_threads(1)
        work()
        times = []
        for _ in range(repeat):
            t = time.perf_counter()
            work()
            times.append(time.perf_counter() - t)
    return statistics.median(times) / n * 1e6


def main(argv: list[str]) -> int:
    if argv == ["--product-cost"]:
        print(f"{product_cost():.3f}")
        return 0
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("checkout", type=Path)
    p.add_argument("--engine", choices=sorted(FILES), default=None, help="default: from the checkout's files")
    args = p.parse_args(argv)
    engine = args.engine or next((e for e, f in FILES.items() if (args.checkout / f).is_file()), None)
    if engine is None:
        print(f"error: {args.checkout} holds neither {' nor '.join(FILES.values())}", file=sys.stderr)
        return 2
    path = args.checkout / FILES[engine]
    try:
        path.write_text(plant(path.read_text(encoding="utf-8")), encoding="utf-8")
    except ValueError as e:
        print(f"error: {path}: {e}", file=sys.stderr)
        return 2
    print(f"planted {MARK} into {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
