"""One verbose solve with solver constants overridden (session 68 A/B runs).

python benchmarks/results/session68/ab_solve.py PROBLEM.json 0.33 60 [module.NAME=value ...]
e.g. local_search.RINS_STARTS=2 milp.EARLY_MIN_S=5
"""

import importlib
import sys

from solver import Problem, simulate, solve
from solver import baselines as B

p = Problem.from_json(sys.argv[1])
for setting in sys.argv[4:]:
    target, value = setting.split("=")
    module, name = target.rsplit(".", 1)
    mod = importlib.import_module(f"solver.{module}")
    old = getattr(mod, name)
    setattr(mod, name, type(old)(value))
peak0 = B.no_recompute(p).predicted_peak_bytes
t0 = B.no_recompute(p).predicted_time_s
budget = int(float(sys.argv[2]) * peak0)
s = solve(p, budget, time_limit=float(sys.argv[3]), verbose=True)
sim = simulate(p, s)
print(
    "RESULT",
    " ".join(sys.argv[4:]) or "default",
    sys.argv[2],
    s.solver.status,
    round(sim.time_s, 4),
    s.solver.gap,
    round(sim.peak_bytes / budget, 4),
)
