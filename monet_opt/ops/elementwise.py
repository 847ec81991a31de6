"""Dropout (default, or a 1-bit mask kept for backward) and default-only elementwise/view ops.

Dropout "default" is F.dropout run out of place: a pure function of the RNG state (the runtime
replays the RNG on recompute). On CPU torch's backward keeps the float scaled noise tensor
(same size and dtype as the input); on CUDA a bool mask (1 byte/element).
"mask_bitmask" draws exactly the same random numbers as default (same output, bitwise) but keeps
the mask packed 8 elements per byte; backward rebuilds the scaled noise.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .base import Implementation
from .common import out_of_place_default, pack_bits, unpack_bits


def _fused_path(x: torch.Tensor, p: float) -> bool:
    # mirrors at::native::dropout's is_fused_kernel_acceptable
    return (x.device.type not in ("cpu", "meta")) and 0 < p < 1 and x.numel() > 0


class DropoutBitmask(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, p: float):
        if _fused_path(x, p):
            out, mask = torch.ops.aten.native_dropout(x, p, True)
            ctx.fused = True
        else:
            noise = torch.empty_like(x).bernoulli_(1 - p)
            mask = noise.bool()
            noise.div_(1 - p)
            out = x * noise
            ctx.fused = False
            del noise
        ctx.p = p
        ctx.numel, ctx.shape = mask.numel(), mask.shape
        ctx.save_for_backward(pack_bits(mask))
        return out

    @staticmethod
    def backward(ctx, g):
        (packed,) = ctx.saved_tensors
        mask = unpack_bits(packed, ctx.numel, ctx.shape)
        p = ctx.p
        if ctx.fused:
            return torch.ops.aten.native_dropout_backward(g, mask, 1.0 / (1.0 - p)), None
        # Same values as CPU's noise tensor: 1 * (1/(1-p)) computed like noise.div_(1-p), or 0.
        noise = mask.view(torch.uint8).to(g.dtype).div_(1 - p)
        return g * noise, None


def dropout_bitmask(x: torch.Tensor, p: float = 0.5, training: bool = True) -> torch.Tensor:
    if not training or p == 0 or p == 1 or x.numel() == 0:
        return F.dropout(x, p, training)
    return DropoutBitmask.apply(x, float(p))


_DROPOUT_FUNCS = (F.dropout, torch.dropout)


def _dropout_args(target, args, kwargs):
    if isinstance(target, nn.Module):
        x = args[0] if args else kwargs["input"]
        return x, target.p, target.training
    if target is torch.dropout:  # torch.dropout(input, p, train)
        names = ("input", "p", "train")
        d = dict(zip(names, args))
        d.update(kwargs)
        return d["input"], d["p"], d["train"]
    names = ("input", "p", "training", "inplace")
    d = {"p": 0.5, "training": True}
    d.update(dict(zip(names, args)))
    d.update(kwargs)
    return d["input"], d["p"], d["training"]


def _run_bitmask(target, args, kwargs, recompute):
    x, p, training = _dropout_args(target, args, kwargs)
    return dropout_bitmask(x, p, training)


def matches(op: str, target: Any) -> bool:
    if op == "call_module":
        return type(target) is nn.Dropout
    return op == "call_function" and any(target is f for f in _DROPOUT_FUNCS)


def implementations(op: str, target: Any, example_args=None, example_kwargs=None) -> list[Implementation]:
    default = Implementation(
        "default",
        out_of_place_default(op, target).run,
        "torch dropout, out of place; backward keeps the scaled noise (CPU) / bool mask (CUDA)",
    )
    if op == "call_module" and (not target.training or target.p in (0, 1)):
        return [default]
    return [
        default,
        Implementation(
            "mask_bitmask",
            _run_bitmask,
            "dropout with the same random draw, keeping a 1-bit packed mask for backward",
        ),
    ]


IMPLEMENTATION_NAMES = {"dropout (nn.Dropout, F.dropout, torch.dropout)": ["default", "mask_bitmask"]}

# Families with only the default implementation, listed for documentation.
DEFAULT_ONLY = {
    "gelu / silu / sigmoid / tanh / hardswish / softmax": ["default"],
    "layer_norm / group_norm": ["default"],
    "avg / adaptive pooling": ["default"],
    "add / mul / cat / views / flatten / getitem (in-place forms run out of place)": ["default"],
    "anything else": ["default"],
}
