"""What in-place gradients buy: the same problem solved with and without them (solver only).

    python benchmarks/inplace_gradients.py --problem resnet50_b8_224.problem.json \
        --fractions 0.75 0.5 0.4 0.33 --time-limit 60

The "without" problem drops every implementation that writes its input gradient into its
output gradient (`Impl.grad_in_place`: bit-mask / in-place-gradient ReLU, in-place-gradient and
output-activated BatchNorm), so both sides see the same measured costs. Budgets are fractions
of the no-recompute peak of the problem WITHOUT them (plain PyTorch's peak: its default
implementations are the same in both). Prints a markdown table of predicted peak and step time.
"""

from __future__ import annotations

import argparse
import dataclasses

from solver import InfeasibleBudget, NoScheduleFound, Problem, min_feasible_lower_bound, simulate, solve
from solver import baselines as B


def without_in_place(problem: Problem) -> Problem:
    nodes = []
    for node in problem.nodes:
        impls = tuple(im for im in node.impls if im.grad_in_place is None)
        nodes.append(dataclasses.replace(node, impls=impls or node.impls[:1]))
    return dataclasses.replace(problem, nodes=tuple(nodes))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--problem", required=True, help="a problem JSON (monet-opt profile ... -o, or build_problem)"
    )
    ap.add_argument("--fractions", type=float, nargs="+", default=[0.75, 0.5, 0.4, 0.33])
    ap.add_argument("--time-limit", type=float, default=60.0)
    args = ap.parse_args(argv)
    with_ip = Problem.from_json(args.problem)
    without = without_in_place(with_ip)
    plain = B.no_recompute(without)
    peak0, t0 = plain.predicted_peak_bytes, plain.predicted_time_s
    print(f"plain: peak {peak0 / 2**20:.1f} MiB, step {t0 * 1e3:.0f} ms (predicted)")
    for label, p in (("without", without), ("with", with_ip)):
        print(f"lower bound {label} in-place gradients: {min_feasible_lower_bound(p) / peak0:.3f} of plain")
    print()
    print("| budget | in-place gradients | predicted peak / plain | predicted step / plain | status, gap |")
    print("|---|---|---:|---:|---|")
    for f in args.fractions:
        for label, p in (("without", without), ("with", with_ip)):
            try:
                s = solve(p, int(f * peak0), time_limit=args.time_limit, verbose=False)
                r = simulate(p, s)
                gap = "" if s.solver.gap is None else f", {100 * s.solver.gap:.1f} %"
                row = f"{r.peak_bytes / peak0:.3f} | {r.time_s / t0:.3f} | {s.solver.status}{gap}"
            except NoScheduleFound as exc:
                row = f"— | — | none found (smallest {exc.minimum_bytes / peak0:.3f})"
            except InfeasibleBudget as exc:
                row = f"— | — | below the lower bound ({exc.minimum_bytes / peak0:.3f})"
            print(f"| {f} | {label} | {row} |", flush=True)


if __name__ == "__main__":
    main()
