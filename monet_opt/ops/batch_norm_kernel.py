"""The in-place batch-norm backward in one C kernel (CPU, float32, contiguous tensors).

`backward(g, z, center, inv, scale, need_x)` does what `norm._bn_backward_from_source` does with
torch ops: per channel, dot = sum(g * x_hat) and gsum = sum(g) with x_hat = (z - center) * inv,
then (if need_x) g = (g - mean(g) - x_hat * mean(g * x_hat)) * scale, written into g. The kernel
takes one channel at a time: its sums (float partial sums of blocks of a plane, added in double),
then the rewrite of the same planes while they are still in cache, so g and z are read from
memory about once and g written once; the torch ops read them twice for the sums and run three
in-place passes. Channels are split over torch's intra-op threads with OpenMP, which finds the
runtime torch loaded (a Python thread pool instead ran no faster on 2 threads than on 1: torch's
OpenMP workers spin on the cores after each op). Compiled on first use (`c_kernels.build`);
without a compiler, on CUDA, for other dtypes or layouts `backward` returns None and the caller
runs the torch ops. `MONET_OPT_BN_KERNEL=0` switches it off.

Measured (Intel Xeon, 2 threads, 8x256x56x56, `benchmarks/results/session64/bn_kernel_micro.py`):
1.8 ms, the torch-ops form 6.3 ms, torch's own (allocating) backward 4.4 ms.
"""

from __future__ import annotations

import ctypes

import torch

from . import c_kernels

_C_SOURCE = r"""
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


_KERNEL = c_kernels.Kernel("batch_norm", _C_SOURCE, _declare, "MONET_OPT_BN_KERNEL", ("-fopenmp",))


def kernel() -> ctypes.CDLL | None:
    """The compiled kernel, or None (and `kernel_error()` says why); compiled once per process."""
    return _KERNEL.get()


def kernel_error() -> str | None:
    return _KERNEL.error


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
    threads = torch.get_num_threads() if g.numel() >= 1 << 15 else 1
    lib.bn_backward(
        g.data_ptr(),
        z.data_ptr(),
        n,
        c,
        hw,
        threads,
        *(t.data_ptr() for t in wide),
        dot.data_ptr(),
        gsum.data_ptr(),
        1 if need_x else 0,
    )
    return dot.to(torch.float32), gsum.to(torch.float32)
