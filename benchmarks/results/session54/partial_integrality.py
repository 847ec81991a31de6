"""Session 54 probe: a bound from partial integrality. The window-6 MILP around a schedule's plan
with only some column families integer (S0: what the forward keeps; S: every held flag; k: the
forward's implementation choice), the rest continuous: a relaxation of the MILP, so its bound
bounds the MILP's.

    python benchmarks/results/session54/partial_integrality.py PROBLEM.json SCHEDULE.json S0|S|k SECONDS
"""

import sys
import time

from solver import Problem, Schedule
from solver.baselines import analysis
from solver.formulation import Formulation
from solver.plan import plan_of_schedule

problem = Problem.from_json(sys.argv[1])
schedule = Schedule.from_json(sys.argv[2])
which = sys.argv[3]
limit = float(sys.argv[4])
an = analysis(problem)
plan = plan_of_schedule(an, schedule)
form = Formulation(an, schedule.budget_bytes, window=6, warm_plan=plan)
md = form.md
warm = form.plan_to_vector(plan)
keep = set()
if "S0" in which:
    keep |= set(form.S[0].values())
if "k" in which:
    keep |= {c for ks in form.k for c in ks}
if "S" in which.replace("S0", ""):
    keep |= {c for Ss in form.S for c in Ss.values()}
n_int0 = sum(md.integer)
for c in range(len(md.integer)):
    if md.integer[c] and c not in keep:
        md.integer[c] = False
print(
    which, "integer cols", sum(md.integer), "of", n_int0, "plan", round(form.objective(warm), 4), flush=True
)
t = time.time()
res = form.solve_highs(limit, warm=None, threads=2, mip_gap=0.0001)
print(
    f"{which}: {res.status} obj {res.objective} bound {res.dual_bound:.4f} in {time.time() - t:.1f} s",
    flush=True,
)
