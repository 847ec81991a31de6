"""How far plain PyTorch's gradients differ from themselves: one training step at the default
thread count and one at 1 thread (another float32 summation order, nothing else changed).

    python benchmarks/plain_gradient_noise.py [torchvision model names] [--out DIR]

The models are built as `model_sweep.py --family torchvision` builds them (random weights,
10 classes, batch 2, 64x64) and stepped with the tests' loss (`tests.test_runtime.grads_after_step`).
Per model: how many parameter gradients differ by more than the tests' tolerance (rtol 1e-5, atol
1e-5 of the tensor's largest, at least 1e-6), and the three furthest over it. The sweeps' failing
rows are set beside this: an implementation within float rounding differs from plain PyTorch by
about as much as plain PyTorch differs from itself. Writes DIR/plain_gradient_noise.md.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import sys
from pathlib import Path

import torch
import torchvision

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from solver.jsonio import atomic_write_text  # noqa: E402
from tests.test_runtime import GRAD_RTOL, grad_atol, grads_after_step  # noqa: E402


def over_tolerance(expected: dict, got: dict) -> list[tuple[float, float, float, str]]:
    """(how far over the tests' tolerance (`tests.test_runtime.assert_grads_close`), largest
    difference, largest gradient, name), furthest first."""
    rows = []
    for name, e in expected.items():
        g = got[name]
        largest = float(e.abs().max())
        excess = float(((g - e).abs() - (grad_atol(largest) + GRAD_RTOL * e.abs())).max())
        rows.append((excess, float((g - e).abs().max()), largest, name))
    return sorted(rows, reverse=True)


def grads_at_one_thread(model: torch.nn.Module, x: torch.Tensor) -> tuple[int, dict, dict]:
    """(the default thread count, a copy of the model's gradients after one plain step at it,
    and at 1 thread); the model itself is not stepped."""
    threads, grads = torch.get_num_threads(), []
    try:
        for n in (threads, 1):
            torch.set_num_threads(n)
            plain = copy.deepcopy(model)
            grads.append(grads_after_step(plain, plain, x))
    finally:
        torch.set_num_threads(threads)
    return threads, grads[0], grads[1]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("models", nargs="*", default=["mnasnet0_5", "efficientnet_b0", "vgg11_bn", "resnet18"])
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args(argv)
    threads = torch.get_num_threads()
    lines = [
        f"### Plain PyTorch against itself, {threads} threads and 1 ({datetime.datetime.now():%Y-%m-%d %H:%M})",
        "",
        f"`python benchmarks/plain_gradient_noise.py {' '.join(args.models)}`: batch 2, 64x64, the tests' loss.",
        "",
        "| model | gradients over the tests' tolerance | furthest over (tensor: difference, its largest gradient) |",
        "|---|---:|---|",
    ]
    for name in args.models:
        torch.manual_seed(0)
        model = torchvision.models.get_model(name, weights=None, num_classes=10).train()
        x = torch.randn(2, 3, 64, 64)
        _, at_default, at_one = grads_at_one_thread(model, x)
        rows = over_tolerance(at_default, at_one)
        over = sum(r[0] > 0 for r in rows)
        worst = "; ".join(f"{r[3]}: {r[1]:.3g}, {r[2]:.3g}" for r in rows[:3] if r[0] > 0)
        lines.append(f"| {name} | {over} of {len(rows)} | {worst} |")
        print(lines[-1], flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / "plain_gradient_noise.md", "\n".join(lines) + "\n")
    print(f"wrote {out / 'plain_gradient_noise.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
