"""2-d convolution: torch's kernel, or batch-chunked execution.

- "default": F.conv2d; backward keeps the input (and the weight, a parameter). Its state can be
  made from the input alone, without the forward (`Conv2dFromInput`: a schedule's `make_state`,
  in the convolution's own backward stage, where a recomputation would run the forward only to
  make the autograd node).
- "chunked": the batch is split into 2 chunks, each convolved (forward) and differentiated
  (backward, via aten.convolution_backward) separately, results written into preallocated
  tensors. Keeps the same tensors as default (input + weight); what it buys is a smaller
  transient workspace (im2col/oneDNN/cuDNN scratch scales with the batch), at some time cost.
- "chunked_backward" (every device): the forward is F.conv2d itself (bitwise the default's
  output); the backward runs per batch chunk (up to 8) into preallocated gradients. Same kept
  tensors; the backward's workspace shrinks with the chunk (oneDNN on CPU copies the whole
  output gradient into its blocked layout: ResNet-50's layer2.0.conv1 at batch 8, 224x224
  measured 61.5 -> 32.5 MiB). Gradients differ from torch's by float rounding only: input
  gradients were bitwise equal in ResNet-50's shapes (tiny convs may take another per-sample
  algorithm), weight gradients are summed over chunks (~2e-7 relative, 6e-6 for the 7x7 stem).
- "gemm_backward" (1x1 kernel, no padding or dilation, one group, a contiguous 4-d input): the
  forward is F.conv2d itself (bitwise the default's output); the backward is the matrix products
  a 1x1 convolution is, on the tensors' own memory: grad x[n] = W^T @ g[n] (one `bmm`), grad W =
  sum_n g[n] @ x[n]^T (one `bmm` and a sum where its (batch, out, in) temporary is no larger than
  the gradient, else one `addmm` per sample). With a stride (ResNet downsamples) the products
  read a copy of the input's strided rows and columns, and grad x is zero but at those
  positions. Same kept tensors as the default (input + weight); its state can be made from the
  input. On this CPU (session 59, 2 threads, ResNet-50 b8 224 shapes,
  `benchmarks/results/session59/conv1x1_micro.py`) oneDNN's 1x1 convolution backward on NCHW
  tensors takes 1.06-1.4x the time of these products in layer1-3's shapes; layer4's (7x7 maps)
  are slower this way (0.85-0.98x), and the profile decides per node. Gradients differ from
  torch's by float rounding (~1e-6 of the largest on the test models). The forward as products
  too was faster still (1.1-1.7x), but its outputs differ from oneDNN's by rounding, which
  small-batch BatchNorms downstream amplify: ResNet-50's stem gradient moved 7e-4 of its largest
  element in the tests. Strided (session 60, the same script with `--strided`,
  `benchmarks/results/session60/conv1x1_strided_micro.txt`): ResNet-50's layer2 downsample
  (256->512, 56x56, stride 2) forward + backward took 59.9 ms with oneDNN's backward, 28.3 with
  the products; layer3's and layer4's 29.4 -> 24.3 and 31.5 -> 29.4.
- "zero_packed_input": the forward is F.conv2d itself; the backward state keeps the input packed
  (`zero_pack`: a bit per element and the nonzero elements, lossless) instead of the input's
  storage, and unpacks it for the backward (aten.convolution_backward, as torch's own). For a
  ReLU output of density d that is n/8 + 4dn bytes instead of 4n: ResNet-50's block outputs
  (relu after the residual addition, which the next block's first convolution keeps) measured
  d = 0.50-0.78 at initialisation. Offered when the example input has at least
  `ZERO_PACK_MIN_ZEROS` exact zeros. Its memory depends on the data: the profile records the
  packed size of the example input, and a denser input in training packs larger.
- CUDA only: "cudnn_benchmark" / "cudnn_deterministic" run forward and backward under those
  cuDNN flags (different algorithms, hence different workspace and time). Not offered on CPU.
"""

from __future__ import annotations

import contextvars
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.utils import _pair

from . import zero_pack
from .base import Implementation
from .common import first_tensor, is_fake_or_meta, out_of_place_default

# True while the runtime runs a node whose weight gradient it makes after the last backward
# stage (`monet_opt.runtime.deferred`): the Functions here then make no weight or bias gradient
# in their backward, as aten's convolution backward makes none when the engine does not ask for it
WEIGHT_DEFERRED: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "monet_opt_weight_deferred", default=False
)


def _chunk_bounds(n: int, chunks: int) -> list[tuple[int, int]]:
    chunks = max(1, min(chunks, n))
    size = -(-n // chunks)
    return [(i, min(i + size, n)) for i in range(0, n, size)]


def _conv_backward(g, x, weight, bias_sizes, stride, padding, dilation, groups, mask):
    """aten's conv2d backward: (grad input, grad weight, grad bias) as `mask` asks."""
    return torch.ops.aten.convolution_backward(
        g, x, weight, bias_sizes, list(stride), list(padding), list(dilation), False, [0, 0], groups, mask
    )


class Conv2dChunked(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, stride, padding, dilation, groups, chunks):
        bounds = _chunk_bounds(x.size(0), chunks)
        out = None
        for a, b in bounds:
            y = F.conv2d(x[a:b], weight, bias, stride, padding, dilation, groups)
            if out is None:
                if len(bounds) == 1:
                    out = y
                    break
                out = torch.empty(
                    (x.size(0),) + y.shape[1:],
                    dtype=y.dtype,
                    device=y.device,
                    memory_format=_memory_format(y),
                )
            out[a:b].copy_(y)
            del y
        ctx.params = (stride, padding, dilation, groups, chunks)
        ctx.bias_sizes = None if bias is None else list(bias.shape)
        ctx.save_for_backward(x, weight)
        ctx.deferred = WEIGHT_DEFERRED.get()
        return out

    @staticmethod
    def backward(ctx, g):
        return _chunked_backward(ctx, g)


class Conv2dChunkedBackward(torch.autograd.Function):
    """F.conv2d forward (the default's very output); backward over batch chunks."""

    @staticmethod
    def forward(ctx, x, weight, bias, stride, padding, dilation, groups, chunks):
        ctx.params = (stride, padding, dilation, groups, chunks)
        ctx.bias_sizes = None if bias is None else list(bias.shape)
        ctx.save_for_backward(x, weight)
        ctx.deferred = WEIGHT_DEFERRED.get()
        return F.conv2d(x, weight, bias, stride, padding, dilation, groups)

    @staticmethod
    def backward(ctx, g):
        return _chunked_backward(ctx, g)


def _grad_mask(ctx) -> list[bool]:
    """aten.convolution_backward's output mask: (input, weight, bias) as the Function's needs say
    (no weight or bias gradient where the runtime makes it after the backward: WEIGHT_DEFERRED)."""
    return [
        ctx.needs_input_grad[0],
        ctx.needs_input_grad[1] and not ctx.deferred,
        ctx.needs_input_grad[2] and ctx.bias_sizes is not None and not ctx.deferred,
    ]


def _chunked_backward(ctx, g):
    """Conv2d backward one batch chunk at a time (ctx.params, ctx.bias_sizes, saved x and weight)."""
    x, weight = ctx.saved_tensors
    stride, padding, dilation, groups, chunks = ctx.params
    mask = _grad_mask(ctx)
    gx = torch.empty_like(x) if mask[0] else None
    gw = gb = None
    for a, b in _chunk_bounds(x.size(0), chunks):
        cgx, cgw, cgb = _conv_backward(
            g[a:b], x[a:b], weight, ctx.bias_sizes, stride, padding, dilation, groups, mask
        )
        if mask[0]:
            gx[a:b].copy_(cgx)
        # (summed in float32 at least, rounded once: bfloat16 partial sums under autocast drifted
        # 0.9 % of the largest gradient from the default's)
        if mask[1]:
            gw = cgw.to(_SUM_DTYPE.get(cgw.dtype, cgw.dtype)) if gw is None else gw.add_(cgw)
        if mask[2]:
            gb = cgb.to(_SUM_DTYPE.get(cgb.dtype, cgb.dtype)) if gb is None else gb.add_(cgb)
        del cgx, cgw, cgb
    gw = None if gw is None else gw.to(weight.dtype)
    gb = None if gb is None else gb.to(weight.dtype)
    return gx, gw, gb, None, None, None, None, None


_SUM_DTYPE = {torch.bfloat16: torch.float32, torch.float16: torch.float32}


def _memory_format(t: torch.Tensor) -> torch.memory_format:
    if t.dim() == 4 and not t.is_contiguous() and t.is_contiguous(memory_format=torch.channels_last):
        return torch.channels_last
    return torch.contiguous_format


def conv2d_chunked(x, weight, bias=None, stride=1, padding=0, dilation=1, groups=1, chunks=2):
    if x.dim() != 4 or isinstance(padding, str) or x.size(0) < 2:
        return F.conv2d(x, weight, bias, stride, padding, dilation, groups)
    return Conv2dChunked.apply(
        x, weight, bias, _pair(stride), _pair(padding), _pair(dilation), groups, chunks
    )


class _CudnnFlags(torch.autograd.Function):
    """Run conv2d forward and backward under given cuDNN flags."""

    @staticmethod
    def forward(ctx, x, weight, bias, stride, padding, dilation, groups, benchmark, deterministic):
        ctx.params = (stride, padding, dilation, groups, benchmark, deterministic)
        ctx.bias_sizes = None if bias is None else list(bias.shape)
        ctx.save_for_backward(x, weight)
        ctx.deferred = WEIGHT_DEFERRED.get()
        with torch.backends.cudnn.flags(
            enabled=True,
            benchmark=benchmark,
            deterministic=deterministic,
            allow_tf32=torch.backends.cudnn.allow_tf32,
        ):
            return F.conv2d(x, weight, bias, stride, padding, dilation, groups)

    @staticmethod
    def backward(ctx, g):
        x, weight = ctx.saved_tensors
        stride, padding, dilation, groups, benchmark, deterministic = ctx.params
        mask = _grad_mask(ctx)
        with torch.backends.cudnn.flags(
            enabled=True,
            benchmark=benchmark,
            deterministic=deterministic,
            allow_tf32=torch.backends.cudnn.allow_tf32,
        ):
            gx, gw, gb = _conv_backward(g, x, weight, ctx.bias_sizes, stride, padding, dilation, groups, mask)
        return gx, gw, gb, None, None, None, None, None, None


class Conv2dZeroPackedInput(torch.autograd.Function):
    """F.conv2d forward (the default's very output); the backward state keeps the input packed."""

    @staticmethod
    def forward(ctx, x, weight, bias, stride, padding, dilation, groups):
        ctx.params = (stride, padding, dilation, groups)
        ctx.bias_sizes = None if bias is None else list(bias.shape)
        packed = zero_pack.pack(x)
        ctx.packed = (packed.shape, packed.dtype, packed.offsets)
        ctx.save_for_backward(packed.bits, packed.values, weight)
        ctx.deferred = WEIGHT_DEFERRED.get()
        return F.conv2d(x, weight, bias, stride, padding, dilation, groups)

    @staticmethod
    def backward(ctx, g):
        bits, values, weight = ctx.saved_tensors
        shape, dtype, offsets = ctx.packed
        x = zero_pack.unpack(zero_pack.Packed(bits, values, shape, dtype, offsets))
        stride, padding, dilation, groups = ctx.params
        mask = _grad_mask(ctx)
        gx, gw, gb = _conv_backward(g, x, weight, ctx.bias_sizes, stride, padding, dilation, groups, mask)
        return gx, gw, gb, None, None, None, None


class Conv2dFromInput(torch.autograd.Function):
    """The default's backward state made from its input, without the forward: the output is a
    stand-in (one element, expanded to the output's shape), and the backward is torch's own
    (`aten.convolution_backward`, as autograd's ConvolutionBackward0 calls it): gradients bit
    for bit the default's."""

    @staticmethod
    def forward(ctx, x, weight, bias, stride, padding, dilation, groups, chunks):
        ctx.params = (stride, padding, dilation, groups, chunks)
        ctx.bias_sizes = None if bias is None else list(bias.shape)
        ctx.save_for_backward(x, weight)
        ctx.deferred = WEIGHT_DEFERRED.get()
        size = [x.size(0), weight.size(0)]
        for d in range(2):
            extent = dilation[d] * (weight.size(2 + d) - 1) + 1
            size.append((x.size(2 + d) + 2 * padding[d] - extent) // stride[d] + 1)
        return x.new_zeros(()).expand(size)

    @staticmethod
    def backward(ctx, g):
        if ctx.params[4] is not None:  # ("chunked_backward"'s own backward)
            return _chunked_backward(ctx, g)
        x, weight = ctx.saved_tensors
        stride, padding, dilation, groups, _chunks = ctx.params
        mask = _grad_mask(ctx)
        gx, gw, gb = _conv_backward(g, x, weight, ctx.bias_sizes, stride, padding, dilation, groups, mask)
        return gx, gw, gb, None, None, None, None, None


class Conv2dGemm(torch.autograd.Function):
    """The "gemm_backward" implementation: a 1x1 convolution (any stride, no padding or dilation,
    one group) on a contiguous 4-d input, F.conv2d forward and a backward of matrix products
    (module docstring). `state_only`: the backward state alone, made from the input (a stand-in
    output, as `Conv2dFromInput`)."""

    @staticmethod
    def forward(ctx, x, weight, bias, stride: tuple[int, int], state_only: bool):
        n, ci, h, w = x.shape
        co = weight.size(0)
        ctx.has_bias = bias is not None
        ctx.stride = stride
        ctx.save_for_backward(x, weight)
        ctx.deferred = WEIGHT_DEFERRED.get()
        if state_only:
            return x.new_zeros(()).expand(n, co, (h - 1) // stride[0] + 1, (w - 1) // stride[1] + 1)
        return F.conv2d(x, weight, bias, stride)

    @staticmethod
    def backward(ctx, g):
        x, weight = ctx.saved_tensors
        sh, sw = ctx.stride
        n, ci, h, w = x.shape
        co, ho, wo = g.shape[1:]
        g3 = g.reshape(n, co, ho * wo)
        strided = (sh, sw) != (1, 1)
        gx = gw = gb = None
        if ctx.needs_input_grad[0]:
            gx = torch.bmm(weight.detach().reshape(co, ci).t().expand(n, ci, co), g3).view(n, ci, ho, wo)
            if strided:
                full = x.new_zeros(x.shape)
                full[:, :, ::sh, ::sw] = gx
                gx = full
        if ctx.needs_input_grad[1] and not ctx.deferred:
            # (a strided 1x1 convolution reads every sh-th row and sw-th column: those, as a copy)
            x3 = x[:, :, ::sh, ::sw].reshape(n, ci, ho * wo) if strided else x.view(n, ci, h * w)
            if n * co * ci <= g3.numel():  # (a temporary no larger than the gradient)
                gw = torch.bmm(g3, x3.transpose(1, 2)).sum(0)
            else:
                gw = torch.mm(g3[0], x3[0].t())
                for k in range(1, n):
                    gw.addmm_(g3[k], x3[k].t())
            gw = gw.view_as(weight)
        if ctx.has_bias and ctx.needs_input_grad[2] and not ctx.deferred:
            gb = g3.sum((0, 2))
        return gx, gw, gb, None, None


def _gemm_applies(target, args: tuple, kwargs: dict) -> bool:
    """The "gemm_backward" implementation is offered where the node is a 1x1 convolution with no
    padding or dilation and one group (any stride), on a contiguous 4-d floating input (and a
    contiguous weight)."""
    return _chunkable(target) and _gemm_fits(_conv_params(target, args, kwargs))


def _gemm_fits(p: dict) -> bool:
    """`_gemm_applies` on the convolution's arguments (`_conv_params`)."""
    x, weight = p["input"], p["weight"]
    if not (isinstance(x, torch.Tensor) and isinstance(weight, torch.Tensor)) or is_fake_or_meta(x):
        return False
    return (
        x.dim() == 4
        and x.is_floating_point()
        and x.is_contiguous()
        and weight.dim() == 4
        and tuple(weight.shape[2:]) == (1, 1)
        and weight.is_contiguous()
        and p["groups"] == 1
        and not isinstance(p["padding"], str)
        and _pair(p["padding"]) == (0, 0)
        and _pair(p["dilation"]) == (1, 1)
        and x.size(1) == weight.size(1)
    )


def _make_gemm(state_only: bool):
    """The run of "gemm_backward", or its `state_from_inputs`; the default's where the node's
    arguments do not allow it (e.g. another layout than the profiled example's)."""

    def run(target, args, kwargs, recompute):
        p = _conv_params(target, args, kwargs)
        if _chunkable(target) and _gemm_fits(p):
            return Conv2dGemm.apply(p["input"], p["weight"], p["bias"], _pair(p["stride"]), state_only)
        if state_only:
            return _state_from_input(None)(target, args, kwargs, recompute)
        return _plain_conv(p)

    return run


def _state_from_input(chunks: int | None):
    """`state_from_inputs` (`Implementation`) of the default (chunks None) or of
    "chunked_backward": its backward from its input."""

    def make(target, args, kwargs, recompute):
        if not _from_input_applies(target, args, kwargs):
            raise RuntimeError(
                "a conv2d state is made from its input only for a 4-d input and numeric padding"
            )
        p = _conv_params(target, args, kwargs)
        if chunks is not None and p["input"].size(0) < 2:  # (its run is F.conv2d's there)
            return _apply(Conv2dFromInput, p, None)
        return _apply(Conv2dFromInput, p, chunks)

    return make


def _from_input_applies(target, args: tuple, kwargs: dict) -> bool:
    if not _chunkable(target):
        return False
    p = _conv_params(target, args, kwargs)
    x = p["input"]
    return isinstance(x, torch.Tensor) and x.dim() == 4 and not isinstance(p["padding"], str)


# ------------------------------------------------------------------ argument normalisation

_F_NAMES = ("input", "weight", "bias", "stride", "padding", "dilation", "groups")
_F_DEFAULTS = {"bias": None, "stride": 1, "padding": 0, "dilation": 1, "groups": 1}


def _conv_params(target, args, kwargs) -> dict:
    if isinstance(target, nn.Module):
        x = args[0] if args else kwargs["input"]
        return dict(
            input=x,
            weight=target.weight,
            bias=target.bias,
            stride=target.stride,
            padding=target.padding,
            dilation=target.dilation,
            groups=target.groups,
        )
    p = dict(_F_DEFAULTS)
    p.update(dict(zip(_F_NAMES, args)))
    p.update(kwargs)
    return p


def _chunkable(target) -> bool:
    if isinstance(target, nn.Module):
        return target.padding_mode == "zeros" and not isinstance(target.padding, str)
    return True


def _make_chunked(chunks: int):
    def run(target, args, kwargs, recompute):
        p = _conv_params(target, args, kwargs)
        if p["input"].dim() != 4 or isinstance(p["padding"], str) or p["input"].size(0) < 2:
            return _plain_conv(p)
        return _apply(Conv2dChunked, p, chunks)

    return run


_BACKWARD_CHUNKS = 8


def _plain_conv(p: dict) -> torch.Tensor:
    return F.conv2d(p["input"], p["weight"], p["bias"], p["stride"], p["padding"], p["dilation"], p["groups"])


def _function_args(p: dict) -> tuple:
    """(x, weight, bias, stride, padding, dilation, groups) as the custom Functions take them."""
    return (
        p["input"],
        p["weight"],
        p["bias"],
        _pair(p["stride"]),
        _pair(p["padding"]),
        _pair(p["dilation"]),
        p["groups"],
    )


def _apply(function: type, p: dict, *extra: Any) -> torch.Tensor:
    """`function.apply` on the conv's arguments, run as autocast runs F.conv2d: under autocast
    (conv2d is on its lower-precision list, CPU and CUDA) input, weight and bias cast to its
    dtype, and the Function run with autocast off (a custom Function's own ops ran on mixed
    dtypes: 'expected scalar type Float but found BFloat16')."""
    args = _function_args(p)
    device = args[0].device.type
    if not torch.is_autocast_enabled(device):
        return function.apply(*args, *extra)
    dtype = torch.get_autocast_dtype(device)
    cast = [t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t for t in args[:3]]
    with torch.autocast(device, enabled=False):
        return function.apply(*cast, *args[3:], *extra)


def _make_chunked_backward(chunks: int):
    def run(target, args, kwargs, recompute):
        p = _conv_params(target, args, kwargs)
        x = p["input"]
        if x.dim() != 4 or isinstance(p["padding"], str) or x.size(0) < 2:
            return _plain_conv(p)
        return _apply(Conv2dChunkedBackward, p, chunks)

    return run


def _run_zero_packed_input(target, args, kwargs, recompute):
    p = _conv_params(target, args, kwargs)
    x = p["input"]
    needs_grad = x.requires_grad or p["weight"].requires_grad
    if isinstance(p["padding"], str) or not (torch.is_grad_enabled() and needs_grad):
        return _plain_conv(p)
    return _apply(Conv2dZeroPackedInput, p)


# Offer "zero_packed_input" when at least this share of the example input's elements are zero:
# below it the packed form (1/32 + density of the input) saves too little to matter.
ZERO_PACK_MIN_ZEROS = 0.2


def _input_mostly_zeros(args: tuple, kwargs: dict) -> bool:
    x = first_tensor(args, kwargs)
    if is_fake_or_meta(x) or x.numel() == 0:
        return False
    return x.numel() - zero_pack.nonzero_count(x) >= ZERO_PACK_MIN_ZEROS * x.numel()


def _packed_input_bytes(args: tuple, kwargs: dict) -> int:
    return zero_pack.packed_bytes(first_tensor(args, kwargs))


def _make_cudnn(benchmark: bool, deterministic: bool):
    def run(target, args, kwargs, recompute):
        p = _conv_params(target, args, kwargs)
        if not p["input"].is_cuda or isinstance(p["padding"], str):
            return _plain_conv(p)
        return _apply(_CudnnFlags, p, benchmark, deterministic)

    return run


def matches(op: str, target: Any) -> bool:
    if op == "call_module":
        return type(target) is nn.Conv2d
    return op == "call_function" and (target is F.conv2d or target is torch.conv2d)


def _on_cuda(target, example_args) -> bool:
    if not torch.cuda.is_available():
        return False
    if isinstance(target, nn.Module):
        return target.weight.is_cuda
    return bool(example_args) and isinstance(example_args[0], torch.Tensor) and example_args[0].is_cuda


def implementations(op: str, target: Any, example_args=None, example_kwargs=None) -> list[Implementation]:
    impls = [
        Implementation(
            "default",
            out_of_place_default(op, target).run,
            "torch conv2d; backward keeps the input (and weight)",
            state_from_inputs=_state_from_input(None) if _chunkable(target) else None,
        )
    ]
    if not _chunkable(target):
        return impls
    impls.append(
        Implementation(
            "gemm_backward",
            _make_gemm(False),
            "1x1 conv2d: torch's forward; backward as batched matrix products (same kept tensors)",
            applies=lambda args, kwargs: _gemm_applies(target, args, kwargs),
            bitwise=False,  # the backward sums in another order than oneDNN's / cuDNN's
            autocast=False,  # (under autocast the default runs)
            state_from_inputs=_make_gemm(True),
        )
    )
    if example_args:
        x = example_args[0]
        if isinstance(x, torch.Tensor) and (x.dim() != 4 or x.size(0) < 2):
            return impls
    impls.append(
        Implementation(
            "zero_packed_input",
            _run_zero_packed_input,
            "torch conv2d; backward keeps the input packed (bit mask + nonzero elements) instead of whole",
            applies=_input_mostly_zeros,
            value_state_bytes=_packed_input_bytes,
        )
    )
    impls.append(
        Implementation(
            "chunked_backward",
            _make_chunked_backward(_BACKWARD_CHUNKS),
            f"torch conv2d forward; backward in up to {_BACKWARD_CHUNKS} batch chunks (smaller workspace)",
            bitwise=False,  # the weight gradient is a sum over chunks
            state_from_inputs=_state_from_input(_BACKWARD_CHUNKS),
        )
    )
    # Batch-chunked forward too is offered on CUDA only. On CPU oneDNN picks another forward
    # algorithm per chunk size, which moved ResNet-50's gradients by ~1e-4 relative through
    # small-batch BatchNorm (session 1): not worth breaking equality with plain PyTorch.
    if not _on_cuda(target, example_args):
        return impls
    impls.append(
        Implementation(
            "chunked",
            _make_chunked(2),
            "conv2d run as 2 batch chunks (smaller workspace, same kept tensors)",
            bitwise=False,
        )
    )
    if _on_cuda(target, example_args) and torch.backends.cudnn.is_available():
        impls.append(
            Implementation(
                "cudnn_benchmark",
                _make_cudnn(True, False),
                "conv2d with cudnn.benchmark=True (fastest algorithms, larger workspace)",
                bitwise=False,  # other algorithms than torch's default choice
            )
        )
        impls.append(
            Implementation(
                "cudnn_deterministic",
                _make_cudnn(False, True),
                "conv2d with cudnn.deterministic=True (deterministic algorithms)",
                bitwise=False,
            )
        )
    return impls


IMPLEMENTATION_NAMES = {
    "conv2d (nn.Conv2d, F.conv2d)": [
        "default",
        "gemm_backward",
        "chunked_backward",
        "zero_packed_input",
        "chunked*",
        "cudnn_benchmark*",
        "cudnn_deterministic*",
    ]
}
