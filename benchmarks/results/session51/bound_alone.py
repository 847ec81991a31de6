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
    A = form.matrix().tocsr()
    sums = {y: dict(zip(cols, coefs)) for y, cols, coefs, _ in form.sums}
    memo: dict[int, dict[int, float]] = {}

    def expand(y: int) -> dict[int, float]:
        if y not in memo:
            out: dict[int, float] = {}
            for c, v in sums[y].items():
                for c2, v2 in (expand(c) if c in sums else {c: 1.0}).items():
                    out[c2] = out.get(c2, 0.0) + v * v2
            memo[y] = out
        return memo[y]

    nonzeros = 0
    for r in form.mem_rows:
        row = A.getrow(r)
        terms: dict[int, float] = {}
        for c, v in zip(row.indices, row.data):
            for c2, v2 in (expand(c) if c in sums else {c: 1.0}).items():
                terms[c2] = terms.get(c2, 0.0) + v * v2
        terms = {c: v for c, v in terms.items() if abs(v) > 1e-9}
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
