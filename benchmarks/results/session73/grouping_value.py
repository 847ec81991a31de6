"""What the runtime's groups (`monet_opt/runtime/groups.py`: one autograd graph and one backward
call for a run of nodes) are worth at full size, and what one graph per node costs: plain
PyTorch against the problem's no-recompute schedule and against SCHEDULE, each run with its
groups and with `executor.separate_graphs()` (what the in-step calibration times), paired rounds.

    python benchmarks/results/session73/grouping_value.py SCHEDULE.json PROBLEM.json [--rounds 11]
"""

import argparse
import copy

from node_times import load  # (this directory)

from monet_opt.bench import interleaved_samples, paired_ratio
from monet_opt.runtime import MonetWrapper
from solver import baselines

ap = argparse.ArgumentParser()
ap.add_argument("schedule")
ap.add_argument("problem")
ap.add_argument("--rounds", type=int, default=11)
args = ap.parse_args()
schedule, problem, model, inputs = load(args.schedule, args.problem)
print("| run | engine calls per step | plain ms | run ms | overhead (quartiles) |")
print("|---|---:|---:|---:|---|")
for label, sched in (("no recomputation", baselines.no_recompute(problem)), ("schedule", schedule)):
    for separate in (False, True):
        w = MonetWrapper(copy.deepcopy(model), sched, example_inputs=inputs)
        ex = w.executor
        if separate:
            ex.separate_graphs()
        groups = {g.members for g in ex.group_of.values()}
        backward_steps = sum(1 for st in sched.stages for s in st.steps if s.op == "backward")
        calls = backward_steps - sum(len(m) - 1 for m in groups)
        ta, tb = interleaved_samples(model, w, inputs, args.rounds)
        med, q1, q3 = paired_ratio(ta, tb)
        ta.sort()
        tb.sort()
        print(
            f"| {label}, {'one graph per node' if separate else 'groups'} | {calls} | "
            f"{ta[len(ta) // 2] * 1e3:.0f} | {tb[len(tb) // 2] * 1e3:.0f} | "
            f"{med - 1:+.1%} ({q1 - 1:+.1%} .. {q3 - 1:+.1%}) |",
            flush=True,
        )
        del w
