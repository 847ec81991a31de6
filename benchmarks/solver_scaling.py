"""Solver scaling: MILP solve time and proven gap vs. the baselines, on synthetic residual DAGs.

    python benchmarks/solver_scaling.py                       # 50/100/170/350 nodes, 60 s each
    python benchmarks/solver_scaling.py --sizes 50 100 --time-limit 20
    python benchmarks/solver_scaling.py --problem resnet50.problem.json --fractions 0.6 0.4

Prints a markdown table. Times are predicted step times (simulator) relative to no recompute.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from solver import InfeasibleBudget, NoScheduleFound, Problem, min_feasible_lower_bound, simulate, solve
from solver import baselines as B
from solver.synthetic import resnet


def _fmt_t(x):
    return "—" if x is None else f"{x:.3f}"


def run(problems, fractions, time_limit, verbose):
    rows = []
    header = (
        "| problem | nodes | budget | MILP status | MILP time | gap | solve s | best baseline | "
        "no-rec. | ckpt-all | chen | greedy | MILP peak/budget |"
    )
    sep = "|" + "|".join(["---"] * (header.count("|") - 1)) + "|"
    print(header)
    print(sep)
    for label, p in problems:
        nr = B.no_recompute(p)
        peak0 = nr.predicted_peak_bytes
        t0 = nr.predicted_time_s
        lb = min_feasible_lower_bound(p)
        fixed = {k: s for k, s in B.all_baselines(p, None).items()}
        for f in fractions:
            budget = int(f * peak0)

            def rel(s, budget=budget, t0=t0):
                return s.predicted_time_s / t0 if s is not None and s.predicted_peak_bytes <= budget else None

            g = B.greedy(p, budget, time_limit=10)
            best = B.best_baseline(p, budget, greedy_time=10)
            t_start = time.perf_counter()
            try:
                s = solve(p, budget, time_limit=time_limit, verbose=verbose)
                wall = time.perf_counter() - t_start
                sim = simulate(p, s)
                status, mt, gap = s.solver.status, sim.time_s / t0, s.solver.gap
                fit = f"{sim.peak_bytes / budget:.3f}"
            except NoScheduleFound as exc:
                wall = time.perf_counter() - t_start
                status, mt, gap, fit = (
                    f"none found (best known {exc.minimum_bytes / peak0:.2f})",
                    None,
                    None,
                    "—",
                )
            except InfeasibleBudget as exc:
                wall = time.perf_counter() - t_start
                if exc.minimum_bytes <= lb:
                    status = f"below lower bound {lb / peak0:.2f}"
                else:  # the MILP proved its (conservative) model infeasible and no baseline fits
                    status = f"MILP infeasible (best known {exc.minimum_bytes / peak0:.2f})"
                mt, gap, fit = None, None, "—"
            row = (
                f"| {label} | {len(p.nodes)} | {f:.2f} ({budget / 2**20:.1f} MiB; lb {lb / peak0:.2f}) | {status} | "
                f"{_fmt_t(mt)} | {'—' if gap is None else f'{100 * gap:.1f}%'} | {wall:.1f} | "
                f"{_fmt_t(rel(best))} {best.strategy if best else ''} | {_fmt_t(rel(fixed['no_recompute']))} | "
                f"{_fmt_t(rel(fixed['checkpoint_all']))} | {_fmt_t(rel(fixed['chen_sqrt']))} | {_fmt_t(rel(g))} | {fit} |"
            )
            print(row, flush=True)
            rows.append(row)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=int, nargs="+", default=[50, 100, 170, 350])
    ap.add_argument("--fractions", type=float, nargs="+", default=[0.8, 0.6, 0.4, 0.33])
    ap.add_argument("--time-limit", type=float, default=60.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--problem", type=Path, action="append", help="a real problem JSON file (repeatable)")
    ap.add_argument("--verbose", action="store_true")
    args = ap.parse_args(argv)
    if args.problem:
        problems = [(path.stem, Problem.from_json(path)) for path in args.problem]
    else:
        problems = [(f"resnet{n}", resnet(n, seed=args.seed)) for n in args.sizes]
    print(
        f"solver scaling: time limit {args.time_limit:.0f} s per solve; times relative to no recompute "
        f"(lower is better; — = does not fit); gap = proven relative gap of the MILP's schedule "
        "(HiGHS dual bound or the no-recompute time, whichever is higher)\n",
        file=sys.stderr,
    )
    run(problems, args.fractions, args.time_limit, args.verbose)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
