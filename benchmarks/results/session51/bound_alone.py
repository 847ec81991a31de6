"""Session 51 probe: HiGHS' 60-s bound on the window-6 MILP built around a plan, alone (both
threads, the plan as its incumbent), with the memory rows as built ("plain") or with each memory
row also written out over the binaries its sum columns stand for ("expand": the same LP, rows a
knapsack cover separator can read).

    python benchmarks/results/session51/bound_alone.py PROBLEM.json SCHEDULE.json plain|expand
"""

import sys
import time

from solver import Problem, Schedule
from solver.baselines import analysis
from solver.formulation import Formulation
from solver.plan import plan_of_schedule

problem = Problem.from_json(sys.argv[1])
schedule = Schedule.from_json(sys.argv[2])
mode = sys.argv[3]
an = analysis(problem)
plan = plan_of_schedule(an, schedule)
form = Formulation(an, schedule.budget_bytes, window=6, warm_plan=plan)
md = form.md
if mode == "expand":
    nonzeros = 0
    for r, terms in zip(form.mem_rows, form.written_out(form.mem_rows)):
        md.row(list(terms), list(terms.values()), md.r_lo[r], md.r_hi[r])
        nonzeros += len(terms)
    form.n_rows = len(md.r_lo)
    print(f"added {len(form.mem_rows)} rows, {nonzeros} nonzeros")
warm = form.plan_to_vector(plan)
assert not form.violations(warm)
t0 = time.perf_counter()
lp = form.solve_highs(60, relax=True)
print(f"LP relaxation {lp.objective:.4f} in {time.perf_counter() - t0:.1f} s")
res = form.solve_highs(60, warm=warm)
print(f"{mode}: {res.status}, plan {res.objective:.4f}, bound {res.dual_bound:.4f}, gap {res.gap:.2%}")
