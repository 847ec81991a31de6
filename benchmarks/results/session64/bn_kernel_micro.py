"""Session 64 probe: batch norm's C kernels (ops/batch_norm_kernel.py) against torch, one call
each on ResNet-50 b8 224 shapes (2 threads, freed memory kept; median of 21 calls, ms): the
in-place backward (from the kept input) against the torch-ops form it replaces (torch's sums,
three in-place passes) and torch's own backward; the training forward against torch's.

python benchmarks/results/session64/bn_kernel_micro.py
"""

import os
import sys
from pathlib import Path

import torch

from monet_opt.malloc import keep_freed_memory
from monet_opt.ops import batch_norm_kernel, norm

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "session59"))
from bn_backward_micro import SHAPES, median_ms  # noqa: E402  (session 59's probe: same shapes, timing)


def torch_ops_form(g, x, mean, invstd, scale):
    os.environ["MONET_OPT_BN_KERNEL"] = "0"
    try:
        return norm._bn_backward_from_source(g, x, mean, invstd, scale, True)
    finally:
        del os.environ["MONET_OPT_BN_KERNEL"]


def row(shape: tuple) -> list[float]:
    """Median ms of torch's backward, the torch-ops in-place form, and the kernel."""
    c = shape[1]
    x = torch.randn(*shape) * 2 + 0.5
    w, b = torch.randn(c), torch.randn(c)
    y, mean, invstd = norm._bn_statistics_forward(x, w, b, None, None, 0.1, 1e-5)
    g0 = torch.randn(*shape)
    scale = invstd * w
    forms = [
        lambda g: torch.ops.aten.native_batch_norm_backward(
            g, x, w, None, None, mean, invstd, True, 1e-5, [True] * 3
        ),
        lambda g: torch_ops_form(g, x, mean, invstd, scale),
        lambda g: batch_norm_kernel.backward(g, x, mean, invstd, scale, True),
    ]
    rm, rv = torch.zeros(c), torch.ones(c)
    forwards = [
        lambda _: norm._bn_statistics_forward(x, w, b, rm, rv, 0.1, 1e-5),
        lambda _: batch_norm_kernel.forward(x, w, b, rm, rv, 0.1, 1e-5),
    ]
    return [median_ms(f, g0) for f in forms + forwards]


def main() -> None:
    keep_freed_memory()
    torch.set_num_threads(2)
    torch.manual_seed(0)
    assert batch_norm_kernel.kernel() is not None, batch_norm_kernel.kernel_error()
    for shape in SHAPES:
        t = row(shape)
        print(
            shape,
            f"backward: torch {t[0]:.2f}  torch-ops in-place {t[1]:.2f}  kernel {t[2]:.2f}   "
            f"forward: torch {t[3]:.2f}  kernel {t[4]:.2f}",
        )


if __name__ == "__main__":
    main()
