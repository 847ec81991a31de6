"""Lossless packing of tensors with many exact zeros (ReLU outputs): a bit mask and the nonzero words.

`pack(x)` returns a `Packed` (a bit per element, set where the element's bits are not all zero,
and the nonzero elements in order); `unpack(p)` gives back x, bitwise (-0.0 and NaN included:
"zero" means the all-zero bit pattern). A ReLU output of density d packs into n/8 + d*n*4
bytes instead of 4n (fp32).

On CPU, for 4-byte dtypes, a small C kernel does each direction in one pass (AVX-512
compress-store / expand-load where the compiler targets them, else a branchless loop), split
over torch's intra-op threads by OpenMP (the libgomp team torch itself runs on). It is compiled on first use with the system C compiler into
the cache directory (`$MONET_OPT_CACHE`, like the profiles) and loaded with ctypes; nothing is
compiled at import. Without a compiler, on CUDA and for other dtypes, torch ops do the same
job (same result, several times slower on CPU: the profiler times whichever runs, so the
solver sees the real cost). `MONET_OPT_ZERO_PACK_KERNEL=0` switches the kernel off.

Measured (AMD EPYC with AVX-512, one ReLU output of 8x256x56x56 fp32, 24.5 MiB, density 0.5,
2 threads): pack 2.3 ms, unpack 1.4 ms; torch ops 89 ms and 35 ms. Intel Xeon (AVX-512), the same
tensor, 2 threads, session 65 (`benchmarks/results/session65/zero_pack_micro.py`): pack 1.44 ms,
unpack 0.78 ms by OpenMP, against 1.8 and 0.98 ms by the Python thread pool it replaced.
"""

from __future__ import annotations

import ctypes
import math
from dataclasses import dataclass

import torch

from . import c_kernels
from .common import pack_bits, unpack_bits

_C_SOURCE = r"""
#include <stdint.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

/* x: n 4-byte words. bits: ceil(n/8) bytes, bit i%8 of byte i/8 set iff x[i] != 0.
   Returns the number of nonzero words. */
int64_t zp_mask(const uint32_t *x, int64_t n, uint8_t *bits) {
    int64_t k = 0, i = 0;
#if defined(__AVX512F__)
    uint16_t *b16 = (uint16_t *)bits;
    for (; i + 16 <= n; i += 16) {
        __m512i v = _mm512_loadu_si512((const void *)(x + i));
        __mmask16 m = _mm512_test_epi32_mask(v, v);
        b16[i >> 4] = (uint16_t)m;
        k += __builtin_popcount((unsigned)m);
    }
#endif
    for (; i < n; i += 8) {
        uint32_t b = 0;
        for (int j = 0; j < 8 && i + j < n; j++) b |= (uint32_t)(x[i + j] != 0) << j;
        bits[i >> 3] = (uint8_t)b;
        k += __builtin_popcount(b);
    }
    return k;
}

/* The nonzero words of x (as marked in bits) written to vals in order; vals holds exactly
   `count` words. (A compress in registers and a whole 64-byte store, while 16 words of room
   remain: the masked compress-store to memory is microcoded, and 6x slower, on AMD Zen 4.) */
void zp_compress(const uint32_t *x, int64_t n, const uint8_t *bits, uint32_t *vals, int64_t count) {
    int64_t k = 0, i = 0;
#if defined(__AVX512F__)
    const uint16_t *b16 = (const uint16_t *)bits;
    for (; i + 16 <= n; i += 16) {
        __mmask16 m = (__mmask16)b16[i >> 4];
        __m512i v = _mm512_loadu_si512((const void *)(x + i));
        if (k + 16 <= count)
            _mm512_storeu_si512((void *)(vals + k), _mm512_maskz_compress_epi32(m, v));
        else
            _mm512_mask_compressstoreu_epi32((void *)(vals + k), m, v);
        k += __builtin_popcount((unsigned)m);
    }
#endif
    for (; i < n; i++) {
        if ((bits[i >> 3] >> (i & 7)) & 1u) vals[k++] = x[i];
    }
}

/* Inverse: x[i] = next value where the bit is set, else 0. */
void zp_expand(const uint8_t *bits, const uint32_t *vals, int64_t n, uint32_t *x) {
    int64_t k = 0, i = 0;
#if defined(__AVX512F__)
    const uint16_t *b16 = (const uint16_t *)bits;
    for (; i + 16 <= n; i += 16) {
        __mmask16 m = (__mmask16)b16[i >> 4];
        __m512i v = _mm512_maskz_expandloadu_epi32(m, (const void *)(vals + k));
        _mm512_storeu_si512((void *)(x + i), v);
        k += __builtin_popcount((unsigned)m);
    }
#endif
    for (; i < n; i++) {
        uint32_t nz = (bits[i >> 3] >> (i & 7)) & 1u;
        x[i] = nz ? vals[k] : 0u;
        k += nz;
    }
}

/* The same over chunks, on OpenMP threads (the libgomp team torch uses): chunk c covers elements
   [lo[c], hi[c]) (lo a multiple of 16), its values start at word at[c]. */
void zp_mask_chunks(const uint32_t *x, const int64_t *lo, const int64_t *hi, int64_t nchunk,
                    uint8_t *bits, int64_t *counts) {
#pragma omp parallel for num_threads(nchunk) schedule(static, 1)
    for (int64_t c = 0; c < nchunk; c++)
        counts[c] = zp_mask(x + lo[c], hi[c] - lo[c], bits + lo[c] / 8);
}

void zp_compress_chunks(const uint32_t *x, const int64_t *lo, const int64_t *hi, int64_t nchunk,
                        const uint8_t *bits, uint32_t *vals, const int64_t *at, const int64_t *counts) {
#pragma omp parallel for num_threads(nchunk) schedule(static, 1)
    for (int64_t c = 0; c < nchunk; c++)
        zp_compress(x + lo[c], hi[c] - lo[c], bits + lo[c] / 8, vals + at[c], counts[c]);
}

void zp_expand_chunks(const uint8_t *bits, const uint32_t *vals, const int64_t *lo, const int64_t *hi,
                      const int64_t *at, int64_t nchunk, uint32_t *x) {
#pragma omp parallel for num_threads(nchunk) schedule(static, 1)
    for (int64_t c = 0; c < nchunk; c++)
        zp_expand(bits + lo[c] / 8, vals + at[c], hi[c] - lo[c], x + lo[c]);
}
"""

# Chunks start on multiples of this many elements (a whole 16-bit mask word).
_ALIGN = 16
# Below this many elements one thread does the whole tensor.
_MIN_PARALLEL = 1 << 16


def _declare(lib: ctypes.CDLL) -> None:
    p, n = ctypes.c_void_p, ctypes.c_int64
    lib.zp_mask_chunks.restype = None
    lib.zp_mask_chunks.argtypes = [p, p, p, n, p, p]
    lib.zp_compress_chunks.restype = None
    lib.zp_compress_chunks.argtypes = [p, p, p, n, p, p, p, p]
    lib.zp_expand_chunks.restype = None
    lib.zp_expand_chunks.argtypes = [p, p, p, p, p, n, p]


_KERNEL = c_kernels.Kernel(
    "zero_pack", _C_SOURCE, _declare, "MONET_OPT_ZERO_PACK_KERNEL", flags=("-fopenmp",)
)


def kernel() -> ctypes.CDLL | None:
    """The compiled kernel, or None (and `kernel_error()` says why); compiled once per process."""
    return _KERNEL.get()


def kernel_error() -> str | None:
    return _KERNEL.error


@dataclass
class Packed:
    """bits: uint8, ceil(numel/8) bytes; values: the nonzero elements (dtype of the original);
    offsets: where each thread chunk's values start (kernel path), for unpacking in parallel."""

    bits: torch.Tensor
    values: torch.Tensor
    shape: torch.Size
    dtype: torch.dtype
    offsets: tuple[tuple[int, int, int], ...] = ()

    @property
    def nbytes(self) -> int:
        return self.bits.numel() + self.values.numel() * self.values.element_size()


def nonzero_count(x: torch.Tensor) -> int:
    """How many elements `pack` keeps: those whose bit pattern is not all zeros."""
    return int(_nonzero_mask(x.contiguous()).sum())


def packed_bytes(x: torch.Tensor) -> int:
    """What `pack(x)` allocates: ceil(numel/8) mask bytes and the nonzero elements."""
    return (x.numel() + 7) // 8 + nonzero_count(x) * x.element_size()


def _kernel_usable(x: torch.Tensor) -> bool:
    return x.device.type == "cpu" and x.element_size() == 4 and x.is_contiguous() and kernel() is not None


def _chunks(n: int) -> list[tuple[int, int]]:
    threads = max(1, torch.get_num_threads())
    if threads == 1 or n < _MIN_PARALLEL:
        return [(0, n)]
    size = -(-n // threads)
    size = -(-size // _ALIGN) * _ALIGN
    return [(a, min(a + size, n)) for a in range(0, n, size)]


def pack(x: torch.Tensor) -> Packed:
    """x as a bit mask of its nonzero elements and those elements (lossless, bitwise)."""
    if _kernel_usable(x):
        return _pack_kernel(x)
    return _pack_torch(x)


def _int64s(values) -> ctypes.Array:
    return (ctypes.c_int64 * len(values))(*values)


def _pack_kernel(x: torch.Tensor) -> Packed:
    lib = kernel()
    n = x.numel()
    bits = torch.empty((n + 7) // 8, dtype=torch.uint8)
    chunks = _chunks(n)
    lo, hi = _int64s([a for a, _ in chunks]), _int64s([b for _, b in chunks])
    counts = _int64s([0] * len(chunks))
    xp = x.view(-1).data_ptr()
    lib.zp_mask_chunks(xp, lo, hi, len(chunks), bits.data_ptr(), counts)
    starts = [0]
    for c in counts[:-1]:
        starts.append(starts[-1] + c)
    values = torch.empty(int(sum(counts)), dtype=x.dtype)
    lib.zp_compress_chunks(
        xp, lo, hi, len(chunks), bits.data_ptr(), values.data_ptr(), _int64s(starts), counts
    )
    offsets = tuple((a, b, k) for (a, b), k in zip(chunks, starts))
    return Packed(bits, values, x.shape, x.dtype, offsets)


def _nonzero_mask(x: torch.Tensor) -> torch.Tensor:
    """True where the element's bit pattern is not all zeros (so -0.0 counts as nonzero)."""
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[x.element_size()]
    return x.reshape(-1).view(ints) != 0


def _pack_torch(x: torch.Tensor) -> Packed:
    mask = _nonzero_mask(x.contiguous())
    values = x.reshape(-1).masked_select(mask)
    return Packed(pack_bits(mask), values, x.shape, x.dtype)


def unpack(p: Packed) -> torch.Tensor:
    """The tensor `pack` was given, bitwise."""
    lib = kernel() if p.offsets and p.bits.device.type == "cpu" else None
    if lib is not None:
        out = torch.empty(p.shape, dtype=p.dtype)
        lo, hi, at = (_int64s(column) for column in zip(*p.offsets))
        lib.zp_expand_chunks(
            p.bits.data_ptr(), p.values.data_ptr(), lo, hi, at, len(p.offsets), out.data_ptr()
        )
        return out
    n = math.prod(p.shape)
    mask = unpack_bits(p.bits, n, (n,))
    out = torch.zeros(n, dtype=p.dtype, device=p.values.device)
    return out.masked_scatter_(mask, p.values).view(p.shape)
