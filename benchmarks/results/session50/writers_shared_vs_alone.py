"""Session 50 probe: shipped schedules with gradient-writing implementations in shared graphs
where their gradient is their own (session 50) against all of them alone (before: the check
patched to the empty set), each paired with plain PyTorch (`bench_model`), twice in turn.

    python benchmarks/results/session50/writers_shared_vs_alone.py FILE[,FILE...] [STEPS]
"""

import sys

import torch

import solver
from monet_opt.bench import bench_model
from monet_opt.malloc import keep_freed_memory
from monet_opt.runtime import MonetWrapper, executor
from monet_opt.zoo import ModelSpec

keep_freed_memory()
files = sys.argv[1].split(",")
steps = int(sys.argv[2]) if len(sys.argv) > 2 else 11
own = executor.ScheduleExecutor._own_gradients
for f in files:
    sched = solver.Schedule.from_json(f)
    name = f.split("/")[-1]
    parts = name[:-5].split("_")
    spec = ModelSpec("_".join(parts[:-3]), batch=int(parts[-3][1:]), image=int(parts[-2][1:]))
    torch.manual_seed(0)
    model = spec.build().train()
    inputs = spec.example_inputs()
    for label, fn in (("writers shared", own), ("writers alone", lambda self: (set(), set()))) * 2:
        executor.ScheduleExecutor._own_gradients = fn
        w = MonetWrapper(model, sched, example_inputs=inputs)
        ngroups = len(w.executor.groups)
        r = bench_model(model, inputs, sched, steps=steps, name=label)
        q = r.ratio_quartiles
        print(
            f"{name} {label:15s} groups {ngroups:3d} measured {q[1] - 1:+.1%} ({q[0] - 1:+.1%} .. {q[2] - 1:+.1%}) peak {r.wrapped_peak_bytes / 2**20:.1f} pred {sched.predicted_peak_bytes / 2**20:.1f} plain {r.plain_peak_bytes / 2**20:.1f} predicted {sched.predicted_time_s:.3f}",
            flush=True,
        )
    executor.ScheduleExecutor._own_gradients = own
