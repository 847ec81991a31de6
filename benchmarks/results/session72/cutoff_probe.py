"""HiGHS on ResNet-50 kept 0.33's window-6 MILP (the early run's own MILP) for its bound, with and
without a known plan's time as its objective cutoff (`objective_bound`: what an incumbent would
give it for pruning and reduced-cost fixing). Session 72.

python benchmarks/results/session72/cutoff_probe.py SECONDS [CUTOFF_S]
"""

import sys
import time

from solver import Problem
from solver import baselines as B
from solver.formulation import Formulation
from solver.local_search import BOUND_OPTIONS
from solver.plan import Analysis

p = Problem.from_json("benchmarks/results/session65/frontier_full/schedules/resnet50_problem.json")
budget = int(0.33 * B.no_recompute(p).predicted_peak_bytes)
form = Formulation(Analysis(p), budget, window=6)
options = dict(BOUND_OPTIONS)
if len(sys.argv) > 2:
    factor = form.scaled_model(None)[0].cost_factor
    options["objective_bound"] = float(sys.argv[2]) * factor * (1 + 1e-6)
t0 = time.perf_counter()
res = form.solve_highs(float(sys.argv[1]), mip_gap=0.01, threads=1, options=options, verbose=False)
print(
    "RESULT cutoff",
    sys.argv[2:] or "none",
    res.status,
    "bound",
    res.dual_bound,
    "in",
    round(time.perf_counter() - t0, 1),
    "s",
)
