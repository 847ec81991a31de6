"""One verbose solve of a problem file at a fraction of its no-recompute peak (session 67).

python benchmarks/results/session67/one_solve.py PROBLEM.json 0.33 [TIME_LIMIT]
"""

import sys

from solver import Problem, simulate, solve
from solver import baselines as B

p = Problem.from_json(sys.argv[1])
peak0 = B.no_recompute(p).predicted_peak_bytes
t0 = B.no_recompute(p).predicted_time_s
budget = int(float(sys.argv[2]) * peak0)
tl = float(sys.argv[3]) if len(sys.argv) > 3 else 60
s = solve(p, budget, time_limit=tl, verbose=True)
sim = simulate(p, s)
print(
    "RESULT",
    sys.argv[2],
    s.solver.status,
    round(sim.time_s / t0, 4),
    s.solver.gap,
    sim.peak_bytes / budget,
    s.meta.get("milp_window"),
)
