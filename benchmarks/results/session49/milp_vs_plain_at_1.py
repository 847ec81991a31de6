"""Session 49 probe: ResNet-50 b8 224 at budget 1.0, the MILP's schedule (gradient-writing
implementations: through the wrapper's backward) against the default no-recompute schedule
(runs in the caller's graph), each paired with plain PyTorch (`bench_model`), twice in turn.

    python benchmarks/results/session49/milp_vs_plain_at_1.py [--calibrate]  # output: milp_vs_plain_at_1.txt
"""

import sys

import torch

import solver
from monet_opt.bench import bench_model
from monet_opt.malloc import keep_freed_memory
from monet_opt.profile import build_problem
from monet_opt.zoo import ModelSpec
from solver import baselines

keep_freed_memory()
spec = ModelSpec("resnet50", batch=8, image=224)
torch.manual_seed(0)
model = spec.build().train()
inputs = spec.example_inputs()
problem = build_problem(model, inputs, progress=False, calibrate="--calibrate" in sys.argv)
milp = solver.solve(problem, 1.0, time_limit=20, verbose=False)
writers = sorted({im.name for n in problem.nodes for im in n.impls if im.grad_in_place is not None})
chosen = sorted(
    {st.impl for stg in milp.stages for st in stg.steps if st.op == "compute" and st.impl != "default"}
)
print(
    "calibrated:",
    "--calibrate" in sys.argv,
    "chosen:",
    chosen,
    "gradient writers among them:",
    sorted(set(chosen) & set(writers)),
)
defaults = baselines.no_recompute(problem)
print("predicted s: milp", milp.predicted_time_s, "defaults", solver.simulate(problem, defaults).time_s)
runs = (("milp 1.0", milp), ("no_recompute default", defaults)) * 2
for name, s in runs:
    r = bench_model(model, inputs, s, steps=11, name=name)
    q = r.ratio_quartiles
    print(
        f"{name}: {q[1] - 1:+.1%} ({q[0] - 1:+.1%} .. {q[2] - 1:+.1%}); peak {r.wrapped_peak_bytes / 2**20:.1f} "
        f"MiB, plain {r.plain_peak_bytes / 2**20:.1f}",
        flush=True,
    )
