"""Training batch norm's forward and in-place backward in C kernels (CPU, float32, contiguous).

Both take one channel at a time and read its planes a second time while they are still in cache,
so each tensor crosses memory about once; channels are split over torch's intra-op threads with
OpenMP, which finds the runtime torch loaded (a Python thread pool instead ran no faster on 2
threads than on 1: torch's OpenMP workers spin on the cores after each op). Sums are float
partial sums of blocks of a plane, added in double.

- `forward(x, weight, bias, eps)`: the batch mean and variance (two passes), then
  y = fma(x, alpha, beta) (alpha = invstd * weight, beta = bias - mean * alpha). Given the
  statistics a first call returned, the same y bitwise (a recomputation's). torch's CPU training
  batch norm reads x for the mean, again for the variance and again for the output, and its
  statistics pass is slow: 7.2-7.7 ms at 8x256x56x56 against the kernel's 1.9-2.1. Its
  statistics are torch's within float rounding (~1e-7 relative), not bitwise.
- `backward(g, z, center, inv, scale, need_x)` does what `norm._bn_backward_from_source` does
  with torch ops: per channel, dot = sum(g * x_hat) and gsum = sum(g) with
  x_hat = (z - center) * inv, then (if need_x) g = (g - mean(g) - x_hat * mean(g * x_hat)) *
  scale, written into g. The torch ops read g and z twice for the sums and run three in-place
  passes: 5.3-6.6 ms at 8x256x56x56 against the kernel's 2.2 (torch's own allocating backward:
  4.4-4.7).

Compiled on first use (`c_kernels.build`); without a compiler, on CUDA, for other dtypes or
layouts both return None and the caller runs torch's ops. `MONET_OPT_BN_KERNEL=0` switches them
off. Measured: Intel Xeon, 2 threads, `benchmarks/results/session64/bn_kernel_micro.py`.
"""

from __future__ import annotations

import ctypes

import torch

from . import c_kernels

_C_SOURCE = r"""
#include <math.h>
#include <stdint.h>

/* Contiguous float32 (n, c, hw) tensors g and z: per channel dot = inv * sum(g * (z - center))
   and gsum = sum(g) (float partial sums over blocks of at most 4096 elements of one plane,
   added in double); if rewrite, g = g * k1 + z * k2 + k3
   = (g - gsum / count - (z - center) * inv * dot / count) * scale. Channels split over
   `threads` OpenMP threads (torch's own OpenMP runtime: no second pool spinning beside it). */
void bn_backward(float *g, const float *z, int64_t n, int64_t c, int64_t hw, int32_t threads,
                 const double *center, const double *inv, const double *scale,
                 double *dot, double *gsum, int32_t rewrite) {
    const double count = (double)n * (double)hw;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t ch = 0; ch < c; ch++) {
        const double m = center[ch];
        const float mf = (float)m;
        double s1 = 0.0, s2 = 0.0;
        for (int64_t b = 0; b < n; b++) {
            const float *gp = g + (b * c + ch) * hw;
            const float *zp = z + (b * c + ch) * hw;
            for (int64_t i0 = 0; i0 < hw; i0 += 4096) {
                const int64_t i1 = i0 + 4096 < hw ? i0 + 4096 : hw;
                float a1 = 0.0f, a2 = 0.0f;
#pragma omp simd reduction(+ : a1, a2)
                for (int64_t i = i0; i < i1; i++) {
                    a1 += gp[i];
                    a2 += gp[i] * (zp[i] - mf);
                }
                s1 += a1;
                s2 += a2;
            }
        }
        const double d = s2 * inv[ch];
        dot[ch] = d;
        gsum[ch] = s1;
        if (!rewrite) continue;
        const double mgx = d / count;
        const float k1 = (float)scale[ch];
        const float k2 = (float)(-scale[ch] * inv[ch] * mgx);
        const float k3 = (float)(scale[ch] * (m * inv[ch] * mgx - s1 / count));
        for (int64_t b = 0; b < n; b++) {
            float *gp = g + (b * c + ch) * hw;
            const float *zp = z + (b * c + ch) * hw;
#pragma omp simd
            for (int64_t i = 0; i < hw; i++) gp[i] = gp[i] * k1 + zp[i] * k2 + k3;
        }
    }
}

/* Training batch-norm forward of a contiguous float32 (n, c, hw) tensor x into y, as torch's CPU
   kernel computes it, bitwise: unless have_stats, per channel the sum of x in double in index
   order, mean = (float)(sum / count), var_sum = (float) the sum in double, in index order, of
   the float (x - mean)^2, invstd = (float)(1 / sqrt((double)(var_sum / (float)count) + eps));
   then y = fma(x, alpha, beta) with alpha = invstd * w and beta = (float)(b - mean * alpha in
   double). Channels are taken G at a time, their G running sums interleaved (independent
   chains: the order within each channel stays torch's), and the group's y written while its
   planes are in cache. w, b: NULL for none. Compiled without contraction (-ffp-contract=off). */
#define G 8
void bn_forward(const float *x, float *y, int64_t n, int64_t c, int64_t hw, int32_t threads,
                const float *w, const float *b, double eps, int32_t have_stats,
                float *mean_f, float *invstd_f, float *var_sum_f) {
    const int64_t groups = (c + G - 1) / G;
    const double count = (double)(n * hw);
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t gi = 0; gi < groups; gi++) {
        const int64_t c0 = gi * G;
        const int m = c - c0 < G ? (int)(c - c0) : G;
        if (!have_stats) {
            double s[G];
            float mf[G];
            for (int k = 0; k < G; k++) s[k] = 0.0;
            if (m == G) {
                for (int64_t q = 0; q < n; q++) {
                    const float *xp = x + (q * c + c0) * hw;
                    for (int64_t i = 0; i < hw; i++)
                        for (int k = 0; k < G; k++) s[k] += (double)xp[k * hw + i];
                }
            } else {
                for (int k = 0; k < m; k++)
                    for (int64_t q = 0; q < n; q++) {
                        const float *xp = x + (q * c + c0 + k) * hw;
                        for (int64_t i = 0; i < hw; i++) s[k] += (double)xp[i];
                    }
            }
            for (int k = 0; k < m; k++) {
                mf[k] = (float)(s[k] / count);
                s[k] = 0.0;
            }
            if (m == G) {
                for (int64_t q = 0; q < n; q++) {
                    const float *xp = x + (q * c + c0) * hw;
                    for (int64_t i = 0; i < hw; i++)
                        for (int k = 0; k < G; k++) {
                            const float d = xp[k * hw + i] - mf[k];
                            s[k] += (double)(d * d);
                        }
                }
            } else {
                for (int k = 0; k < m; k++)
                    for (int64_t q = 0; q < n; q++) {
                        const float *xp = x + (q * c + c0 + k) * hw;
                        for (int64_t i = 0; i < hw; i++) {
                            const float d = xp[i] - mf[k];
                            s[k] += (double)(d * d);
                        }
                    }
            }
            for (int k = 0; k < m; k++) {
                const float vs = (float)s[k];
                mean_f[c0 + k] = mf[k];
                var_sum_f[c0 + k] = vs;
                invstd_f[c0 + k] = (float)(1.0 / sqrt((double)(vs / (float)count) + eps));
            }
        }
        for (int k = 0; k < m; k++) {
            const int64_t ch = c0 + k;
            const float alpha = w ? invstd_f[ch] * w[ch] : invstd_f[ch];
            const float beta = (float)((b ? (double)b[ch] : 0.0) - (double)mean_f[ch] * (double)alpha);
            for (int64_t q = 0; q < n; q++) {
                const float *xp = x + (q * c + ch) * hw;
                float *yp = y + (q * c + ch) * hw;
#pragma omp simd
                for (int64_t i = 0; i < hw; i++) yp[i] = fmaf(xp[i], alpha, beta);
            }
        }
    }
}
"""


def _declare(lib: ctypes.CDLL) -> None:
    lib.bn_backward.restype = None
    lib.bn_backward.argtypes = [
        *(ctypes.c_void_p,) * 2,  # g, z
        *(ctypes.c_int64,) * 3,  # n, c, hw
        ctypes.c_int32,  # threads
        *(ctypes.c_void_p,) * 5,  # center, inv, scale, dot, gsum
        ctypes.c_int32,  # rewrite
    ]
    lib.bn_forward.restype = None
    lib.bn_forward.argtypes = [
        *(ctypes.c_void_p,) * 2,  # x, y
        *(ctypes.c_int64,) * 3,  # n, c, hw
        ctypes.c_int32,  # threads
        *(ctypes.c_void_p,) * 2,  # w, b (None: no affine parameter)
        ctypes.c_double,  # eps
        ctypes.c_int32,  # have_stats
        *(ctypes.c_void_p,) * 3,  # mean_f, invstd_f, var_sum_f
    ]


_KERNEL = c_kernels.Kernel(
    "batch_norm", _C_SOURCE, _declare, "MONET_OPT_BN_KERNEL", ("-fopenmp", "-ffp-contract=off")
)


def kernel() -> ctypes.CDLL | None:
    """The compiled kernel, or None (and `kernel_error()` says why); compiled once per process."""
    return _KERNEL.get()


def kernel_error() -> str | None:
    return _KERNEL.error


def _threads(t: torch.Tensor) -> int:
    return torch.get_num_threads() if t.numel() >= 1 << 15 else 1


def usable(g: torch.Tensor, z: torch.Tensor) -> bool:
    """The kernel applies: CPU float32 tensors of one shape, both contiguous, at least 2-d."""
    return (
        g.device.type == "cpu"
        and g.dtype == torch.float32
        and z.dtype == torch.float32
        and g.dim() >= 2
        and z.shape == g.shape
        and g.is_contiguous()
        and z.is_contiguous()
        and kernel() is not None
    )


def backward(g: torch.Tensor, z: torch.Tensor, center, inv, scale, need_x: bool):
    """(dot, gsum) per channel in float32, g rewritten into the input gradient if need_x; None
    where the kernel does not apply (`usable`). center, inv, scale: per-channel tensors."""
    if not usable(g, z):
        return None
    lib = kernel()
    n, c = g.shape[0], g.shape[1]
    hw = g.numel() // max(1, n * c)
    wide = [t.detach().to(torch.float64).contiguous() for t in (center, inv, scale)]
    dot = torch.empty(c, dtype=torch.float64)
    gsum = torch.empty(c, dtype=torch.float64)
    lib.bn_backward(
        g.data_ptr(),
        z.data_ptr(),
        n,
        c,
        hw,
        _threads(g),
        *(t.data_ptr() for t in wide),
        dot.data_ptr(),
        gsum.data_ptr(),
        1 if need_x else 0,
    )
    return dot.to(torch.float32), gsum.to(torch.float32)


def _plain_param(t) -> bool:
    return t is None or (t.device.type == "cpu" and t.dtype == torch.float32 and t.is_contiguous())


def forward(
    x: torch.Tensor, weight, bias, running_mean, running_var, momentum: float, eps: float, stats=None
):
    """Training batch norm of x as torch's CPU op computes it, bitwise (output, batch mean and
    invstd, running statistics updated in place): (y, mean, invstd). Given stats = (mean,
    invstd) from an earlier call on the same x, only y (that call's, bitwise; the running
    statistics untouched). None where the kernel does not apply: not a CPU float32 contiguous x
    of at least 3 dims with more than one element per plane, other parameters, or a process
    where the kernel is not bitwise torch's (`forward_is_exact`)."""
    params = (weight, bias, running_mean, running_var)
    if not (
        usable(x, x)
        and x.dim() >= 3
        and x.numel() // (x.size(0) * x.size(1)) > 1
        and all(_plain_param(t) for t in params)
        and forward_is_exact()
    ):
        return None
    return _forward(x, weight, bias, running_mean, running_var, momentum, eps, stats)


def _forward(x, weight, bias, running_mean, running_var, momentum, eps, stats):
    lib = kernel()
    n, c = x.shape[0], x.shape[1]
    hw = x.numel() // (n * c)
    y = torch.empty_like(x)
    if stats is None:
        mean, invstd = torch.empty(c), torch.empty(c)
    else:
        mean, invstd = (t.contiguous() for t in stats)
    var_sum = torch.empty(c)
    lib.bn_forward(
        x.data_ptr(),
        y.data_ptr(),
        n,
        c,
        hw,
        _threads(x),
        None if weight is None else weight.data_ptr(),
        None if bias is None else bias.data_ptr(),
        float(eps),
        0 if stats is None else 1,
        mean.data_ptr(),
        invstd.data_ptr(),
        var_sum.data_ptr(),
    )
    if stats is None and running_mean is not None:
        # torch's update (Normalization.cpp), in float32 but for the variance's float64 sum
        count = n * hw
        m = torch.tensor(momentum, dtype=torch.float32)
        running_mean.copy_(m * mean + (1 - m) * running_mean)
        unbiased = (var_sum / torch.tensor(float(count - 1), dtype=torch.float32)).double()
        running_var.copy_(m.double() * unbiased + ((1 - m) * running_var).double())
    return y, mean, invstd


_EXACT: dict[str, bool] = {}


def forward_is_exact() -> bool:
    """Whether `forward` is bitwise torch's training batch norm in this process (probed once on a
    few shapes, with and without affine parameters and running statistics)."""
    if "cpu" not in _EXACT:
        with torch.no_grad(), torch.autocast("cpu", enabled=False):  # (probed wherever first asked)
            _EXACT["cpu"] = _probe()
    return _EXACT["cpu"]


def _probe() -> bool:
    """`forward` against torch's op on three shapes, with and without affine parameters."""
    if kernel() is None:
        return False
    g = torch.Generator().manual_seed(0)
    for shape in ((4, 6, 9, 11), (3, 19, 64), (2, 13, 5, 7)):
        c = shape[1]
        x = torch.randn(shape, generator=g) * 3 + 1
        for affine in (True, False):
            w, b = (torch.randn(c, generator=g), torch.randn(c, generator=g)) if affine else (None, None)
            rm, rv = torch.randn(c, generator=g), torch.rand(c, generator=g) + 0.5
            rm2, rv2 = rm.clone(), rv.clone()
            want = torch.ops.aten.native_batch_norm(x, w, b, rm, rv, True, 0.1, 1e-5)
            got = _forward(x, w, b, rm2, rv2, 0.1, 1e-5, None)
            again = _forward(x, w, b, None, None, 0.1, 1e-5, got[1:])
            if not all(
                torch.equal(a, e) for a, e in zip((*got, rm2, rv2, again[0]), (*want, rm, rv, want[0]))
            ):
                return False
    return True
