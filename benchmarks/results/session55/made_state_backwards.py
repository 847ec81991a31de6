"""Session 55 probe: in-step backward time of each convolution whose state the 1/3 schedule makes
from its input (make_state), against the same convolution's backward in the problem's
no-recompute schedule (its state kept from the forward). Both wrapped with separate graphs per
node (`executor.separate_graphs()`, so each backward is timed alone by a NodeTimer), Adam step in
the backward, freed memory kept; medians over STEPS steps, after one untimed step.

    python benchmarks/results/session55/made_state_backwards.py SCHEDULE.json PROBLEM.json STEPS
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
made = [x.node for st in schedule.stages for x in st.steps if x.op == "make_state"]
spec = spec_of(schedule)
torch.manual_seed(0)
model = spec.build().train()
inputs = spec.example_inputs(torch.device("cpu"))
optimizer = schedule.meta.get("step_in_backward", {}).get("optimizer")
medians = {}
for name, s in (("schedule", schedule), ("no_recompute", B.no_recompute(problem))):
    wrapped = MonetWrapper(copy.deepcopy(model), s, example_inputs=inputs, optimizer=optimizer)
    wrapped.executor.separate_graphs()
    timer = NodeTimer(wrapped.executor, inputs)
    timed_step(wrapped, inputs)
    timer.recording = True
    for _ in range(steps):
        timed_step(wrapped, inputs)
    medians[name] = timer.medians(BACKWARD)
    timer.close()
total_s = total_n = 0.0
for node in made:
    a, b = medians["schedule"].get(node), medians["no_recompute"].get(node)
    if a is None or b is None:
        continue
    total_s += a
    total_n += b
    print(f"{node:28s} made {a * 1e3:7.2f} ms  kept {b * 1e3:7.2f} ms  {a / b - 1:+.0%}")
others = [n for n in medians["schedule"] if n not in made and n in medians["no_recompute"]]
so = sum(medians["schedule"][n] for n in others)
no = sum(medians["no_recompute"][n] for n in others)
print(
    f"{len(made)} made states: backward {total_s * 1e3:.1f} ms against {total_n * 1e3:.1f} kept ({total_s / total_n - 1:+.1%})"
)
print(f"the other {len(others)} backwards: {so * 1e3:.1f} ms against {no * 1e3:.1f} ({so / no - 1:+.1%})")
