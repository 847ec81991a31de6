"""Peak of a schedule that keeps nothing from the forward and recomputes each backward stage's
state from the model's input (session 76: does keeping nothing lower the kept problem's peak?).

python benchmarks/results/session76/recompute_from_scratch.py PROBLEM.json
"""

import sys

from solver import Problem, simulate
from solver import baselines as B
from solver.plan import lazy_plan, to_schedule
from solver.schedule import SolverInfo

p = Problem.from_json(sys.argv[1])
an = B.analysis(p)
base = B.no_recompute(p)
# per node the implementation whose state holds the fewest bytes (then the fastest backward)
impl = [
    min(
        range(an.nimp[i]),
        key=lambda m, i=i: (
            an.impls[i][m].state_bytes + sum(an.a[b] for b in an.kept_bases[i][m]),
            an.impls[i][m].bwd_time,
        ),
    )
    for i in range(an.n)
]
# every node the end of a segment that keeps nothing: each stage recomputes from the input
plan = lazy_plan(an, impl, set(), set(), split=frozenset(range(an.n)))
sched = to_schedule(an, plan, "recompute_from_scratch", SolverInfo(name="lazy_plan", status="ok"))
sim = simulate(p, sched)
print(
    f"peak {sim.peak_bytes / 2**20:.1f} MiB ({sim.peak_bytes / base.predicted_peak_bytes:.3f} of no "
    f"recompute's), step {sim.time_s:.2f} s (no recompute {base.predicted_time_s:.2f} s)"
)
for k in sorted(range(1, len(sim.stage_peaks)), key=lambda k: -sim.stage_peaks[k])[:5]:
    s = k - 1  # (stage_peaks[0] is the forward's)
    print(
        f"  stage {s} ({an.names[an.bw[s]]}): {sim.stage_peaks[k] / 2**20:.1f} MiB, of it "
        f"{an.stage_const[s] / 2**20:.1f} MiB gradients and fixed bytes"
    )
