"""Each RINS start's first round alone, timed (session 68): which start leads where, and when.

python benchmarks/results/session68/start_rounds.py PROBLEM.json 0.33 ROUND_SECONDS [START]
(MONET_OPT_HIGHS_LOG=1 with START shows that round's HiGHS log)
"""

import sys
import time

from solver import Problem
from solver import baselines as B
from solver.formulation import Formulation
from solver.local_search import relaxation, rins

p = Problem.from_json(sys.argv[1])
peak0 = B.no_recompute(p).predicted_peak_bytes
budget = int(float(sys.argv[2]) * peak0)
seconds = float(sys.argv[3])
only = int(sys.argv[4]) if len(sys.argv) > 4 else None  # only this start (0-based), HiGHS' log shown
_solve = Formulation.solve_milp


def _logged(self, time_limit, **kw):
    if only is not None and not kw.get("relax"):
        kw["verbose"] = True
    return _solve(self, time_limit, **kw)


Formulation.solve_milp = _logged
an = B.analysis(p)
t = time.perf_counter()
fits = B.fitting_baselines(p, budget, greedy_time=9.0)
print(
    f"baselines {time.perf_counter() - t:.1f} s:", [(s.strategy, round(s.predicted_time_s, 4)) for s in fits]
)
for k, s in enumerate(fits):
    if only is not None and k != only:
        continue
    plan = B.plan_of(p, s)
    if plan is None:
        continue
    form = Formulation(an, budget, window=6, warm_plan=plan)
    if form.violations(form.plan_to_vector(plan)):
        print(s.strategy, "rejected by the window-6 rows")
        continue
    lp = relaxation(form, 20.0, 2, True)
    if lp is None:
        continue
    found = []
    t = time.perf_counter()

    def accept(plan, obj, found=found, t=t):
        found.append((round(time.perf_counter() - t, 1), round(obj, 4)))
        return True

    rins(form, plan, time.perf_counter() + seconds, 2, True, accept, rounds=1, lp=lp)
    print("START", s.strategy, round(s.predicted_time_s, 4), form.n_cols, "->", found)
