"""Solve a problem file at a fraction of its no-recompute peak twice, the second solve starting
from the first's plan (what `monet-opt solve` does since session 67: `monet_opt.fastest_found`).

python benchmarks/results/session67/solve_twice.py PROBLEM.json 0.33 [TIME_LIMIT] [--resume]

--resume: the second solve is told its start is the first's result (`solve(..., resume=True)`).
"""

import sys

from solver import Problem, simulate, solve
from solver import baselines as B

p = Problem.from_json(sys.argv[1])
peak0 = B.no_recompute(p).predicted_peak_bytes
t0 = B.no_recompute(p).predicted_time_s
budget = int(float(sys.argv[2]) * peak0)
args = [a for a in sys.argv[1:] if a != "--resume"]
tl = float(args[2]) if len(args) > 2 else 60
start = None
for k in (1, 2):
    s = solve(
        p, budget, time_limit=tl, verbose=True, start_plan=start, resume=k == 2 and "--resume" in sys.argv
    )
    sim = simulate(p, s)
    print(
        f"RESULT solve {k}: {s.solver.status}, {sim.time_s:.4f} s ({sim.time_s / t0:.4f} of no recompute), "
        f"gap {s.solver.gap}, peak/budget {sim.peak_bytes / budget:.4f}, {s.solver.solve_time_s:.1f} s",
        flush=True,
    )
    start = B.plan_of(p, s)
