"""Session 51 probe: where a 1/3 schedule's step time goes beyond its prediction, ResNet-50 b8 224.

    python benchmarks/results/session51/where_the_third_goes.py PROBLEM.json SCHEDULE.json [ROUNDS]

PROBLEM is the (calibrated) problem SCHEDULE was solved on. Three parts, freed memory kept:
1. `bench.measure_parts` (forward / recompute / backward, measured / predicted) of the
   no-recompute schedule, the no-recompute schedule with SCHEDULE's implementations, and
   SCHEDULE, two rounds;
2. torch's profiler over 3 steps of the latter two: the ops whose self time differs most
   (aten kernels, and the Python autograd Functions' own time: `_ScheduledStep[Backward]` is the
   wrapper's forward / backward, executor included);
3. the runtime's cost per recomputation on this model: the no-recompute schedule paired with
   `checkpoint_all` (every node recomputed in a stage of its own) and with `chen_sqrt`
   (segments), ROUNDS rounds; the measured difference beyond the predicted one (which already
   charges the problem's `recompute_overhead_s` per recomputation), per recomputation.
"""

import statistics
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from monet_opt.bench import interleaved_samples, measure_parts, predicted_parts, training_step, zero_grad
from monet_opt.malloc import keep_freed_memory
from monet_opt.runtime import MonetWrapper
from monet_opt.zoo import ModelSpec
from solver import Problem, Schedule, baselines, simulate

keep_freed_memory()
problem = Problem.from_json(sys.argv[1])
schedule = Schedule.from_json(sys.argv[2])
rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 7
spec = ModelSpec("resnet50", batch=8, image=224)
torch.manual_seed(0)
model = spec.build().train()
inputs = spec.example_inputs()
impls = {st.node: st.impl for st in schedule.stages[0].steps if st.op == "compute"}
variants = {
    "no_recompute defaults": baselines.no_recompute(problem),
    "no_recompute, schedule's impls": baselines.no_recompute(problem, impls),
    "schedule": schedule,
}
wrapped = {name: MonetWrapper(model, s, example_inputs=inputs) for name, s in variants.items()}

print("## 1. parts, ms measured / predicted", flush=True)
for _ in range(2):
    for name, w in wrapped.items():
        m, q = measure_parts(w, inputs, steps=3), predicted_parts(problem, variants[name])
        print(
            f"{name:32s} groups {len(w.executor.groups):3d}"
            f" forward {m.forward_s * 1e3:6.1f} / {q.forward_s * 1e3:6.1f}"
            f" recompute {m.recompute_s * 1e3:6.1f} / {q.recompute_s * 1e3:6.1f}"
            f" backward {m.backward_s * 1e3:6.1f} / {q.backward_s * 1e3:6.1f}"
            f" step {m.step_s * 1e3:6.1f} / {q.step_s * 1e3:6.1f}",
            flush=True,
        )

print("\n## 2. torch profiler, self ms per step (calls)", flush=True)
selfs = {}
for name in ("no_recompute, schedule's impls", "schedule"):
    w = wrapped[name]
    for _ in range(2):
        zero_grad(w)
        training_step(w, inputs)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        for _ in range(3):
            zero_grad(w)
            training_step(w, inputs)
        wall = (time.perf_counter() - t0) / 3
    selfs[name] = {e.key: (e.self_cpu_time_total / 3e3, e.count / 3) for e in prof.key_averages()}
    print(f"{name}: wall {wall * 1e3:.1f} ms per step", flush=True)
a, b = selfs["no_recompute, schedule's impls"], selfs["schedule"]
for key in sorted(set(a) | set(b), key=lambda k: -abs(b.get(k, (0, 0))[0] - a.get(k, (0, 0))[0]))[:20]:
    x, y = a.get(key, (0.0, 0)), b.get(key, (0.0, 0))
    print(
        f"{key[:40]:40s} no-recompute {x[0]:7.1f} ({x[1]:4.0f})  schedule {y[0]:7.1f} ({y[1]:4.0f})  {y[0] - x[0]:+7.1f}"
    )

print(f"\n## 3. cost per recomputation on this model ({rounds} paired rounds)", flush=True)
plain = variants["no_recompute defaults"]
for strategy in ("checkpoint_all", "chen_sqrt"):
    every = getattr(baselines, strategy)(problem)
    count = sum(1 for st in every.stages[1:] for s in st.steps if s.op == "compute")
    ta, tb = interleaved_samples(
        wrapped["no_recompute defaults"], MonetWrapper(model, every, example_inputs=inputs), inputs, rounds
    )
    measured = statistics.median(y - x for x, y in zip(ta, tb))
    predicted = simulate(problem, every).time_s - simulate(problem, plain).time_s
    print(
        f"{strategy}: {count} recomputations, measured +{measured * 1e3:.1f} ms, predicted +{predicted * 1e3:.1f} ms"
        f" (charging {problem.recompute_overhead_s * 1e3:.3f} ms each): "
        f"{(measured - predicted) / count * 1e3:+.3f} ms per recomputation beyond the prediction",
        flush=True,
    )
