"""Session 50 probe: which of the MILP's implementation choices at budget 1.0 on ResNet-50 b8
224 cost more than predicted? The no-recompute schedule with each family of the MILP's choices
alone, paired with plain PyTorch (`bench_model`), predicted and measured.

    python benchmarks/results/session50/milp_choices_at_1.py [IMAGE [STEPS]] [--calibrate]
"""

import sys

import torch

import solver
from monet_opt.bench import bench_model
from monet_opt.malloc import keep_freed_memory
from monet_opt.profile import build_problem
from monet_opt.runtime import executor
from monet_opt.zoo import ModelSpec
from solver import baselines

keep_freed_memory()
spec = ModelSpec("resnet50", batch=8, image=int(sys.argv[1]) if len(sys.argv) > 1 else 224)
torch.manual_seed(0)
model = spec.build().train()
inputs = spec.example_inputs()
problem = build_problem(model, inputs, progress=False, calibrate="--calibrate" in sys.argv)
milp = solver.solve(problem, 1.0, time_limit=20, verbose=False)
chosen = {
    st.node: st.impl for stg in milp.stages for st in stg.steps if st.op == "compute" and st.impl != "default"
}
fams = sorted(set(chosen.values()))
print("chosen", {f: sum(1 for v in chosen.values() if v == f) for f in fams}, flush=True)
base = baselines.no_recompute(problem)
variants = [("defaults", base, True), ("defaults nested", base, False), ("milp", milp, True)]
for f in fams:
    variants.append((f, baselines.no_recompute(problem, {n: i for n, i in chosen.items() if i == f}), True))
variants.append(("milp impls no_recompute", baselines.no_recompute(problem, chosen), True))
t0 = solver.simulate(problem, base).time_s
for name, s, att in variants:
    executor._ATTACHED = att
    sim = solver.simulate(problem, s)
    r = bench_model(model, inputs, s, steps=int(sys.argv[2]) if len(sys.argv) > 2 else 11, name=name)
    q = r.ratio_quartiles
    print(
        f"{name:28s} predicted {sim.time_s / t0 - 1:+.1%} measured {q[1] - 1:+.1%} ({q[0] - 1:+.1%} .. {q[2] - 1:+.1%}) peak {r.wrapped_peak_bytes / 2**20:.1f} pred {sim.peak_bytes / 2**20:.1f} plain {r.plain_peak_bytes / 2**20:.1f}",
        flush=True,
    )
executor._ATTACHED = True
