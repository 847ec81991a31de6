"""Session 20: the zero-pack Adam problem at 1/3, re-solved with recompute window 12, with and
without restores (usage: python zp_window12.py WINDOW TIME_LIMIT)."""

import dataclasses
import sys
import time
from pathlib import Path

import solver
from solver.baselines import plan_of
from solver.plan import Analysis, to_schedule, with_restores
from solver.schedule import SolverInfo

D = Path(__file__).resolve().parents[1] / "zero_pack_restores"
p = solver.Problem.from_json(D / "resnet50_adam_zp_refined_problem.json")
s = solver.Schedule.from_json(D / "resnet50_adam_zp_0.3333.json")
an = Analysis(p)
plan = plan_of(p, s)
s2 = to_schedule(an, with_restores(an, plan), "post", SolverInfo("post"), s.budget_bytes)
print("post-pass:", s.predicted_time_s, "->", s2.predicted_time_s, flush=True)
window, limit = int(sys.argv[1]), float(sys.argv[2])
without = dataclasses.replace(p, nodes=tuple(dataclasses.replace(n, restores=()) for n in p.nodes))
for label, q in (("with restores", p), ("without", without)):
    t0 = time.time()
    start = plan if q is p else None
    r = solver.solve(q, s.budget_bytes, time_limit=limit, verbose=False, window=window, start_plan=start)
    n = sum(1 for st in r.stages for x in st.steps if x.impl and x.impl.startswith("restore"))
    print(
        f"{label}, window {window}: {r.predicted_time_s:.4f} s, gap {r.solver.gap}, restores {n}, "
        f"{time.time() - t0:.0f} s",
        flush=True,
    )
