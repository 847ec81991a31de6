"""Session 55 probe: a convolution's backward timed right after its forward (autograd's own node,
"native") and from a state made from its input with no forward before it (`Conv2dFromInput`,
"made"), ResNet-50 b8 shapes, medians of 9 calls, three alternations. Gradients are bit for bit
equal (checked separately); the times are not: see conv_backward_timing.txt.

    python benchmarks/results/session55/conv_backward_timing.py
"""

import time

import torch
import torch.nn.functional as F

from monet_opt.ops.conv import Conv2dFromInput


def native(x0, w, g, st, pd):
    x = x0.detach().requires_grad_()
    y = F.conv2d(x, w, None, st, pd)
    t = time.perf_counter()
    torch.autograd.grad(y, [x, w], g)
    return time.perf_counter() - t


def made(x0, w, g, st, pd):
    x = x0.detach().requires_grad_()
    y = Conv2dFromInput.apply(x, w, None, (st, st), (pd, pd), (1, 1), 1, None)
    t = time.perf_counter()
    torch.autograd.grad(y, [x, w], g)
    return time.perf_counter() - t


torch.manual_seed(0)
SHAPES = [
    ((8, 64, 56, 56), (256, 64, 1, 1), 1, 0),
    ((8, 64, 56, 56), (64, 64, 3, 3), 1, 1),
    ((8, 256, 56, 56), (64, 256, 1, 1), 1, 0),
    ((8, 128, 28, 28), (128, 128, 3, 3), 1, 1),
]
for xs, ws, st, pd in SHAPES:
    x0 = torch.randn(xs)
    w = torch.randn(ws, requires_grad=True)
    g = torch.randn_like(F.conv2d(x0, w.detach(), None, st, pd))
    res: dict[str, list[float]] = {}
    for name, f in (("native", native), ("made", made)) * 3:
        f(x0, w, g, st, pd)
        ts = sorted(f(x0, w, g, st, pd) for _ in range(9))
        res.setdefault(name, []).append(round(ts[4] * 1e3, 2))
    print(xs, ws, res, flush=True)
