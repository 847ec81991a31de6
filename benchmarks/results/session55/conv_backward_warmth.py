"""Session 55 probe, after conv_backward_timing.py: ResNet-50's 256->64 1x1 convolution (b8, 56x56),
whose backward from a made state took 21 ms against 16 right after autograd's own forward. Is it
the data cache (flushing 64 MiB after the forward: "native_flushed") or what a forward call leaves
behind (a forward of the same input and weight without grad just before the made state's backward:
"made_after_a_forward")? Medians of 9 calls, two alternations; output conv_backward_warmth.txt.

    python benchmarks/results/session55/conv_backward_warmth.py
"""

import time

import torch
import torch.nn.functional as F

from monet_opt.ops.conv import Conv2dFromInput

torch.manual_seed(0)
X0 = torch.randn(8, 256, 56, 56)
W = torch.randn(64, 256, 1, 1, requires_grad=True)
G = torch.randn(8, 64, 56, 56)
JUNK = torch.randn(64 * 2**20 // 4)


def native(flush: bool) -> float:
    x = X0.detach().requires_grad_()
    y = F.conv2d(x, W)
    if flush:
        JUNK.mul_(1.0)
    t = time.perf_counter()
    torch.autograd.grad(y, [x, W], G)
    return time.perf_counter() - t


def made(forward_first: bool) -> float:
    x = X0.detach().requires_grad_()
    y = Conv2dFromInput.apply(x, W, None, (1, 1), (0, 0), (1, 1), 1, None)
    if forward_first:
        with torch.no_grad():
            F.conv2d(X0, W)
    t = time.perf_counter()
    torch.autograd.grad(y, [x, W], G)
    return time.perf_counter() - t


CASES = (
    ("native", native, False),
    ("native_flushed", native, True),
    ("made", made, False),
    ("made_after_a_forward", made, True),
)
for name, f, arg in CASES * 2:
    f(arg)
    times = sorted(f(arg) for _ in range(9))
    print(name, round(times[4] * 1e3, 2), flush=True)
