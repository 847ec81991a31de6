"""Session 59 probe: the in-place batch-norm backward's two forms against torch's own, one call each
on ResNet-50 b8 224 shapes (2 threads, freed memory kept; median of 21 calls, ms).

python benchmarks/results/session59/bn_backward_micro.py
"""

import time

import torch

from monet_opt.malloc import keep_freed_memory
from monet_opt.ops import norm

SHAPES = [
    (8, 64, 112, 112),
    (8, 256, 56, 56),
    (8, 64, 56, 56),
    (8, 512, 28, 28),
    (8, 1024, 14, 14),
    (8, 2048, 7, 7),
]


def median_ms(f, g0, reps: int = 21) -> float:
    ts = []
    for _ in range(reps):
        g = g0.clone()
        t0 = time.perf_counter()
        f(g)
        ts.append(time.perf_counter() - t0)
    return sorted(ts)[reps // 2] * 1e3


def row(shape: tuple) -> list[float]:
    """Median ms of torch's backward, the x_hat form, and the new form from the input and output."""
    c = shape[1]
    x = torch.randn(*shape) * 2 + 0.5
    w, b = torch.randn(c), torch.randn(c)
    y, mean, invstd = norm._bn_statistics_forward(x, w, b, None, None, 0.1, 1e-5)
    g0 = torch.randn(*shape)
    scale = invstd * w
    m, s = norm._channel_view(mean, 4), norm._channel_view(invstd, 4)
    forms = [
        lambda g: torch.ops.aten.native_batch_norm_backward(
            g, x, w, None, None, mean, invstd, True, 1e-5, [True] * 3
        ),
        lambda g: norm._bn_backward_in_place(g, lambda i: x[i].sub(m).mul_(s), scale, True),
        lambda g: norm._bn_backward_from_source(g, x, mean, invstd, scale, True),
        lambda g: norm._bn_backward_from_source(g, y, b, 1.0 / w, scale, True),
    ]
    return [median_ms(f, g0) for f in forms]


def main() -> None:
    keep_freed_memory()
    torch.set_num_threads(2)
    torch.manual_seed(0)
    for shape in SHAPES:
        t = row(shape)
        print(
            shape, f"torch {t[0]:.2f}  x_hat form {t[1]:.2f}  from input {t[2]:.2f}  from output {t[3]:.2f}"
        )


if __name__ == "__main__":
    main()
