"""Max pooling (2d) whose backward keeps only compressed argmax offsets; other pools default.

- "default": torch's max_pool2d; backward keeps the input and int64 indices (per output element).
- "indices": backward keeps, per output element, the argmax's position inside its kernel window
  (uint8 when kH*kW <= 256, else int16/int32), derived from torch's own indices (so ties resolve
  exactly as torch does). Backward rebuilds the flat indices and calls torch's max-pool backward.
- "indices_channels_last": as "indices", but the forward runs torch's channels_last kernel on
  copies of a few samples at a time (batched NCHW input only). Same values, same argmax (exact);
  on CPU torch's NCHW max-pool kernel is much slower than its NHWC one.
  When it fits the same dtype, the position is stored as idx - (window corner index), which
  avoids integer divisions (e.g. 3x3 windows on rows up to 126 wide); otherwise as kh * kW + kw.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.utils import _pair

from .base import Implementation
from .common import memory_order, out_of_place_default

CHUNK_BYTES = 4 * 2**20  # channels_last copies in the "indices_channels_last" forward


def _offset_dtype(window: int) -> torch.dtype:
    if window <= 256:
        return torch.uint8
    if window <= 32767:
        return torch.int16
    return torch.int32


def _window_starts(out_hw, stride, padding, device):
    oh = torch.arange(out_hw[0], device=device).view(-1, 1) * stride[0] - padding[0]
    ow = torch.arange(out_hw[1], device=device).view(1, -1) * stride[1] - padding[1]
    return oh, ow


def _plan(kernel_size, dilation, W):
    """Offset encoding and its dtype. "rel": idx - (h0 * W + w0), no division, used when it fits the
    same dtype as the window offset kh * kW + kw ("window", which needs an integer division)."""
    kH, kW = kernel_size
    max_rel = (kH - 1) * dilation[0] * W + (kW - 1) * dilation[1]
    window_dtype = _offset_dtype(kH * kW)
    rel_dtype = _offset_dtype(max_rel + 1)
    if rel_dtype == window_dtype:
        return "rel", rel_dtype
    return "window", window_dtype


def _offsets(idx, W, kernel_size, stride, padding, dilation, mode, dtype):
    """torch's flat argmax indices (int64, consumed) -> window offsets of `dtype` (see `_plan`)."""
    h0, w0 = _window_starts(idx.shape[-2:], stride, padding, idx.device)
    base = h0 * W + w0
    if mode == "rel":
        return idx.sub_(base).to(dtype)
    ih = torch.div(idx, W, rounding_mode="floor")
    iw = idx.sub_(ih * W)
    kh = ih.sub_(h0).div_(dilation[0], rounding_mode="floor")
    kw = iw.sub_(w0).div_(dilation[1], rounding_mode="floor")
    return kh.mul_(kernel_size[1]).add_(kw).to(dtype)


def _pool_channels_last(x, kernel_size, stride, padding, dilation, ceil_mode, mode, dtype):
    """torch's max pool run on channels_last copies of a few samples at a time (on CPU, torch's
    NCHW kernel takes 25 ms for ResNet's 8x64x112x112 stem pool, its NHWC kernel 1.5 ms plus the
    copies). The values and the argmax indices are torch's own (the same kernel family resolves
    ties to the first maximum in the window, tested), written into NCHW buffers; the copies are
    the workspace (about CHUNK_BYTES)."""
    n = x.size(0)
    step = max(1, CHUNK_BYTES // max(1, x[0].numel() * x.element_size()))
    out = off = None
    for b in range(0, n, step):
        part = x[b : b + step].contiguous(memory_format=torch.channels_last)
        o, idx = torch.ops.aten.max_pool2d_with_indices(
            part, kernel_size, stride, padding, dilation, ceil_mode
        )
        del part
        if out is None:
            out = torch.empty((n, *o.shape[1:]), dtype=o.dtype, device=o.device)
            off = torch.empty((n, *o.shape[1:]), dtype=dtype, device=o.device)
        out[b : b + step].copy_(o)
        del o
        off[b : b + step].copy_(
            _offsets(idx, x.size(-1), kernel_size, stride, padding, dilation, mode, dtype)
        )
    return out, off


class MaxPool2dIndices(torch.autograd.Function):
    """Keeps, per output element, where its argmax lies in its window. torch's flat index is
    idx = (h0 + kh * dH) * W + (w0 + kw * dW), (h0, w0) the window's top-left corner."""

    @staticmethod
    def forward(ctx, x, kernel_size, stride, padding, dilation, ceil_mode, channels_last=False):
        mode, dtype = _plan(kernel_size, dilation, x.size(-1))
        if channels_last and x.dim() == 4 and x.is_contiguous() and x.size(0) > 0:
            out, off = _pool_channels_last(x, kernel_size, stride, padding, dilation, ceil_mode, mode, dtype)
        else:
            out, idx = torch.ops.aten.max_pool2d_with_indices(
                x, kernel_size, stride, padding, dilation, ceil_mode
            )
            off = _offsets(idx, x.size(-1), kernel_size, stride, padding, dilation, mode, dtype)
        ctx.params = (
            tuple(kernel_size),
            tuple(stride),
            tuple(padding),
            tuple(dilation),
            bool(ceil_mode),
            mode,
        )
        ctx.in_shape = x.shape
        ctx.in_dtype = x.dtype
        ctx.in_format = torch.contiguous_format if memory_order(x) is None else torch.channels_last
        ctx.save_for_backward(off)
        return out

    @staticmethod
    def backward(ctx, g):
        (off,) = ctx.saved_tensors
        kernel_size, stride, padding, dilation, ceil_mode, mode = ctx.params
        kW = kernel_size[1]
        W = ctx.in_shape[-1]
        h0, w0 = _window_starts(g.shape[-2:], stride, padding, g.device)
        base = h0 * W + w0
        if mode == "rel":
            idx = off.long().add_(base)
        else:
            off = off.long()
            kh = torch.div(off, kW, rounding_mode="floor")
            kw = off.sub_(kh * kW)
            idx = kh.mul_(dilation[0] * W).add_(kw.mul_(dilation[1])).add_(base)
            del kh, kw
        # torch's own max-pool backward; it reads only the sizes of its `self` argument, and lays
        # its result out as `self`: here as the input was (a channels_last input's gradient
        # allocated contiguous took 102 ms and twice the memory for ResNet's stem pool, torch 29 ms).
        shape_only = torch.empty((1,), dtype=ctx.in_dtype, device=g.device).expand(ctx.in_shape)
        grad_in = torch.empty(ctx.in_shape, dtype=ctx.in_dtype, device=g.device, memory_format=ctx.in_format)
        torch.ops.aten.max_pool2d_with_indices_backward.grad_input(
            g,
            shape_only,
            list(kernel_size),
            list(stride),
            list(padding),
            list(dilation),
            ceil_mode,
            idx,
            grad_input=grad_in,
        )
        return grad_in, None, None, None, None, None, None


def max_pool2d_indices(
    x, kernel_size, stride=None, padding=0, dilation=1, ceil_mode=False, channels_last=False
):
    kernel_size = _pair(kernel_size)
    stride = (
        kernel_size
        if stride is None or (isinstance(stride, (list, tuple)) and len(stride) == 0)
        else _pair(stride)
    )
    return MaxPool2dIndices.apply(
        x, kernel_size, stride, _pair(padding), _pair(dilation), bool(ceil_mode), bool(channels_last)
    )


_FUNCTIONS = (F.max_pool2d, torch.max_pool2d)
_PARAM_NAMES = ("kernel_size", "stride", "padding", "dilation", "ceil_mode", "return_indices")
_PARAM_DEFAULTS = {"stride": None, "padding": 0, "dilation": 1, "ceil_mode": False, "return_indices": False}


def _functional_params(args: tuple, kwargs: dict) -> tuple[torch.Tensor, dict]:
    x = args[0] if args else kwargs["input"]
    p = dict(_PARAM_DEFAULTS)
    p.update(dict(zip(_PARAM_NAMES, args[1:])))
    p.update({k: v for k, v in kwargs.items() if k != "input"})
    return x, p


def _runner(channels_last: bool):
    def run(target, args, kwargs, recompute):
        if isinstance(target, nn.Module):
            x = args[0] if args else kwargs["input"]
            return max_pool2d_indices(
                x,
                target.kernel_size,
                target.stride,
                target.padding,
                target.dilation,
                target.ceil_mode,
                channels_last,
            )
        x, p = _functional_params(args, kwargs)
        if p["return_indices"]:
            return target(*args, **kwargs)
        return max_pool2d_indices(
            x, p["kernel_size"], p["stride"], p["padding"], p["dilation"], p["ceil_mode"], channels_last
        )

    return run


def _batched_nchw(args: tuple, kwargs: dict) -> bool:
    x = args[0] if args else kwargs.get("input")
    return isinstance(x, torch.Tensor) and x.dim() == 4 and x.is_contiguous()


def matches(op: str, target: Any) -> bool:
    if op == "call_module":
        return isinstance(target, nn.MaxPool2d)
    return op == "call_function" and any(target is f for f in _FUNCTIONS)


def implementations(op: str, target: Any, example_args=None, example_kwargs=None) -> list[Implementation]:
    default = out_of_place_default(op, target)
    default = Implementation("default", default.run, "torch max_pool2d; backward keeps input + int64 indices")
    if op == "call_module":
        returns_indices = target.return_indices
    else:
        try:
            returns_indices = bool(
                _functional_params(tuple(example_args or ()) or (None,), dict(example_kwargs or {}))[1][
                    "return_indices"
                ]
            )
        except Exception:
            returns_indices = True  # cannot tell: stay safe
    if returns_indices:
        return [default]
    return [
        default,
        Implementation(
            "indices",
            _runner(False),
            "max_pool2d whose backward keeps only the argmax offset in its window (uint8)",
        ),
        Implementation(
            "indices_channels_last",
            _runner(True),
            "as indices, the forward run by torch's channels_last kernel a few samples at a time",
            applies=_batched_nchw,
        ),
    ]


IMPLEMENTATION_NAMES = {
    "max_pool2d (nn.MaxPool2d, F.max_pool2d)": ["default", "indices", "indices_channels_last"]
}
