"""Where the LP relaxation's time goes, against the trivial bound (session 72).

ResNet-50 b8 224, kept gradients, 0.33 of the no-recompute peak, the window-6 MILP (the early
run's own): its LP optimum split into forward (k columns), backward (A columns) and recompute (R
columns) seconds, and how fractional its storage and state columns are.

python benchmarks/results/session72/lp_anatomy.py [FRACTION]
"""

import sys

import numpy as np

from solver import Problem
from solver import baselines as B
from solver.formulation import Formulation
from solver.local_search import relaxation
from solver.plan import Analysis

p = Problem.from_json("benchmarks/results/session65/frontier_full/schedules/resnet50_problem.json")
fraction = float(sys.argv[1]) if len(sys.argv) > 1 else 0.33
nr = B.no_recompute(p)
an = Analysis(p)
form = Formulation(an, int(fraction * nr.predicted_peak_bytes), window=6)
lp = relaxation(form, 60, 2, False)
x = lp.x
cost = np.asarray(form.md.cost)
k_cols = [c for row in form.k for c in row]
a_cols = sorted({c for As in form.A for cols in As.values() for c in cols})
r_cols = sorted({c for Rs in form.R for cols in Rs.values() for c in cols})
# t's own recomputation in its stage (its state made again: R[s, t]), apart from its ancestors'
r_own = sorted({c for s, Rs in enumerate(form.R) for i, cols in Rs.items() if i == an.bw[s] for c in cols})
r_anc = sorted(set(r_cols) - set(r_own))
s_cols = sorted({c for Ss in form.S for c in Ss.values()})


def part(cols):
    cols = np.asarray(cols, dtype=int)
    return float(cost[cols] @ x[cols])


print(
    f"no recompute {nr.predicted_time_s:.4f} s, trivial bound {form.trivial_bound(an):.4f} s, LP {lp.objective:.4f} s"
)
print(f"LP: forward {part(k_cols):.4f}, backward {part(a_cols):.4f}, recompute {part(r_cols):.4f} s")
print(f"LP recompute: of the stage's own node {part(r_own):.4f} s, of its ancestors {part(r_anc):.4f} s")
print(
    f"LP: {float(x[np.asarray(r_cols)].sum()):.1f} recomputations in all (sum of R), {float(x[np.asarray(r_anc)].sum()):.1f} of ancestors"
)
for name, cols in (("S", s_cols), ("A", a_cols), ("R", r_cols)):
    v = x[np.asarray(cols)]
    frac = v[(v > 1e-6) & (v < 1 - 1e-6)]
    print(
        f"{name}: {len(cols)} columns, {int((v > 1 - 1e-6).sum())} at 1, {len(frac)} fractional (median {np.median(frac) if len(frac) else 0:.2f})"
    )
s0 = x[np.asarray([form.S[0][i] for i in range(an.n)])]
print(
    f"S[0] (held after the forward): {int((s0 > 1 - 1e-6).sum())} at 1, {int(((s0 > 1e-6) & (s0 < 1 - 1e-6)).sum())} fractional, {int((s0 <= 1e-6).sum())} at 0 of {an.n}"
)
