"""Session 52 probe: HiGHS' bound on the window-6 MILP built around a plan, alone, with extra
HiGHS options (JSON), from the plan as its incumbent.

    python benchmarks/results/session52/bound_options.py SECONDS THREADS '{"mip_pscost_minreliable": 0}' [SCHEDULE.json]

(problem: session 51's calibrated ResNet-50 b8 224 problem; schedule: session 51's 1/3 one)
"""

import json
import sys
import time

from solver import Problem, Schedule
from solver.baselines import analysis
from solver.formulation import Formulation
from solver.plan import plan_of_schedule

p = Problem.from_json("benchmarks/results/session51/problem_resnet50_b8_i224_calibrated.json")
s = Schedule.from_json(
    sys.argv[4] if len(sys.argv) > 4 else "benchmarks/results/session51/resnet50_b8_i224_0.33.json"
)
an = analysis(p)
plan = plan_of_schedule(an, s)
form = Formulation(an, s.budget_bytes, window=6, warm_plan=plan)
w = form.plan_to_vector(plan)
t0 = time.perf_counter()
res = form.solve_highs(float(sys.argv[1]), threads=int(sys.argv[2]), warm=w, options=json.loads(sys.argv[3]))
gap = (res.objective - res.dual_bound) / res.objective
print(
    sys.argv[3],
    "threads",
    sys.argv[2],
    res.status,
    round(res.objective, 4),
    "bound",
    round(res.dual_bound, 4),
    f"gap {gap:.2%}",
    f"{time.perf_counter() - t0:.1f}s",
)
