"""Session 51 probe: where the window-6 MILP's LP relaxation undercuts a plan (the 1/3 schedule of
ResNet-50 b8 224): recomputation time, forward time, fractional keeps, the nodes whose
recomputation the LP pays least for.

    python benchmarks/results/session51/lp_vs_plan.py PROBLEM.json SCHEDULE.json
"""

import sys

from solver import Problem, Schedule
from solver.baselines import analysis
from solver.formulation import Formulation
from solver.plan import plan_of_schedule

problem = Problem.from_json(sys.argv[1])
schedule = Schedule.from_json(sys.argv[2])
an = analysis(problem)
plan = plan_of_schedule(an, schedule)
form = Formulation(an, schedule.budget_bytes, window=6, warm_plan=plan)
lp = form.solve_highs(60, relax=True).x
xp = form.plan_to_vector(plan)
names = [nd.name for nd in problem.nodes]


def recompute(v):
    """(seconds of recomputation, {node: seconds}) of a solution vector."""
    per: dict[int, float] = {}
    for Rs in form.R:
        for i, cols in Rs.items():
            for m, c in enumerate(cols[: len(an.impls[i])]):
                if v[c] > 1e-9:
                    per[i] = per.get(i, 0.0) + v[c] * an.recompute_time(i, m)
    return sum(per.values()), per


def forward(v):
    return sum(v[form.k[i][m]] * im.fwd_time for i in range(an.n) for m, im in enumerate(an.impls[i]))


(rl, pl), (rp, pp) = recompute(lp), recompute(xp)
print(f"objective: LP relaxation {form.objective(lp):.4f} s, plan {form.objective(xp):.4f} s")
print(f"recomputation: LP {rl * 1e3:.1f} ms, plan {rp * 1e3:.1f} ms")
print(f"forward: LP {forward(lp) * 1e3:.1f} ms, plan {forward(xp) * 1e3:.1f} ms")
S0 = form.S[0]
print(
    f"kept after the forward (S0) fractional in the LP: {sum(1 for c in S0.values() if 0.02 < lp[c] < 0.98)} of {len(S0)}"
)
diff = sorted(((pp.get(i, 0.0) - pl.get(i, 0.0)) * 1e3, names[i]) for i in set(pl) | set(pp))
print(
    "recomputed more by the plan than by the LP (ms):",
    ", ".join(f"{n} {d:.1f}" for d, n in reversed(diff[-12:])),
)
