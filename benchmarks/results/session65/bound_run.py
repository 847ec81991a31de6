"""HiGHS alone, one thread, 55 s, on a window-6 MILP of the saved kept-1/3 problem: its bound over time.

python benchmarks/results/session65/bound_run.py benchmarks/results/session65/frontier_full/schedules/ plain
... around   # the MILP built around the frontier's plan instead of the window's own
"""

import os
import sys
import time

os.environ["MONET_OPT_HIGHS_LOG"] = "1"

from solver import Problem, Schedule  # noqa: E402
from solver import baselines as B  # noqa: E402
from solver.formulation import Formulation  # noqa: E402

D, which = sys.argv[1], sys.argv[2]
p = Problem.from_json(D + "resnet50_problem.json")
s = Schedule.from_json(D + "resnet50_0.3333.json")
an = B.analysis(p)
plan = B.plan_of(p, s)
if which == "plain":
    f = Formulation(an, s.budget_bytes, window=6)
    warm = f.plan_to_vector(plan) if not f.violations(f.plan_to_vector(plan)) else None
else:
    f = Formulation(an, s.budget_bytes, window=6, warm_plan=plan)
    warm = f.plan_to_vector(plan)
print(which, f.n_cols, f.n_rows, "warm" if warm is not None else "no warm", flush=True)
t = time.perf_counter()
r = f.solve_highs(55, mip_gap=0.01, threads=1, warm=warm, verbose=True)
print(
    which,
    "RESULT",
    r.status,
    r.objective,
    r.dual_bound,
    round(time.perf_counter() - t, 1),
    "plan",
    s.predicted_time_s,
)
