"""How far a wrapped model's float32 gradients are from exact, beside plain PyTorch's.

    python benchmarks/gradient_accuracy.py --model timm/repvit_m1 --batch 2 --image 64 [--budget 0.4]

Profiles the model, solves (10 s) at `--budget` of the way from the lowest feasible peak to plain
PyTorch's (`tests.test_runtime.budget_at`, as the model sweep does), runs one training step
wrapped and one plain in float32, and one plain step of a float64 copy (same weights, input and
RNG seed) as the reference. Prints, for the parameters where wrapped and plain differ most, the
largest absolute difference of each from the reference and from each other: when the wrapped
step is as far from float64 as plain's, a wrapped-vs-plain difference over the tests' tolerance
is rounding in another order (batch-chunked weight gradients, say), not an error.
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from monet_opt.bench import loss_of  # noqa: E402
from monet_opt.pipeline import solve_model  # noqa: E402
from monet_opt.profile import build_problem  # noqa: E402
from monet_opt.runtime import MonetWrapper  # noqa: E402
from monet_opt.zoo import build_model  # noqa: E402
from tests.test_runtime import budget_at  # noqa: E402


def _grads(module: torch.nn.Module, owner: torch.nn.Module, x: torch.Tensor) -> dict[str, torch.Tensor]:
    for p in owner.parameters():
        p.grad = None
    torch.manual_seed(1)
    loss_of(module(x)).backward()
    return {n: p.grad.detach().double().clone() for n, p in owner.named_parameters() if p.grad is not None}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="timm/repvit_m1")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--image", type=int, default=64)
    ap.add_argument("--budget", type=float, default=0.4, help="of the way from the lowest peak to plain's")
    ap.add_argument("--rows", type=int, default=8)
    args = ap.parse_args(argv)

    model = build_model(args.model, args.image).train()
    torch.manual_seed(0)
    x = torch.randn(args.batch, 3, args.image, args.image)
    problem = build_problem(model, (x,), progress=False, repeats=1)
    _, schedule = solve_model(
        model, (x,), budget_at(problem, args.budget), time_limit=10, verbose=False, problem=problem
    )
    state = copy.deepcopy(model.state_dict())
    wrapped = _grads(MonetWrapper(model, schedule, example_inputs=(x,)), model, x)
    model.load_state_dict(state)
    plain = _grads(model, model, x)
    model.load_state_dict(state)
    exact_model = copy.deepcopy(model).double()
    exact = _grads(exact_model, exact_model, x.double())
    rows = []
    for name, g in plain.items():
        if name in wrapped:
            rows.append(
                (
                    (wrapped[name] - g).abs().max().item(),
                    (wrapped[name] - exact[name]).abs().max().item(),
                    (g - exact[name]).abs().max().item(),
                    name,
                )
            )
    rows.sort(reverse=True)
    print(f"{args.model}, batch {args.batch}, {args.image}x{args.image}, budget {args.budget} of the way")
    print("| parameter | wrapped - plain | wrapped - float64 | plain - float64 |")
    print("|---|---:|---:|---:|")
    for diff, w_err, p_err, name in rows[: args.rows]:
        print(f"| {name} | {diff:.2e} | {w_err:.2e} | {p_err:.2e} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
