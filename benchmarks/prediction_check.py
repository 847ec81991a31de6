"""Predicted against measured step overhead, with and without the runtime's cost per recomputation.

    python benchmarks/prediction_check.py --model gpt --batch 8 --seq 128 --budget 0.6
    python benchmarks/prediction_check.py --model mobilenet_v2 --batch 8 --image 64 --budget 0.5

Profiles the model once (`build_problem`: its `recompute_overhead_s` measured on this device,
`monet_opt.runtime_cost`), solves the budget twice, on that problem and on the same problem with
the overhead set to 0 (the cost model before session 29), and times both schedules against plain
PyTorch in the same run: rounds rotate the three models, each timed step after an untimed step of
the same model, the overhead the median of the rounds' paired ratios (quartiles beside it).
Freed memory is kept in the process (`monet_opt.malloc`), as a GPU's caching allocator does.
Writes DIR/prediction_check_<model>.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import statistics
from pathlib import Path

import torch

import solver
from monet_opt import bench, malloc
from monet_opt.profile import build_problem
from monet_opt.runtime import MonetWrapper
from monet_opt.zoo import ModelSpec
from solver import simulate
from solver.baselines import no_recompute
from solver.jsonio import atomic_write_text


def quartiles(values: list[float]) -> tuple[float, float, float]:
    q = statistics.quantiles(values, n=4)
    return q[0], statistics.median(values), q[2]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="gpt")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--image", type=int, default=64)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--budget", type=float, default=0.6, help="fraction of the no-recompute peak")
    ap.add_argument("--time-limit", type=float, default=30.0)
    ap.add_argument("--rounds", type=int, default=21)
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args(argv)

    malloc.keep_freed_memory()
    spec = ModelSpec(args.model, batch=args.batch, image=args.image, seq=args.seq)
    torch.manual_seed(0)
    model = spec.build()
    inputs = spec.example_inputs()
    with_overhead = build_problem(model, inputs, progress=False)
    without = dataclasses.replace(with_overhead, recompute_overhead_s=0.0)
    budget = int(args.budget * simulate(with_overhead, no_recompute(with_overhead)).peak_bytes)

    def predicted(problem, schedule) -> float:
        return simulate(problem, schedule).time_s / simulate(problem, no_recompute(problem)).time_s - 1

    solved = {}
    for label, problem in (("overhead 0 (before)", without), ("overhead measured", with_overhead)):
        schedule = solver.solve(problem, budget, time_limit=args.time_limit, verbose=False)
        solved[label] = (problem, schedule, MonetWrapper(model, schedule, example_inputs=inputs))
    runs = {"plain": model, **{label: w for label, (_, _, w) in solved.items()}}
    times: dict[str, list[float]] = {k: [] for k in runs}
    order = list(runs)
    for r in range(args.rounds):
        for k in order[r % len(order) :] + order[: r % len(order)]:
            bench.timed_step(runs[k], inputs)
            times[k].append(bench.timed_step(runs[k], inputs))
    bench.zero_grad(model)

    lines = [
        f"### {spec.describe()}, budget {args.budget:g} of the no-recompute peak "
        f"({datetime.datetime.now():%Y-%m-%d %H:%M})",
        "",
        f"`python benchmarks/prediction_check.py --model {args.model} --batch {args.batch} --image "
        f"{args.image} --seq {args.seq} --budget {args.budget:g} --rounds {args.rounds}`; runtime "
        f"cost per recomputation measured here: {with_overhead.recompute_overhead_s * 1e3:.3f} ms; "
        f"plain step {statistics.median(times['plain']) * 1e3:.1f} ms (median of {args.rounds}).",
        "",
        "| solved with | recompute steps | predicted overhead | same plan, predicted with the overhead "
        "| measured overhead (quartiles) | measured peak MiB |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for label, (problem, schedule, wrapped) in solved.items():
        steps = sum(1 for st in schedule.stages[1:] for s in st.steps if s.op == "compute")
        q1, med, q3 = quartiles([a / p - 1 for a, p in zip(times[label], times["plain"])])
        peak = bench.measure_step_peak(wrapped, inputs) / 2**20
        lines.append(
            f"| {label} | {steps} | {predicted(problem, schedule):+.1%} | "
            f"{predicted(with_overhead, schedule):+.1%} | {med:+.1%} ({q1:+.1%} .. {q3:+.1%}) | {peak:.1f} |"
        )
    text = "\n".join(lines) + "\n"
    print(text)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"prediction_check_{args.model.replace('/', '_')}.md"
    atomic_write_text(path, text)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
