"""Session 60 probe: each node's backward timed where it runs (`monet_opt.node_timer`, separate
graphs as the calibration times them), against its predicted time, for a schedule and for the
no-recompute schedule with the same forward implementations; sums by (op, implementation).

python benchmarks/results/session60/node_backward_error.py SCHEDULE.json PROBLEM.json
"""

import collections
import copy
import sys

import torch

from monet_opt.bench import spec_of, timed_step, zero_grad
from monet_opt.malloc import keep_freed_memory
from monet_opt.node_timer import BACKWARD, NodeTimer
from monet_opt.runtime import MonetWrapper
from solver import Problem, Schedule, baselines


def impl_at_backward(schedule: Schedule) -> dict:
    """{node: the implementation its backward runs (that of its last computation before)}."""
    current, out = {}, {}
    for stage in schedule.stages:
        for s in stage.steps:
            if s.op == "compute":
                current[s.node] = s.impl
            if s.op == "backward":
                out[s.node] = current.get(s.node)
    return out


def main() -> None:
    keep_freed_memory()
    schedule, problem = Schedule.from_json(sys.argv[1]), Problem.from_json(sys.argv[2])
    spec = spec_of(schedule)
    torch.manual_seed(0)
    model, inputs = spec.build().train(), spec.example_inputs()
    optimizer = schedule.meta.get("step_in_backward", {}).get("optimizer")
    nodes = {n.name: n for n in problem.nodes}
    forward = {s.node: s.impl for s in schedule.stages[0].steps if s.op == "compute"}
    for label, sched in (
        ("schedule", schedule),
        ("no recomputation", baselines.no_recompute(problem, impls=forward)),
    ):
        wrapped = MonetWrapper(copy.deepcopy(model), sched, example_inputs=inputs, optimizer=optimizer)
        wrapped.executor.separate_graphs()
        timer = NodeTimer(wrapped.executor, inputs)
        timed_step(wrapped, inputs)
        timer.recording = True
        for _ in range(5):
            timed_step(wrapped, inputs)
        timer.close()
        zero_grad(wrapped)
        at_backward = impl_at_backward(sched)
        sums = collections.defaultdict(lambda: [0, 0.0, 0.0])
        for name, measured in timer.medians(BACKWARD).items():
            impl = at_backward.get(name) or forward[name]
            row = sums[(nodes[name].op, impl)]
            row[0] += 1
            row[1] += measured
            row[2] += nodes[name].impl(impl).bwd_time
        total_m, total_p = sum(r[1] for r in sums.values()), sum(r[2] for r in sums.values())
        print(f"{label}: backward measured {total_m * 1e3:.1f} ms, predicted {total_p * 1e3:.1f}")
        for (op, impl), (count, m, p) in sorted(sums.items(), key=lambda kv: kv[1][2] - kv[1][1]):
            print(f"  {op:>18} {impl:>22} n={count:3d} measured {m * 1e3:7.1f} predicted {p * 1e3:7.1f}")


if __name__ == "__main__":
    main()
