"""Pack/unpack time of one ReLU output (8x256x56x56 fp32, density 0.5) at 1 and 2 threads, median of 61."""

import statistics
import time

import torch

from monet_opt.ops import zero_pack


def median_ms(f, n=61):
    times = []
    for _ in range(n):
        t = time.perf_counter()
        f()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


torch.manual_seed(0)
x = torch.relu(torch.randn(8, 256, 56, 56))
p = zero_pack.pack(x)
assert torch.equal(zero_pack.unpack(p).view(torch.int32), x.view(torch.int32))
for threads in (1, 2):
    torch.set_num_threads(threads)
    pack_ms, unpack_ms = median_ms(lambda: zero_pack.pack(x)), median_ms(lambda: zero_pack.unpack(p))
    print(f"{threads} threads: pack {pack_ms:.2f} ms, unpack {unpack_ms:.2f} ms")
