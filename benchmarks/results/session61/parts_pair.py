"""Session 61 probe: two schedules of one problem run alternately (grouped graphs, as trained),
each step split by part (`monet_opt.bench.measure_parts`) beside the simulator's prediction.

python benchmarks/results/session61/parts_pair.py PROBLEM.json SCHEDULE_A.json [SCHEDULE_B.json | --budget-one]
(--budget-one: B is `solver.solve(problem, 1.0)`, the no-recompute optimum; --separate: B is A with
every node in an autograd graph of its own, `executor.separate_graphs()`.)
"""

import copy
import sys

import torch

from monet_opt.bench import measure_parts, predicted_parts, spec_of
from monet_opt.malloc import keep_freed_memory
from monet_opt.runtime import MonetWrapper
from solver import Problem, Schedule, solve


def main() -> None:
    keep_freed_memory()
    problem = Problem.from_json(sys.argv[1])
    a = Schedule.from_json(sys.argv[2])
    if sys.argv[3] == "--budget-one":
        b = solve(problem, 1.0, time_limit=30, verbose=False)
    else:
        b = a if sys.argv[3] == "--separate" else Schedule.from_json(sys.argv[3])
    spec = spec_of(a)
    torch.manual_seed(0)
    model, inputs = spec.build().train(), spec.example_inputs()
    optimizer = a.meta.get("step_in_backward", {}).get("optimizer")
    wrapped = {
        label: MonetWrapper(copy.deepcopy(model), s, example_inputs=inputs, optimizer=optimizer)
        for label, s in (("A", a), ("B", b))
    }
    if sys.argv[3] == "--separate":
        wrapped["B"].executor.separate_graphs()
    sums = {"A": [], "B": []}
    for _ in range(4):
        for label in ("A", "B"):
            sums[label].append(measure_parts(wrapped[label], inputs, steps=3))
    for label, s in (("A", a), ("B", b)):
        p = predicted_parts(problem, s)
        print(
            f"{label}: predicted forward {p.forward_s * 1e3:.0f} recompute {p.recompute_s * 1e3:.0f} backward {p.backward_s * 1e3:.0f} step {p.step_s * 1e3:.0f}"
        )
        for m in sums[label]:
            other = m.step_s - m.forward_s - m.recompute_s - m.backward_s
            print(
                f"   measured forward {m.forward_s * 1e3:.0f} recompute {m.recompute_s * 1e3:.0f} backward {m.backward_s * 1e3:.0f} other {other * 1e3:.0f} step {m.step_s * 1e3:.0f}"
            )


if __name__ == "__main__":
    main()
