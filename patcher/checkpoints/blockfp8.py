"""Block-FP8 (e4m3) arithmetic of DeepSeek-V3's checkpoints, in torch.

DeepSeek-V3 stores each projection weight W [rows, cols] as ``float8_e4m3fn`` Q plus a float32
``weight_scale_inv`` S with one value per 128 x 128 block (the grid rounds up; a partial block at
the edge is scaled like a full one). The weight it means is ``W = Q x S`` blockwise
(DeepSeek-V3's README_WEIGHTS.md, "Dequantization Method"); at run time the engine quantizes
activations per token and 128 channels ("activation_scheme": "dynamic").

Standalone on purpose (torch and the standard library only, nothing of dsadapt): the HF
reference runner, which never imports dsadapt, loads this one file by its path.
"""

from __future__ import annotations

from typing import Any

E4M3_MAX = 448.0


def grid(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, int]:
    return -(-shape[0] // block[0]), -(-shape[1] // block[1])


def quantize(w: Any, block: tuple[int, int] = (128, 128)) -> tuple[Any, Any]:
    """(Q float8_e4m3fn, S float32) with ``Q x S`` ~= `w` blockwise: S = amax(|block|) / 448."""
    import torch

    rows, cols = w.shape
    gr, gc = grid(w.shape, block)
    pad = torch.zeros(gr * block[0], gc * block[1], dtype=torch.float32)
    pad[:rows, :cols] = w
    b = pad.view(gr, block[0], gc, block[1])
    amax = b.abs().amax(dim=(1, 3))
    scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    q = (b / scale[:, None, :, None]).clamp_(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q.view(gr * block[0], gc * block[1])[:rows, :cols].contiguous(), scale.contiguous()


def scale_grid(scale: Any, shape: tuple[int, ...], block: tuple[int, int]) -> Any:
    """The block scales expanded to one value per element of a `shape` weight (float32)."""
    rows, cols = shape
    return scale.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)[:rows, :cols]


def dequantize(q: Any, scale: Any, block: tuple[int, int] = (128, 128), dtype: Any = None) -> Any:
    """``Q x S`` blockwise, in float32 (or `dtype`)."""
    import torch

    w = q.to(torch.float32)
    apply_scales_(w, scale, block)
    return w if dtype is None else w.to(dtype)


def apply_scales_(w: Any, scale: Any, block: tuple[int, int] = (128, 128)) -> Any:
    """Multiply float32 `w` (the FP8 values, already widened) by its block scales in place, one
    row block at a time: no second copy of the weight is ever made."""
    rows, cols = w.shape
    if tuple(scale.shape) != grid(w.shape, block):
        raise ValueError(f"a {list(w.shape)} weight in {block[0]}x{block[1]} blocks needs a "
                         f"{list(grid(w.shape, block))} scale grid, got {list(scale.shape)}")
    s = scale.to(device=w.device, dtype=w.dtype)
    for i in range(s.shape[0]):
        r0, r1 = i * block[0], min((i + 1) * block[0], rows)
        w[r0:r1].mul_(s[i].repeat_interleave(block[1])[:cols])
    return w


#: Activation rounding modes of `quantize_activations`: what a correct engine does ("e4m3") and
#: the FP8 bugs the gate is calibrated on (docs/equivalence.md, "Block FP8").
ACTIVATION_FORMATS = ("e4m3", "e5m2")


def quantize_activations(x: Any, group: int = 128, fmt: str = "e4m3") -> Any:
    """What a dynamic block-FP8 GEMM does to its input, emulated: each token's channels in groups of
    `group` scaled to e4m3's range (scale = amax / 448), rounded to e4m3 and scaled back (returns x's
    dtype). `fmt` "e5m2" rounds through e5m2 first (2 mantissa bits instead of 3; what an engine that
    quantizes its activations in the wrong FP8 format feeds its e4m3 GEMM)."""
    import torch

    if fmt not in ACTIVATION_FORMATS:
        raise ValueError(f"activation format {fmt!r}: one of {', '.join(ACTIVATION_FORMATS)}")
    shape = x.shape
    cols = shape[-1]
    flat = x.reshape(-1, cols).to(torch.float32)
    ng = -(-cols // group)
    pad = torch.zeros(flat.shape[0], ng * group, dtype=torch.float32, device=x.device)
    pad[:, :cols] = flat
    g = pad.view(flat.shape[0], ng, group)
    amax = g.abs().amax(dim=-1, keepdim=True).clamp_(min=1e-12)
    s = amax / E4M3_MAX
    v = (g / s).clamp_(-E4M3_MAX, E4M3_MAX)
    if fmt == "e5m2":
        v = v.to(torch.float8_e5m2).to(torch.float32)
    q = v.to(torch.float8_e4m3fn).to(torch.float32) * s
    return q.view(flat.shape[0], ng * group)[:, :cols].reshape(shape).to(x.dtype)
