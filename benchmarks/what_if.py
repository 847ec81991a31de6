"""What a cheaper cost would buy, before anyone builds it: a saved problem solved as it is and
with one hypothetical change to its costs at a time, predicted step times side by side.

    python benchmarks/what_if.py PROBLEM.json --budget 0.3333 [--time-limit 60] [--scenarios a,b+c]
    python benchmarks/what_if.py PROBLEM.json --budget-of SCHEDULE.json

Nothing is measured: each scenario rewrites the problem's costs (`SCENARIOS` below) and the
solver (`solver.solve`, the same time limit for every row) says how much faster the best
schedule it finds becomes. A scenario only makes costs lower, so where the solves are proven
optimal (to `mip_gap`, 1 % as `solver.solve`'s default) its predicted time is never higher than
the baseline's by more than that; under a time limit both sides carry the solver's own
run-to-run spread (about 0.5 % on ResNet-50 b8 224 at 1/3 in 60 s, session 63), which is the
noise floor of a row. A budget <= 1 is a fraction of the problem's no-recompute peak (plain
PyTorch's, as `monet-opt solve` reads it), a larger one is bytes; --budget-of takes a schedule's.

Session 63 used it to rule ideas out ("Session 63" in benchmarks/README.md): on
ResNet-50 b8 224 with gradients kept at 1/3, free forward workspaces (what batch-chunked
convolution forwards would approach) bought nothing, the convolutions' backward workspaces free
1.7 %, in-place batch-norm backwards as fast as torch's own 1.6 % (0.8 % on another day's
problem): none worth a new kernel on its own.

Writes DIR/what_if_<problem name>.md (DIR: --out).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import shlex
import sys
from pathlib import Path

import solver
from solver import Problem, Schedule, resolve_budget
from solver.jsonio import atomic_write_text

# op names as the profile records them (`monet_opt.profile`), and as `solver.synthetic` does
CONV_OPS = ("conv2d",)
BATCHNORM_OPS = ("batchnorm2d", "batch_norm")


def _map_impls(problem: Problem, change, ops: tuple[str, ...] | None = None) -> Problem:
    """`problem` with `change(node, impl)` (a new Impl) applied to every implementation of every
    node (of those ops, if given)."""
    nodes = []
    for n in problem.nodes:
        if ops is None or n.op in ops:
            n = dataclasses.replace(n, impls=tuple(change(n, im) for im in n.impls))
        nodes.append(n)
    return dataclasses.replace(problem, nodes=nodes)


def fwd_workspace_free(problem: Problem) -> Problem:
    """Every forward workspace 0, with grad and without."""

    def change(_node, im):
        nograd = None if im.nograd_fwd_workspace is None else 0
        return dataclasses.replace(im, fwd_workspace=0, nograd_fwd_workspace=nograd)

    return _map_impls(problem, change)


def bwd_workspace_free(problem: Problem, ops: tuple[str, ...] | None = None) -> Problem:
    """Every backward workspace 0 (of those ops' nodes, if given: torch's own batch-norm backward
    allocates a same-size temporary, oneDNN's convolution backward a copy of its output gradient)."""
    return _map_impls(problem, lambda _n, im: dataclasses.replace(im, bwd_workspace=0), ops)


def inplace_batchnorm_as_fast(problem: Problem) -> Problem:
    """Batch-norm implementations that write the input gradient in place (`grad_in_place`) take
    the default's backward time where theirs is longer."""

    def change(node, im):
        default = next((d for d in node.impls if d.name == "default"), None)
        if default is None or im.grad_in_place is None or im.bwd_time <= default.bwd_time:
            return im
        return dataclasses.replace(im, bwd_time=default.bwd_time)

    return _map_impls(problem, change, BATCHNORM_OPS)


SCENARIOS = {
    "fwd_workspace_free": fwd_workspace_free,
    "bwd_workspace_free": bwd_workspace_free,
    "conv_bwd_workspace_free": functools.partial(bwd_workspace_free, ops=CONV_OPS),
    "batchnorm_bwd_workspace_free": functools.partial(bwd_workspace_free, ops=BATCHNORM_OPS),
    "inplace_batchnorm_as_fast": inplace_batchnorm_as_fast,
}


def apply(name: str, problem: Problem) -> Problem:
    """`problem` with the scenario `name` applied; "a+b": a, then b."""
    for part in name.split("+"):
        problem = SCENARIOS[part](problem)
    return problem


def budget_bytes(problem: Problem, budget: float) -> int:
    """A budget <= 1: that fraction of the no-recompute peak with every weight gradient made in
    the backward (plain PyTorch's; as `monet-opt solve` reads it: `solver.resolve_budget`); else
    bytes."""
    return resolve_budget(problem, float(budget) if budget <= 1 else int(budget))


def solve_row(name: str, problem: Problem, budget: int, time_limit: float, mip_gap: float = 0.01) -> dict:
    sched = solver.solve(problem, budget, time_limit=time_limit, mip_gap=mip_gap, verbose=False)
    return {
        "scenario": name,
        "time_s": sched.predicted_time_s,
        "peak": sched.predicted_peak_bytes,
        "status": sched.solver.status,
        "gap": sched.solver.gap,
    }


def table(rows: list[dict]) -> list[str]:
    base = rows[0]["time_s"]
    out = [
        "| scenario | predicted step s | vs as measured | peak MiB | solver status / gap |",
        "|---|---:|---:|---:|---|",
    ]
    for r in rows:
        gap = "" if r["gap"] is None else f" / {r['gap']:.1%}"
        out.append(
            f"| {r['scenario']} | {r['time_s']:.4f} | {r['time_s'] / base - 1:+.1%} | "
            f"{r['peak'] / 2**20:.1f} | {r['status']}{gap} |"
        )
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("problem")
    group = ap.add_mutually_exclusive_group(required=True)
    group.add_argument("--budget", type=float, help="<= 1: fraction of the no-recompute peak; else bytes")
    group.add_argument("--budget-of", help="a schedule whose budget to use")
    ap.add_argument("--time-limit", type=float, default=60.0)
    ap.add_argument(
        "--scenarios",
        default=",".join(SCENARIOS),
        help=f"comma-separated rows, a+b: both changes in one row; of: {', '.join(SCENARIOS)}",
    )
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args(argv)

    names = [s for s in args.scenarios.split(",") if s]
    unknown = [part for s in names for part in s.split("+") if part not in SCENARIOS]
    if unknown:
        ap.error(f"unknown scenario(s) {unknown}; known: {', '.join(SCENARIOS)}")
    problem = Problem.from_json(args.problem)
    if args.budget_of:
        budget = Schedule.from_json(args.budget_of).budget_bytes
        if budget is None:
            ap.error(f"{args.budget_of} has no budget")
    else:
        budget = budget_bytes(problem, args.budget)

    rows = []
    for name in ["as measured", *names]:
        print(f"solving: {name} ({args.time_limit:g} s)", file=sys.stderr, flush=True)
        changed = problem if name == "as measured" else apply(name, problem)
        rows.append(solve_row(name, changed, budget, args.time_limit))
    text = "\n".join(
        [
            f"### What if: {Path(args.problem).name}, budget {budget / 2**20:.1f} MiB — "
            f"{datetime.datetime.now():%Y-%m-%d %H:%M}",
            "",
            f"Command: `python {' '.join(shlex.quote(a) for a in sys.argv)}`",
            "",
            *table(rows),
            "",
        ]
    )
    print(text)
    path = Path(args.out) / f"what_if_{Path(args.problem).stem}.md"
    atomic_write_text(path, text)
    print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
