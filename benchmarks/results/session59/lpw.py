"""Session 59 probe: the LP relaxation's bound of the time MILP at several recompute windows.

python benchmarks/results/session59/lpw.py PROBLEM.json SCHEDULE.json 6,12,24,None SECONDS
(the schedule gives the budget)
"""

import sys
import time

from solver.formulation import Formulation
from solver.plan import Analysis
from solver.problem import Problem
from solver.schedule import Schedule


def main() -> None:
    problem = Problem.from_json(sys.argv[1])
    budget = Schedule.from_json(sys.argv[2]).budget_bytes
    an = Analysis(problem)
    for w in [None if x == "None" else int(x) for x in sys.argv[3].split(",")]:
        t0 = time.perf_counter()
        f = Formulation(an, budget, window=w)
        built = time.perf_counter() - t0
        r = f.solve_milp(float(sys.argv[4]), relax=True, threads=2)
        print(
            f"window {w}: {f.n_cols} cols {f.n_rows} rows, build {built:.1f} s; LP {r.status} "
            f"{r.objective} in {r.solve_time_s:.1f} s; trivial {f.trivial_time_bound():.4f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
