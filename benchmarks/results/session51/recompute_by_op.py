"""Session 51 probe: a schedule's recomputations timed where they run (`NodeTimer`, one autograd
graph per node), against their predicted kernel times, by operator kind. ResNet-50 b8 224.

    python benchmarks/results/session51/recompute_by_op.py PROBLEM.json SCHEDULE.json
"""

import sys
from collections import defaultdict

import torch

from monet_opt.bench import training_step, zero_grad
from monet_opt.malloc import keep_freed_memory
from monet_opt.node_timer import RECOMPUTE, NodeTimer
from monet_opt.runtime import MonetWrapper
from monet_opt.zoo import ModelSpec
from solver import Problem, Schedule

STEPS = 4
keep_freed_memory()
problem = Problem.from_json(sys.argv[1])
schedule = Schedule.from_json(sys.argv[2])
spec = ModelSpec("resnet50", batch=8, image=224)
torch.manual_seed(0)
model = spec.build().train()
inputs = spec.example_inputs()
wrapped = MonetWrapper(model, schedule, example_inputs=inputs)
wrapped.executor.separate_graphs()  # (a group's forward would be timed as its first member's)
timer = NodeTimer(wrapped.executor, inputs)
for k in range(STEPS + 1):  # (the first step warms up)
    timer.recording = k > 0
    zero_grad(wrapped)
    training_step(wrapped, inputs)
timer.close()

nodes = {n.name: n for n in problem.nodes}
again = defaultdict(list)
for stage in schedule.stages[1:]:
    for step in stage.steps:
        if step.op == "compute":
            again[step.node].append(step.impl)
kinds = defaultdict(lambda: [0, 0.0, 0.0])  # kind -> recomputations, measured s, predicted s
for (kind, name), seconds in timer.times.items():
    if kind != RECOMPUTE:
        continue
    impls = {im.name: im for im in nodes[name].impls}
    predicted = sum(
        impls[i].fwd_time if impls[i].recompute_time is None else impls[i].recompute_time for i in again[name]
    )
    row = kinds[name.rstrip("0123456789_").split("_")[-1]]
    row[0] += len(again[name])
    row[1] += sum(seconds) / STEPS
    row[2] += predicted
for kind, (count, measured, predicted) in sorted(kinds.items(), key=lambda kv: -kv[1][1]):
    print(
        f"{kind:12s} {count:3d} recomputations: measured {measured * 1e3:6.1f} ms per step, kernels predicted"
        f" {predicted * 1e3:6.1f} ms: {(measured - predicted) / count * 1e3:+.3f} ms per recomputation"
    )
