"""Session 55 probe: the backward steps' total time (NodeTimer) of a schedule and of its problem's
no-recompute schedule, each run with its shared graphs (`runtime/groups.py`) and with every node
in a graph of its own (`executor.separate_graphs()`), in one process, Adam step in the backward,
freed memory kept; means over STEPS steps after one untimed step; rounds alternate.

    python benchmarks/results/session55/grouped_vs_separate.py SCHEDULE.json PROBLEM.json STEPS
"""

import copy
import sys

import torch

from monet_opt.bench import spec_of, timed_step
from monet_opt.malloc import keep_freed_memory
from monet_opt.node_timer import BACKWARD, NodeTimer
from monet_opt.runtime import MonetWrapper
from solver import Problem, Schedule
from solver import baselines as B

keep_freed_memory()
schedule = Schedule.from_json(sys.argv[1])
problem = Problem.from_json(sys.argv[2])
steps = int(sys.argv[3])
spec = spec_of(schedule)
torch.manual_seed(0)
model = spec.build().train()
inputs = spec.example_inputs(torch.device("cpu"))
optimizer = schedule.meta.get("step_in_backward", {}).get("optimizer")
for name, s in (("schedule", schedule), ("no_recompute", B.no_recompute(problem))):
    for separate in (False, True, False, True):
        wrapped = MonetWrapper(copy.deepcopy(model), s, example_inputs=inputs, optimizer=optimizer)
        groups = len(wrapped.executor.groups) if hasattr(wrapped.executor, "groups") else "?"
        if separate:
            wrapped.executor.separate_graphs()
        timer = NodeTimer(wrapped.executor, inputs)
        timed_step(wrapped, inputs)
        timer.recording = True
        step = sum(timed_step(wrapped, inputs) for _ in range(steps)) / steps
        backward = timer.total(BACKWARD) / steps
        timer.close()
        how = "separate graphs" if separate else f"shared graphs ({groups} groups)"
        print(
            f"{name:12s} {how:24s} backward {backward * 1e3:6.1f} ms, step {step * 1e3:6.1f} ms", flush=True
        )
