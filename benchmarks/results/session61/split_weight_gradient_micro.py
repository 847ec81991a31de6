"""Session 61 probe: a layer4 3x3 convolution of ResNet-50 b8 224 (512 -> 512 channels, 7x7)
with its backward split as deferring its weight gradient would run it. Times (median of 20)
the engine's backward asked for the input and weight gradients, asked for the input gradient
alone (aten's convolution backward then skips the weight gradient), and the weight gradient
alone afterwards by `aten.convolution_backward` (mask False, True, False), and checks that
weight gradient is bit for bit the engine's.

python benchmarks/results/session61/split_weight_gradient_micro.py
"""

import statistics
import time

import torch
import torch.nn.functional as F


def median_ms(fn, repeats: int = 20) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main() -> None:
    torch.manual_seed(0)
    x = torch.randn(8, 512, 7, 7, requires_grad=True)
    w = torch.randn(512, 512, 3, 3, requires_grad=True)
    g = torch.randn(8, 512, 7, 7)

    def weight_only():
        return torch.ops.aten.convolution_backward(
            g, x, w, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1, [False, True, False]
        )[1]

    for label, inputs in (("input + weight", [x, w]), ("input alone", [x])):
        times = []
        for _ in range(20):
            y = F.conv2d(x, w, padding=1)
            t0 = time.perf_counter()
            torch.autograd.grad(y, inputs, g)
            times.append(time.perf_counter() - t0)
        print(f"engine backward, {label}: {statistics.median(times) * 1e3:.2f} ms")
    print(f"weight gradient alone afterwards: {median_ms(weight_only):.2f} ms")
    gw = torch.autograd.grad(F.conv2d(x, w, padding=1), [x, w], g)[1]
    print("bit for bit the engine's:", torch.equal(gw, weight_only()))


if __name__ == "__main__":
    main()
