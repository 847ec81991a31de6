"""Smallest peak the MILP finds for a problem, in a given time (session 72: is kept 0.25 feasible?).

python benchmarks/results/session72/min_peak.py PROBLEM.json SECONDS
"""

import sys

from solver import Problem, simulate
from solver import baselines as B
from solver.bounds import min_feasible_lower_bound
from solver.milp import minimum_peak

p = Problem.from_json(sys.argv[1])
peak0 = B.no_recompute(p).predicted_peak_bytes
s = minimum_peak(p, time_limit=float(sys.argv[2]), verbose=True)
sim = simulate(p, s)
print(
    "RESULT min_peak",
    sys.argv[2],
    "s: peak",
    round(sim.peak_bytes / peak0, 4),
    "of no recompute's, time",
    round(sim.time_s / B.no_recompute(p).predicted_time_s, 4),
    "lower bound",
    round(min_feasible_lower_bound(p) / peak0, 4),
)
