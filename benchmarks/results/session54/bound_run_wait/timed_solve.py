"""Session 54 probe: a 60-s `solver.solve` with every HiGHS call timed (thread, what it was asked
for, what it took), to see where the minute goes.

    python benchmarks/results/session54/bound_run_wait/timed_solve.py PROBLEM.json BUDGET_BYTES
"""

import sys
import threading
import time

from solver import Problem, solve
from solver.formulation import Formulation

problem = Problem.from_json(sys.argv[1])
budget = int(sys.argv[2])
T0 = time.perf_counter()
orig = Formulation.solve_highs


def wrapped(self, time_limit, *a, **k):
    t = time.perf_counter()
    res = orig(self, time_limit, *a, **k)
    el = time.perf_counter() - t
    tag = "relax" if k.get("relax") else ("fixed" if k.get("fixed") else "full")
    flag = "  OVERRUN" if el > time_limit + 1.0 else ""
    print(
        f"[{t - T0:6.1f} s] {threading.current_thread().name:18s} solve_highs {tag:5s} limit {time_limit:6.1f} took {el:6.1f} (build {res.build_time_s:.1f}, solve {res.solve_time_s:.1f}) {res.status}{flag}",
        flush=True,
    )
    return res


Formulation.solve_highs = wrapped
s = solve(problem, budget, time_limit=60, verbose=True)
print("gap", s.solver.gap)
