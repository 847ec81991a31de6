"""Session 55 probe (before the change): what if a convolution recomputed in its own backward stage
cost only its backward (its state made from its recomputed input, no forward)? Its memory rows
unchanged (its output still counted). HiGHS alone on the window-6 MILP around SCHEDULE, both
threads, MODE "base" (as is) or "free" (those columns' forward time taken off).

    python benchmarks/results/session55/own_stage_probe.py PROBLEM.json SCHEDULE.json SECONDS base|free

Output (session 53's calibrated Adam problem and its 1/3 schedule, 60 s):
    base: optimal plan 0.9347 bound 0.9267 gap 0.85%
    free: optimal plan 0.8971 bound 0.8933 gap 0.42%  (106 columns discounted; 30 convolutions
          recomputed in their own stage)
"""

import sys

from solver import Problem, Schedule
from solver.baselines import analysis
from solver.formulation import Formulation
from solver.local_search import BOUND_OPTIONS
from solver.plan import plan_of_schedule

problem = Problem.from_json(sys.argv[1])
schedule = Schedule.from_json(sys.argv[2])
secs = float(sys.argv[3])
mode = sys.argv[4]
an = analysis(problem)
plan = plan_of_schedule(an, schedule)
form = Formulation(an, schedule.budget_bytes, window=6, warm_plan=plan)
if mode == "free":
    names = [nd.name for nd in problem.nodes]
    n = 0
    for s, t in enumerate(an.bw):
        nm = names[t]
        if ("conv" in nm or "downsample_0" in nm) and t in form.R[s]:
            for m in range(an.nimp[t]):
                col = form.R[s][t][m]
                form.md.cost[col] = an.impls[t][m].bwd_time + problem.recompute_overhead_s
                n += 1
    print("discounted", n, "columns")
warm = form.plan_to_vector(plan)
print("cols", form.n_cols, "rows", form.n_rows, "plan", form.objective(warm), flush=True)
res = form.solve_highs(secs, warm=warm, threads=2, verbose=False, options=BOUND_OPTIONS)
print(
    f"{mode}: {res.status} plan {res.objective:.4f} bound {res.dual_bound:.4f} gap {res.gap:.2%}", flush=True
)
if res.x is not None:
    x = res.x
    for s, t in enumerate(an.bw):
        if t in form.R[s]:
            v = sum(x[c] for c in form.R[s][t][: an.nimp[t]])
            if v > 0.5 and ("conv" in problem.nodes[t].name or "downsample_0" in problem.nodes[t].name):
                print("  own-stage recompute of", problem.nodes[t].name)
