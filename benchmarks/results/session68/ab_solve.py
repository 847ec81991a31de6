"""One verbose solve with solver constants overridden (session 68-72 A/B runs; dict and list
constants take JSON values since session 72: local_search.BOUND_OPTIONS='{"mip_heuristic_effort": 0}').

python benchmarks/results/session68/ab_solve.py PROBLEM.json 0.33 60 [module.NAME=value ...]
e.g. local_search.RINS_STARTS=2 milp.EARLY_MIN_S=5 baselines.REFINE_EVALS=200
"""

import importlib
import json
import sys

from solver import Problem, simulate, solve
from solver import baselines as B

p = Problem.from_json(sys.argv[1])
for setting in sys.argv[4:]:
    target, value = setting.split("=", 1)
    module, name = target.rsplit(".", 1)
    mod = importlib.import_module(f"solver.{module}")
    old = getattr(mod, name)
    if isinstance(old, bool):
        new = value in ("1", "True", "true")
    elif isinstance(old, (dict, list)):
        new = json.loads(value)
    else:
        new = type(old)(value)
    setattr(mod, name, new)
    if name == "REFINE_EVALS":  # (bound as multilevel_starts' max_evals default at definition)
        defaults = list(B.multilevel_starts.__defaults__)
        defaults[-1] = new
        B.multilevel_starts.__defaults__ = tuple(defaults)
peak0 = B.no_recompute(p).predicted_peak_bytes
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
