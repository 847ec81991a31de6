"""Session 53 probe: HiGHS alone on the window-6 MILP built around a plan, from the plan, both
threads, with the bound run's options, for SECONDS (HiGHS' own log: MONET_OPT_HIGHS_LOG=1).

    MONET_OPT_HIGHS_LOG=1 python benchmarks/results/session53/highs_alone.py PROBLEM.json SCHEDULE.json SECONDS

(`highs_alone_300s.log`: session 51's calibrated problem and 1/3 schedule, 1200 s asked, stopped
by hand at 325 s; HiGHS' objective is in its scaled units: 32768 per second.)
"""

import sys

from solver import Problem, Schedule
from solver.baselines import analysis
from solver.formulation import Formulation
from solver.local_search import BOUND_OPTIONS
from solver.plan import plan_of_schedule

problem = Problem.from_json(sys.argv[1])
schedule = Schedule.from_json(sys.argv[2])
an = analysis(problem)
plan = plan_of_schedule(an, schedule)
form = Formulation(an, schedule.budget_bytes, window=6, warm_plan=plan)
warm = form.plan_to_vector(plan)
print("cols", form.n_cols, "rows", form.n_rows, "plan", form.objective(warm), flush=True)
res = form.solve_highs(float(sys.argv[3]), warm=warm, threads=2, verbose=True, options=BOUND_OPTIONS)
print(f"{res.status} plan {res.objective:.4f} bound {res.dual_bound:.4f} gap {res.gap:.2%}", flush=True)
