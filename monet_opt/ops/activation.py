"""Activations: ReLU / ReLU6 / Hardtanh with a 1-bit-mask backward; GELU, SiLU & co. default only.

- "default": torch's kernel run out of place. ReLU saves its output, Hardtanh/ReLU6 its input.
- "bitmask": saves only which elements pass the gradient, packed 8 per byte (1/32 of fp32).
  Backward zeroes the incoming gradient where the mask is off, in place (`grad_in_place`): no
  new gradient buffer; the mask is unpacked an eighth at a time (temporaries ~1/16 of the
  gradient); bitwise identical to torch's threshold/hardtanh backward.
- "inplace_grad" (ReLU): keeps the output like torch, backward is torch's threshold_backward
  written into the incoming gradient (no new buffer, no temporary).
- "input_activated" (ReLU): keeps its *input* instead of its output (x > 0 exactly where
  relu(x) > 0, NaN included), backward written into the incoming gradient like "inplace_grad".
  Same cost as torch's ReLU; it pays when the input is kept anyway: behind an output-activated
  BatchNorm (which keeps that same tensor), the ReLU's output no longer has to be kept for the
  ReLU's backward, and the next convolution can recompute it from the kept input in one cheap
  pass. Conv -> BN -> ReLU then keeps one activation instead of two, without a bit-mask pass.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .base import Implementation
from .common import (
    first_tensor,
    inverse,
    memory_order,
    out_of_place_default,
    pack_bits,
    refuse_higher_order,
    unpack_bits,
)

# ------------------------------------------------------------------ autograd functions


_MIN_CHUNK = 4096  # elements per unpacked piece below which the mask is unpacked whole


def _laid_out_as(grad: torch.Tensor, stride: tuple[int, ...]) -> torch.Tensor:
    """Where a ReLU's backward writes its result: torch's (threshold_backward) is laid out as the
    saved tensor, strides `stride`, whatever the gradient's layout, and the next backward's kernels
    round by layout (a channels_last rexnet's SE ReLUs got gradients strided (87, 1, 87, 87)
    against their output's (87, 1, 1, 1): written in place, the 1x1 convolutions' backward took
    another kernel and 202 of 227 gradients differed from plain's in the last bits). `grad`
    restrided where its strides differ from those only on size-1 dimensions (no copy), else
    `grad` itself. (A copy laid out as torch's where the layouts differ, as torch allocates one,
    was tried: the profile does not count it, and a channels_last resnet18 at its lowest budget
    measured 135 KB over its prediction and 93 KB over its budget.)"""
    if grad.stride() != stride and all(
        a == b for a, b, n in zip(grad.stride(), stride, grad.shape) if n != 1
    ):
        return grad.as_strided(grad.shape, stride, grad.storage_offset())
    return grad


def _pack_mask(ctx, mask: torch.Tensor) -> torch.Tensor:
    """`mask` packed in its memory order (`memory_order`: a channels_last mask is packed through
    its contiguous permutation), with what `_masked_grad` needs to read it on ctx."""
    ctx.numel, ctx.perm, ctx.stride = mask.numel(), memory_order(mask), mask.stride()
    return pack_bits(mask if ctx.perm is None else mask.permute(ctx.perm))


def _masked_grad(grad: torch.Tensor, packed: torch.Tensor, ctx) -> torch.Tensor:
    """grad where the packed mask is set, else 0, written into `grad` itself (the runtime hands
    this backward a gradient nobody else holds). Like torch's relu backward, inf/NaN gradients at
    masked positions become 0, not NaN: the mask, as 0/1 in grad's dtype, goes through torch's
    own threshold_backward (on CPU 4 ms for ResNet-50's 8x64x112x112 stem ReLU, where
    masked_fill_ with a bool mask took 14 ms). The mask is in the order `_pack_mask` packed it
    (ctx.perm: a channels_last one's)."""
    numel, perm = ctx.numel, ctx.perm
    if ctx.relu:
        grad = _laid_out_as(grad, ctx.stride)
    ordered = grad if perm is None else grad.permute(perm)  # (grad as the mask was packed)
    if ordered.is_contiguous() and numel >= 8 * _MIN_CHUNK:
        # unpack an eighth at a time: the temporaries stay ~1/8 of the gradient
        flat = ordered.view(-1)
        step = (-(-numel // 8) + 7) // 8 * 8  # a multiple of 8: chunks start on a packed byte
        for start in range(0, numel, step):
            n = min(step, numel - start)
            keep = unpack_bits(packed[start // 8 : (start + n + 7) // 8], n, (n,))
            part = flat[start : start + n]
            _keep_where(part, keep)
        return grad
    keep = unpack_bits(packed, numel, ordered.shape)
    return _keep_where(grad, keep if perm is None else keep.permute(inverse(perm)))


def _keep_where(grad: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    ones = keep.view(torch.uint8).to(grad.dtype)
    return torch.ops.aten.threshold_backward.grad_input(grad, ones, 0, grad_input=grad)


class ReLUInplaceGrad(torch.autograd.Function):
    """torch's ReLU, keeping its output; the backward overwrites the incoming gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(x)
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        refuse_higher_order("inplace_grad")
        (y,) = ctx.saved_tensors
        grad = _laid_out_as(grad, y.stride())
        return torch.ops.aten.threshold_backward.grad_input(grad, y, 0, grad_input=grad)


class ReLUInplaceGradInPlace(ReLUInplaceGrad):
    """`ReLUInplaceGrad` computed into its input's storage: the runtime's choice where the
    schedule frees the input right after and nothing else holds it (`ScheduleExecutor._may_reuse`),
    as it runs torch's ReLU in place there."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        ctx.mark_dirty(x)
        y = torch.relu_(x)
        ctx.save_for_backward(y)
        return y


def relu_inplace_grad_(x: torch.Tensor) -> torch.Tensor:
    return ReLUInplaceGradInPlace.apply(x)


class ReLUInputActivated(torch.autograd.Function):
    """ReLU keeping its input; the backward overwrites the incoming gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        y = torch.relu(x)
        ctx.stride = y.stride()  # (torch's backward lays its result out as y, not always as x)
        return y

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        refuse_higher_order("input_activated")
        (x,) = ctx.saved_tensors
        # grad where x > 0, else 0: where relu(x) > 0, which is torch's relu backward
        grad = _laid_out_as(grad, ctx.stride)
        return torch.ops.aten.threshold_backward.grad_input(grad, x, 0, grad_input=grad)


class ReLUBitmask(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(x)
        # torch's backward: grad where result > 0, i.e. not (result <= 0) (NaN passes the gradient).
        # relu's output is >= 0 or NaN, so "not (y <= 0)" is "y != 0", i.e. y.bool().
        ctx.save_for_backward(_pack_mask(ctx, y.bool()))
        ctx.relu = True  # (torch's relu backward lays its result out as y; hardtanh's as the gradient)
        return y

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        refuse_higher_order("bitmask")
        (packed,) = ctx.saved_tensors
        return _masked_grad(grad, packed, ctx)


class HardtanhBitmask(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, min_val: float, max_val: float) -> torch.Tensor:
        y = F.hardtanh(x, min_val, max_val)
        # torch's hardtanh_backward: 0 where input <= min or input >= max, else grad.
        # lo < x < hi (or x is NaN) exactly when the clamped output y is strictly inside (or NaN):
        # hardtanh_backward(1, y) is 1 there and 0 elsewhere.
        ones = torch.ones((), dtype=y.dtype, device=y.device).expand_as(y)
        keep = torch.ops.aten.hardtanh_backward(ones, y, min_val, max_val).bool()
        ctx.save_for_backward(_pack_mask(ctx, keep))
        ctx.relu = False
        return y

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        refuse_higher_order("bitmask")
        (packed,) = ctx.saved_tensors
        return _masked_grad(grad, packed, ctx), None, None


def relu_bitmask(x: torch.Tensor) -> torch.Tensor:
    return ReLUBitmask.apply(x)


def hardtanh_bitmask(x: torch.Tensor, min_val: float = -1.0, max_val: float = 1.0) -> torch.Tensor:
    return HardtanhBitmask.apply(x, float(min_val), float(max_val))


# ------------------------------------------------------------------ matching

RELU_FUNCTIONS = {F.relu, torch.relu, torch.relu_, F.relu_, torch.Tensor.relu, torch.Tensor.relu_}
RELU_METHODS = {"relu", "relu_"}
HARDTANH_FUNCTIONS = {F.hardtanh, F.hardtanh_, F.relu6}
HARDTANH_METHODS: set[str] = set()
DEFAULT_ONLY_MODULES = (
    nn.GELU,
    nn.SiLU,
    nn.Sigmoid,
    nn.Tanh,
    nn.Hardswish,
    nn.Hardsigmoid,
    nn.Mish,
    nn.LeakyReLU,
    nn.ELU,
    nn.Softmax,
    nn.LogSoftmax,
)


def _is_relu(op: str, target: Any) -> bool:
    if op == "call_module":
        return type(target) is nn.ReLU
    if op == "call_method":
        return target in RELU_METHODS
    return target in RELU_FUNCTIONS


def _hardtanh_bounds(op: str, target: Any, args: tuple, kwargs: dict) -> tuple[float, float]:
    if op == "call_module":
        return float(target.min_val), float(target.max_val)
    if target is F.relu6:
        return 0.0, 6.0
    # F.hardtanh(input, min_val=-1., max_val=1., inplace=False)
    rest = list(args[1:3])
    min_val = rest[0] if len(rest) > 0 else kwargs.get("min_val", -1.0)
    max_val = rest[1] if len(rest) > 1 else kwargs.get("max_val", 1.0)
    return float(min_val), float(max_val)


def _is_hardtanh(op: str, target: Any) -> bool:
    if op == "call_module":
        return isinstance(target, nn.Hardtanh)  # includes nn.ReLU6
    if op == "call_method":
        return target in HARDTANH_METHODS
    return target in HARDTANH_FUNCTIONS


# ------------------------------------------------------------------ family entry points


def matches(op: str, target: Any) -> bool:
    return _is_relu(op, target) or _is_hardtanh(op, target)


def implementations(op: str, target: Any, example_args=None, example_kwargs=None) -> list[Implementation]:
    default = out_of_place_default(op, target)
    if _is_relu(op, target):
        bitmask = Implementation(
            "bitmask",
            lambda t, args, kwargs, recompute: relu_bitmask(first_tensor(args, kwargs)),
            "ReLU keeping a 1-bit packed mask of positive outputs (numel/8 bytes); gradient in place",
            grad_in_place=True,
        )
        inplace_grad = Implementation(
            "inplace_grad",
            lambda t, args, kwargs, recompute: ReLUInplaceGrad.apply(first_tensor(args, kwargs)),
            "torch ReLU keeping its output; backward writes the input gradient into the output's",
            grad_in_place=True,
        )
        input_activated = Implementation(
            "input_activated",
            lambda t, args, kwargs, recompute: ReLUInputActivated.apply(first_tensor(args, kwargs)),
            "ReLU keeping its input instead of its output; backward writes the input gradient into the output's",
            grad_in_place=True,
        )
        return [
            Implementation("default", default.run, "torch ReLU, out of place; backward keeps its output"),
            bitmask,
            inplace_grad,
            input_activated,
        ]
    if _is_hardtanh(op, target):

        def run_bitmask(t, args, kwargs, recompute):
            lo, hi = _hardtanh_bounds(op, t, args, kwargs)
            return hardtanh_bitmask(first_tensor(args, kwargs), lo, hi)

        return [
            Implementation(
                "default", default.run, "torch Hardtanh/ReLU6, out of place; backward keeps its input"
            ),
            Implementation(
                "bitmask",
                run_bitmask,
                "Hardtanh/ReLU6 keeping a 1-bit packed mask of min<x<max (numel/8 bytes); gradient in place",
                grad_in_place=True,
            ),
        ]
    return [default]


FAMILY_NAME = "activation"
IMPLEMENTATION_NAMES = {
    "relu (nn.ReLU, F.relu, torch.relu, .relu)": ["default", "bitmask", "inplace_grad", "input_activated"],
    "hardtanh (nn.ReLU6, nn.Hardtanh, F.relu6, F.hardtanh)": ["default", "bitmask"],
}
