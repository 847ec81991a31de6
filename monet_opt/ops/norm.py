"""Batch normalization (training) with an output-activated backward; other norms default only.

- "default": the module itself (saves its input, plus per-channel mean/invstd). On recompute the
  running statistics and num_batches_tracked are left untouched: they are snapshotted and restored
  around the very same call, so the output is bitwise identical to the first computation. This
  covers every _NormBase module (BatchNorm*, SyncBatchNorm, InstanceNorm* with running stats).
- "output_activated" (training only): as In-Place Activated BatchNorm, backward keeps the OUTPUT
  y (often kept anyway by the next op) and per-channel invstd, and reconstructs
  x_hat = (y - bias) / weight. Channels whose weight is exactly 0 cannot be reconstructed; for those
  channels only, x_hat is saved as well (a per-forward check, which syncs on CUDA).
  Precision: the reconstruction loses ~|bias/weight| ulps relative to torch's backward; for
  half/bfloat16 activations the backward is computed in the parameters' dtype.
  Its gradient is computed in place (see below).
- "inplace_grad" (training only): keeps the input like torch, and computes the input gradient
  into the incoming output gradient.

The two custom forms run their forward and backward by C kernels on CPU float32 contiguous
tensors (`batch_norm_kernel`: 3-4x and 2-3x faster than torch's on ResNet-50's shapes); their
batch and running statistics are then torch's within float rounding (~1e-7 relative), not
bitwise. The "default" form is torch's own.

Recomputation from the first computation's statistics (all three forms, the default one for
affine modules; `BN_MODULES` in training, outside autocast, contiguous input): given a memo
(`Implementation.replays`), the first computation stores its batch mean and invstd there (2 x C
values; `monet_opt.profile` counts them in the fixed bytes), and a recomputation is one affine
pass, y = x * alpha + beta with alpha = invstd * weight and beta = bias - mean * alpha, instead
of a statistics pass and an affine pass (this CPU, 8x64x112x112: 1.4 ms instead of 7.2 ms). The
backward is torch's training-mode batch-norm backward with those statistics, so the gradient
through the statistics is unchanged. The affine pass rounds exactly as torch's CPU kernel does
(fused multiply-adds), so the recomputed output is bitwise the first one's; a once-per-process
probe checks that on the device and dtype at hand, and where it does not hold (e.g. a CUDA
kernel) the memo path is off and the batch norm runs in full.

In-place gradient (`grad_in_place`, both custom forms): torch's batch-norm backward allocates the
input gradient and, on CPU, a same-size temporary. These forms instead take the per-channel sums
(sum(g), sum(g * x_hat)) with torch's own kernel, then rewrite g as
(g - mean(g) - x_hat * mean(g * x_hat)) * invstd * weight. Both read x_hat as (z - center) * inv
per channel from a tensor they keep: the input (center: the batch mean, inv: invstd) or the
output (center: bias, inv: 1 / weight). Where g and z are in the statistics' dtype (float32 /
float64) and laid out alike, and every weight is non-zero, torch's kernel takes the sums from z,
center and inv directly, and the rewrite is g * k1 + z * k2 + k3 with per-channel k1, k2, k3
(three in-place passes; per batch sample or per 1-MiB piece was no faster): no temporary beyond
per-channel vectors, within 1.2-2x of torch's own backward's time and 1.5-2.5x as fast as the x_hat form
(session 59, 2 threads, freed memory kept, `benchmarks/results/session59/bn_backward_micro.py`,
three runs: 8x256x56x56 3.9-5.4 ms, torch's 3.7-3.8, the x_hat form 8.0-10.5; 8x2048x7x7
0.46-0.59, 0.23-0.30, 0.99-1.25). Otherwise (half / bfloat16 tensors, another layout, a zero
weight) g is rewritten chunk by chunk (along the batch) from x_hat chunks computed in the
statistics' dtype: the temporaries are one chunk of x_hat (1/8 of the activation).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from . import batch_norm_kernel
from .base import Implementation
from .common import bind, first_tensor, refuse_higher_order

BN_MODULES = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)  # incl. Lazy variants
_NormBase = nn.modules.batchnorm._NormBase  # batch norms (incl. SyncBatchNorm) and instance norms


def _channel_view(t: torch.Tensor, ndim: int) -> torch.Tensor:
    return t.view((1, -1) + (1,) * (ndim - 2))


_CHUNKS = 8


def _chunk_slices(t: torch.Tensor) -> list[tuple]:
    """Index tuples splitting t into about _CHUNKS pieces along the batch (or, for a small
    batch, a spatial dimension)."""
    dim = 0 if t.size(0) >= _CHUNKS or t.dim() < 3 else 2
    size = t.size(dim)
    step = max(1, -(-size // _CHUNKS))
    return [(slice(None),) * dim + (slice(i, i + step),) for i in range(0, size, step)]


def _bn_backward_in_place(g: torch.Tensor, xhat_of, scale: torch.Tensor, need_x: bool):
    """Training-mode batch-norm backward writing the input gradient into g.

    xhat_of(index) returns a fresh x_hat chunk (the statistics' dtype) for g[index].
    Returns (sum(g * x_hat), sum(g)) per channel, i.e. grad_weight / grad_bias."""
    c = scale.numel()
    stat = scale.dtype
    zeros = torch.zeros(c, dtype=stat, device=g.device)
    ones = torch.ones(c, dtype=stat, device=g.device)
    dot = torch.zeros(c, dtype=stat, device=g.device)
    gsum = torch.zeros(c, dtype=stat, device=g.device)
    pieces = _chunk_slices(g)
    for index in pieces:
        # torch's kernel at mean 0, invstd 1 on x_hat: grad_weight = sum(g x_hat), grad_bias = sum(g)
        _, d, b = torch.ops.aten.native_batch_norm_backward(
            g[index].to(stat), xhat_of(index), None, None, None, zeros, ones, True, 0.0, [False, True, True]
        )
        dot += d
        gsum += b
    if need_x:
        count = g.numel() // c
        nd = g.dim()
        mean_gx = _channel_view(dot / count, nd)
        mean_g = _channel_view(gsum / count, nd)
        w = _channel_view(scale, nd)
        for index in pieces:
            xh = xhat_of(index).mul_(mean_gx).add_(mean_g)
            gi = g[index]
            if gi.dtype == stat:
                gi.sub_(xh).mul_(w)
            else:
                gi.copy_(gi.to(stat).sub_(xh).mul_(w))
            del xh, gi  # one chunk of temporaries at a time
    return dot, gsum


def _bn_backward_from_source(g: torch.Tensor, z: torch.Tensor, center, inv, scale, need_x: bool):
    """`_bn_backward_in_place` where x_hat = (z - center) * inv per channel and g, z, center, inv
    and scale share one floating dtype (see the module docstring): the sums by torch's kernel on
    z, then g = g * k1 + z * k2 + k3 in three in-place passes; on CPU float32 contiguous tensors
    one C kernel does it all (`batch_norm_kernel`). Returns (dot, gsum)."""
    fused = batch_norm_kernel.backward(g, z, center, inv, scale, need_x)
    if fused is not None:
        return fused
    _, dot, gsum = torch.ops.aten.native_batch_norm_backward(
        g, z, None, None, None, center, inv, True, 0.0, [False, True, True]
    )
    if need_x:
        c = scale.numel()
        count = g.numel() // c
        wide = torch.float64
        # (g - mean_g - (z - center) * inv * mean_gx) * scale, its per-channel terms in float64
        s64, i64, mgx = scale.to(wide), inv.to(wide), dot.to(wide) / count
        k2 = -s64 * i64 * mgx
        k3 = s64 * (center.to(wide) * i64 * mgx - gsum.to(wide) / count)
        nd = g.dim()
        k1, k2, k3 = (_channel_view(k.to(g.dtype), nd) for k in (scale, k2, k3))
        g.mul_(k1).addcmul_(z, k2).add_(k3)
    return dot, gsum


def _fast_source(g: torch.Tensor, z: torch.Tensor, stat: torch.dtype) -> bool:
    """The sums-and-rewrite form applies: g and z in the statistics' dtype, z laid out as g."""
    return g.dtype == stat and z.dtype == stat and z.shape == g.shape and z.stride() == g.stride()


def _affine(x, weight, bias, mean, invstd):
    """Batch norm's output from given batch statistics, as torch's CPU training kernel forms it:
    y = fma(x, alpha, beta) with alpha = invstd * weight and beta = fma(-mean, alpha, bias), in the
    statistics' dtype (float32 terms: beta's single rounding taken through float64; addcmul is the
    fused multiply-add). Written in x's dtype, no temporary beyond the output. Whether this is
    bitwise torch's kernel on a device is checked once (`replay_is_exact`)."""
    alpha = invstd if weight is None else invstd * weight.to(invstd.dtype)
    wide = torch.float64 if invstd.dtype in (torch.float32, torch.float16, torch.bfloat16) else invstd.dtype
    b = torch.zeros_like(mean, dtype=wide) if bias is None else bias.to(wide)
    beta = (b - mean.to(wide) * alpha.to(wide)).to(invstd.dtype)
    nd = x.dim()
    return torch.addcmul(_channel_view(beta, nd), x, _channel_view(alpha, nd), out=torch.empty_like(x))


_EXACT: dict[tuple, bool] = {}


def replay_is_exact(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether `_affine` reproduces torch's training batch norm bitwise on this device and dtype
    (probed once per process on a few shapes, incl. ones not a multiple of the vector width).
    Where it does not (another kernel, no fused multiply-add), recomputation runs the full batch
    norm instead, so replay never changes a result."""
    key = (torch.device(device).type, dtype)
    if key not in _EXACT:
        g = torch.Generator(device="cpu").manual_seed(0)
        exact = True
        for shape in ((4, 6, 9, 11), (3, 16, 64), (5, 7)):
            c = shape[1]
            x = (torch.randn(shape, generator=g) * 3 + 1).to(device=device, dtype=dtype)
            w = torch.randn(c, generator=g).to(device=device, dtype=dtype)
            b = torch.randn(c, generator=g).to(device=device, dtype=dtype)
            for running in (True, False):  # the ops a first computation runs (cuDNN on CUDA)
                stats = (torch.zeros_like(w), torch.ones_like(w)) if running else (None, None)
                y, mean, invstd = _bn_statistics_forward(x, w, b, *stats, 0.1, 1e-5)
                exact = exact and torch.equal(_affine(x, w, b, mean, invstd), y)
        _EXACT[key] = bool(exact)
    return _EXACT[key]


def _bn_forward(ctx, x, weight, bias, running_mean, running_var, momentum: float, eps: float, memo=None):
    """Training-mode batch norm (updating the running statistics given); records on ctx which
    affine parameters exist. Returns (y, mean, invstd), torch's bitwise: by the C kernel where it
    applies (`batch_norm_kernel.forward`), else by torch's op. With a memo holding the statistics
    of the first computation (a recomputation): one affine pass with them, by the path the first
    computation took (the kernel's or `_affine`: bitwise its output); otherwise a memo, if given,
    receives this computation's statistics and path."""
    ctx.has_weight = weight is not None
    ctx.has_bias = bias is not None
    if memo is not None and "stats" in memo:
        mean, invstd = memo["stats"]
        if memo.get("kernel"):
            y = batch_norm_kernel.forward(x, weight, bias, None, None, momentum, eps, (mean, invstd))[0]
            return y, mean, invstd
        return _affine(x, weight, bias, mean, invstd), mean, invstd
    out = batch_norm_kernel.forward(x, weight, bias, running_mean, running_var, momentum, eps)
    y, mean, invstd = (
        out
        if out is not None
        else _bn_statistics_forward(x, weight, bias, running_mean, running_var, momentum, eps)
    )
    if memo is not None:
        memo["stats"] = (mean.detach(), invstd.detach())
        memo["kernel"] = out is not None
    return y, mean, invstd


def _bn_statistics_forward(x, weight, bias, running_mean, running_var, momentum: float, eps: float):
    """Torch's training batch norm (statistics pass and affine pass), updating the running
    statistics given in place, through the op the module's own call reaches (cuDNN on CUDA).
    Its autograd formula needs a weight: with autograd recording, only for affine modules."""
    if running_mean is not None:
        y, mean, invstd, _reserve = torch.ops.aten._batch_norm_with_update(
            x, weight, bias, running_mean, running_var, momentum, eps
        )
    else:
        y, mean, invstd = torch.ops.aten.native_batch_norm(x, weight, bias, None, None, True, momentum, eps)
    return y, mean, invstd


def _param_grads(ctx, dot, gsum, weight, bias):
    grad_w = dot.to(weight.dtype) if ctx.has_weight and ctx.needs_input_grad[1] else None
    grad_b = gsum.to(bias.dtype) if ctx.has_bias and ctx.needs_input_grad[2] else None
    return grad_w, grad_b


class BatchNormInplaceGrad(torch.autograd.Function):
    """Batch norm (training) keeping its input; backward writes the input gradient into g."""

    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, momentum: float, eps: float, memo=None):
        y, mean, invstd = _bn_forward(ctx, x, weight, bias, running_mean, running_var, momentum, eps, memo)
        ctx.save_for_backward(x, mean, invstd, weight, bias)
        return y

    @staticmethod
    def backward(ctx, g):
        refuse_higher_order("inplace_grad")
        x, mean, invstd, weight, bias = ctx.saved_tensors
        nd = x.dim()
        stat = invstd.dtype
        m, s = _channel_view(mean, nd), _channel_view(invstd, nd)

        def xhat_of(index):
            return x[index].to(stat).sub(m).mul_(s)

        scale = invstd if weight is None else invstd * weight.to(stat)
        if _fast_source(g, x, stat):
            dot, gsum = _bn_backward_from_source(g, x, mean, invstd, scale, ctx.needs_input_grad[0])
        else:
            dot, gsum = _bn_backward_in_place(g, xhat_of, scale, ctx.needs_input_grad[0])
        grad_x = g if ctx.needs_input_grad[0] else None
        return (grad_x, *_param_grads(ctx, dot, gsum, weight, bias), None, None, None, None, None)


class BatchNormOutputActivated(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, momentum: float, eps: float, memo=None):
        y, _mean, invstd = _bn_forward(ctx, x, weight, bias, running_mean, running_var, momentum, eps, memo)
        zero_idx = None
        xhat_zero = None
        if weight is not None:
            zero = weight == 0
            if bool(zero.any()):
                zero_idx = zero.nonzero().view(-1)
                m = _mean.index_select(0, zero_idx)
                s = invstd.index_select(0, zero_idx)
                xhat_zero = (x.index_select(1, zero_idx) - _channel_view(m, x.dim())) * _channel_view(
                    s, x.dim()
                )
        ctx.zero = zero_idx is not None
        saved = [y, invstd, weight, bias]
        if ctx.zero:
            saved += [zero_idx, xhat_zero]
        ctx.save_for_backward(*saved)
        return y

    @staticmethod
    def backward(ctx, g):
        refuse_higher_order("output_activated")
        saved = ctx.saved_tensors
        y, invstd, weight, bias = saved[:4]
        nd = y.dim()
        stat = invstd.dtype
        # x_hat = (y - bias) / weight, channels with weight == 0 taken from the saved copy.
        if weight is not None:
            w = torch.where(weight == 0, torch.ones_like(weight), weight) if ctx.zero else weight
            w = _channel_view(w.to(stat), nd)
        b = _channel_view(bias.to(stat), nd) if bias is not None else None
        zero_idx, xhat_zero = (saved[4], saved[5]) if ctx.zero else (None, None)

        def xhat_of(index):
            xh = y[index].to(stat, copy=True)
            if b is not None:
                xh.sub_(b)
            if weight is not None:
                xh.div_(w)
            if zero_idx is not None:
                xh.index_copy_(1, zero_idx, xhat_zero[index].to(stat))
            return xh

        # torch's training-mode batch-norm backward evaluated at input x_hat with mean 0 and invstd 1
        # computes dx = (g - mean(g) - x_hat * mean(g * x_hat)) * w', dw = sum(g * x_hat), db = sum(g);
        # with w' = weight * invstd this is exactly the gradient of the original batch norm.
        scale = invstd if weight is None else invstd * weight.to(stat)
        if zero_idx is None and _fast_source(g, y, stat):
            # x_hat = (y - bias) / weight: center bias, inv 1 / weight
            center = bias.to(stat) if bias is not None else torch.zeros_like(invstd)
            inv = 1.0 / weight.to(stat) if weight is not None else torch.ones_like(invstd)
            dot, gsum = _bn_backward_from_source(g, y, center, inv, scale, ctx.needs_input_grad[0])
        else:
            dot, gsum = _bn_backward_in_place(g, xhat_of, scale, ctx.needs_input_grad[0])
        grad_x = g if ctx.needs_input_grad[0] else None
        return (grad_x, *_param_grads(ctx, dot, gsum, weight, bias), None, None, None, None, None)


class BatchNormReplay(torch.autograd.Function):
    """The default form recomputed from the first computation's statistics: keeps what torch's
    batch norm keeps (its input and the batch statistics) and runs torch's training-mode
    batch-norm backward."""

    @staticmethod
    def forward(ctx, x, weight, bias, mean, invstd, eps: float):
        ctx.eps = eps
        ctx.save_for_backward(x, weight, mean, invstd)
        return _affine(x, weight, bias, mean, invstd)

    @staticmethod
    def backward(ctx, g):
        x, weight, mean, invstd = ctx.saved_tensors
        mask = [ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[2]]
        gx, gw, gb = torch.ops.aten.native_batch_norm_backward(
            g, x, weight, None, None, mean, invstd, True, ctx.eps, mask
        )
        return gx, gw, gb, None, None, None


def _replays(target, x) -> bool:
    """The memo path applies: a batch norm module (not SyncBatchNorm, not an instance norm) in
    training, outside autocast (whose casts only the module's own call gets), on a contiguous
    input, where the affine replay is bitwise torch's kernel (`replay_is_exact`)."""
    return (
        isinstance(target, BN_MODULES)
        and target.training
        and not torch.is_autocast_enabled(x.device.type)
        and x.is_contiguous()
        and replay_is_exact(x.device, x.dtype)
    )


def _module_bn_state(m: nn.modules.batchnorm._BatchNorm, recompute: bool):
    """Mirror _BatchNorm.forward: (bn_training, running_mean, running_var, factor), updating the counter
    only on the first computation."""
    factor = 0.0 if m.momentum is None else m.momentum
    if m.training and m.track_running_stats and m.num_batches_tracked is not None:
        if not recompute:
            m.num_batches_tracked.add_(1)
        # (momentum=None, a cumulative average: on a recomputation the counter is the first
        # computation's; profiling recomputes a fresh module's, still 0, and its copies of the
        # statistics are dropped: any factor does)
        factor = 1.0 / max(float(m.num_batches_tracked), 1.0) if m.momentum is None else m.momentum
    bn_training = m.training or (m.running_mean is None and m.running_var is None)
    use_stats = not m.training or m.track_running_stats
    rm = m.running_mean if use_stats else None
    rv = m.running_var if use_stats else None
    return bn_training, rm, rv, factor


def _call_stats(m: nn.modules.batchnorm._BatchNorm, recompute: bool):
    """(running_mean, running_var, factor) to hand torch's batch norm for this call: on a
    recomputation, copies of the running statistics, so the real ones stay untouched."""
    _, rm, rv, factor = _module_bn_state(m, recompute)
    if recompute and rm is not None:
        rm, rv = rm.clone(), rv.clone()
    return rm, rv, factor


_STAT_BUFFERS = ("running_mean", "running_var", "num_batches_tracked")


def _module_default(target, args, kwargs, recompute, memo=None):
    """The module itself (given a memo: the same batch norm through torch's own op, keeping its
    statistics, and recomputed from them). On recompute in training, the module runs on copies of its statistics
    buffers, which are swapped back afterwards: the very same code path runs (bitwise identical
    output, also for SyncBatchNorm, InstanceNorm with running stats and custom _NormBase
    subclasses), the real running statistics and counter stay untouched, and nothing the
    autograd graph saved is modified in place afterwards (a copy_ back would be)."""
    if memo is not None and target.affine and _replays(target, x := first_tensor(args, kwargs)):
        if recompute and "stats" in memo:
            mean, invstd = memo["stats"]
            return BatchNormReplay.apply(x, target.weight, target.bias, mean, invstd, target.eps)
        target._check_input_dim(x)
        rm, rv, factor = _call_stats(target, recompute)
        y, mean, invstd = _bn_statistics_forward(x, target.weight, target.bias, rm, rv, factor, target.eps)
        memo["stats"] = (mean.detach(), invstd.detach())
        return y
    if not (recompute and target.training and getattr(target, "track_running_stats", False)):
        return target(*args, **kwargs)
    originals = {n: getattr(target, n) for n in _STAT_BUFFERS if getattr(target, n, None) is not None}
    for name, buf in originals.items():
        setattr(target, name, buf.clone())
    try:
        return target(*args, **kwargs)
    finally:
        for name, buf in originals.items():
            setattr(target, name, buf)


def _module_custom(function):
    def run(target, args, kwargs, recompute, memo=None):
        x = first_tensor(args, kwargs)
        if not target.training:
            return target(x)
        target._check_input_dim(x)
        if memo is not None and not _replays(target, x):
            memo = None
        if recompute and memo is not None and "stats" in memo:  # statistics not computed again
            return function.apply(x, target.weight, target.bias, None, None, 0.0, target.eps, memo)
        rm, rv, factor = _call_stats(target, recompute)
        return function.apply(x, target.weight, target.bias, rm, rv, factor, target.eps, memo)

    return run


_module_output_activated = _module_custom(BatchNormOutputActivated)
_module_inplace_grad = _module_custom(BatchNormInplaceGrad)


def _functional_default(target, args, kwargs, recompute):
    if not recompute:
        return target(*args, **kwargs)
    b = bind(F.batch_norm, args, kwargs)
    if b["training"] and b["running_mean"] is not None:
        b["running_mean"] = b["running_mean"].clone()
        b["running_var"] = b["running_var"].clone() if b["running_var"] is not None else None
    return F.batch_norm(**b)


def _torch_batch_norm_default(target, args, kwargs, recompute):
    # torch.batch_norm(input, weight, bias, running_mean, running_var, training, momentum, eps, cudnn_enabled)
    if recompute and len(args) >= 6 and args[5] and args[3] is not None:
        args = args[:3] + (args[3].clone(), args[4].clone() if args[4] is not None else None) + args[5:]
    return target(*args, **kwargs)


def matches(op: str, target: Any) -> bool:
    if op == "call_module":
        return isinstance(target, _NormBase)
    return op == "call_function" and target in (F.batch_norm, torch.batch_norm)


def implementations(op: str, target: Any, example_args=None, example_kwargs=None) -> list[Implementation]:
    if op == "call_module":
        impls = [
            Implementation(
                "default",
                _module_default,
                "nn.BatchNorm; backward keeps its input (running stats updated once)",
                replays=True,
            )
        ]
        if target.training and isinstance(target, BN_MODULES):
            impls.append(
                Implementation(
                    "output_activated",
                    _module_output_activated,
                    "batch norm whose backward keeps its output and per-channel invstd (x_hat rebuilt); "
                    "gradient in place",
                    grad_in_place=True,
                    replays=True,
                    bitwise=False,  # x_hat rebuilt from the output: a few ulps off
                    autocast=False,  # (rebuilt from a bfloat16 output: gradients far off)
                )
            )
            impls.append(
                Implementation(
                    "inplace_grad",
                    _module_inplace_grad,
                    "batch norm keeping its input; backward writes the input gradient into the output's",
                    grad_in_place=True,
                    replays=True,
                    bitwise=False,  # its own backward arithmetic (measured: ~4e-7 relative off)
                    autocast=False,  # (its float32 backward formula on bfloat16 tensors)
                )
            )
        return impls
    if target is F.batch_norm:
        return [Implementation("default", _functional_default, "F.batch_norm (running stats updated once)")]
    return [
        Implementation("default", _torch_batch_norm_default, "torch.batch_norm (running stats updated once)")
    ]


IMPLEMENTATION_NAMES = {
    "batch_norm (nn.BatchNorm1d/2d/3d, training)": ["default", "output_activated", "inplace_grad"],
    "batch_norm (eval, F.batch_norm), SyncBatchNorm, InstanceNorm": ["default"],
}
