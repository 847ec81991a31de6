"""Session 55: one problem solved with and without states made from inputs (`Impl.bwd_from_inputs`
cleared on every implementation for "without"), 60 s each, the same budget: predicted step
time, proven gap, make_state steps, and the simulator's replay of each.

    python benchmarks/results/session55/with_without.py PROBLEM.json FRACTION [SECONDS]

FRACTION is of the problem's no-recompute peak (the frontier's budgets are of plain PyTorch's
measured peak, ~0.1 % above it on ResNet-50 b8 224).
"""

import dataclasses
import sys

from solver import Problem, simulate, solve
from solver import baselines as B

problem = Problem.from_json(sys.argv[1])
fraction = float(sys.argv[2])
seconds = float(sys.argv[3]) if len(sys.argv) > 3 else 60.0
without = dataclasses.replace(
    problem,
    nodes=tuple(
        dataclasses.replace(n, impls=tuple(dataclasses.replace(i, bwd_from_inputs=False) for i in n.impls))
        for n in problem.nodes
    ),
)
peak = B.no_recompute(problem).predicted_peak_bytes
base = B.no_recompute(problem).predicted_time_s
budget = int(fraction * peak)
print(f"budget {budget / 2**20:.1f} MiB ({fraction} of {peak / 2**20:.1f}); no-recompute {base * 1e3:.0f} ms")
for name, p in (("without", without), ("with", problem)):
    s = solve(p, budget, time_limit=seconds, verbose=False)
    sim = simulate(p, s)
    made = sum(1 for st in s.stages for x in st.steps if x.op == "make_state")
    print(
        f"{name:8s} {s.predicted_time_s * 1e3:7.1f} ms ({s.predicted_time_s / base - 1:+.1%}), "
        f"{s.solver.status}, gap {s.solver.gap:.1%}, {made} make_state, "
        f"replayed peak {sim.peak_bytes / 2**20:.1f} MiB <= budget: {sim.peak_bytes <= budget}",
        flush=True,
    )
