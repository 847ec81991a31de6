"""Session 53 probe: where the window-6 LP relaxation of a 1/3 MILP is tight, and whether knapsack
cover cuts on its memory rows raise its bound.

    python benchmarks/results/session53/lp_covers.py PROBLEM.json SCHEDULE.json [ROUNDS]

Each memory row is written over binaries: a sum column as its terms, a max column as its group with
the largest LP value (the row holds for it too), an in-place column as its first `needs` column
complemented, other continuous columns at the bound that relaxes the row. Then, per row, the cover
with the least slack is sought (items in order of slack per byte, the last one the least slack that
completes the cover), shrunk to a minimal cover, extended by every item at least as heavy as its
heaviest; violated ones are added as rows, and the LP is solved again, for ROUNDS rounds.
"""

import sys
from collections import Counter

import numpy as np

from solver import Problem, Schedule
from solver.baselines import analysis
from solver.formulation import Formulation
from solver.plan import plan_of_schedule

MIB = 2**20

problem = Problem.from_json(sys.argv[1])
schedule = Schedule.from_json(sys.argv[2])
rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 20
an = analysis(problem)
plan = plan_of_schedule(an, schedule)
form = Formulation(an, schedule.budget_bytes, window=6, warm_plan=plan)
md = form.md
warm = form.plan_to_vector(plan)
groups_of = dict(form.aux)
needs_of = {y: needs for y, needs, _blockers in form.in_place}
# (row, its terms with the sum columns written out, its upper bound)
rows = [(r, terms, md.r_hi[r]) for r, terms in zip(form.mem_rows, form.written_out(form.mem_rows))]


def knapsack(terms: dict[int, float], cap: float, x) -> tuple[list[tuple[int, float, bool]], float]:
    """(items (column, bytes, complemented), capacity): a knapsack over binaries the row implies."""
    items: dict[tuple[int, bool], float] = {}
    for c, w in terms.items():
        if abs(w) < 1:
            continue
        if c in groups_of:  # y >= sum(cols) + const for each group; w > 0
            cols, const = max(groups_of[c], key=lambda g: sum(x[cc] for cc in g[0]) + g[1])
            cap -= w * const
            for cc in cols:
                items[(cc, False)] = items.get((cc, False), 0.0) + w
        elif c in needs_of:  # y <= x[need]; w < 0: w y >= w x = w - w (1 - x)
            key = (needs_of[c][0], True)
            items[key] = items.get(key, 0.0) - w
            cap -= w
        elif md.integer[c] and md.lb[c] != md.ub[c]:
            key = (c, w < 0)
            items[key] = items.get(key, 0.0) + abs(w)
            cap += -w if w < 0 else 0.0
        else:  # fixed or continuous: at the bound that relaxes the row
            cap -= w * (md.lb[c] if w > 0 else md.ub[c])
    return [(c, w, comp) for (c, comp), w in items.items()], cap


def separate(x) -> list[tuple[list[tuple[int, float, bool]], int]]:
    cuts = []
    for _r, terms, hi in rows:
        items, cap = knapsack(terms, hi, x)
        if cap < 0:
            continue

        def val(it):
            return 1 - x[it[0]] if it[2] else x[it[0]]

        rest = sorted(items, key=lambda it: (1 - val(it)) / it[1])
        cover, weight = [], 0.0
        while rest:
            if weight + rest[0][1] > cap + 1:
                last = min((it for it in rest if weight + it[1] > cap + 1), key=lambda it: 1 - val(it))
                cover.append(last)
                weight += last[1]
                break
            weight += rest[0][1]
            cover.append(rest.pop(0))
        if weight <= cap + 1 or sum(1 - val(it) for it in cover) >= 1 - 1e-3:
            continue
        cover.sort(key=val)
        k = 0
        while k < len(cover):  # minimal: drop what the cover does not need
            if weight - cover[k][1] > cap + 1:
                weight -= cover.pop(k)[1]
            else:
                k += 1
        heaviest = max(it[1] for it in cover)
        inside = {(c, comp) for c, _w, comp in cover}
        cut = cover + [it for it in items if (it[0], it[2]) not in inside and it[1] >= heaviest]
        if sum(val(it) for it in cut) > len(cover) - 1 + 1e-3:
            cuts.append((cut, len(cover) - 1))
    return cuts


lp = form.solve_highs(120, relax=True)
x = lp.x
act = form.matrix() @ x
tight = [r for r in form.mem_rows if md.r_hi[r] - act[r] < 1e-3 * MIB]
print(f"LP relaxation {lp.objective:.4f}, plan {form.objective(warm):.4f}")
print(
    f"memory rows at their bound: {len(tight)} of {len(form.mem_rows)}",
    dict(Counter(md.r_tag[r][0] for r in tight)),
)
frac_s0 = sum(1 for c in form.S[0].values() if 0.02 < x[c] < 0.98)
frac_r = sum(1 for Rs in form.R for cols in Rs.values() if 0.02 < sum(x[c] for c in cols) < 0.98)
whole_r = sum(1 for Rs in form.R for cols in Rs.values() if sum(x[c] for c in cols) >= 0.98)
print(f"fractional: S[0] {frac_s0} of {len(form.S[0])}; recomputations {frac_r} fractional, {whole_r} whole")
for rnd in range(rounds):
    cuts = separate(x)
    print(f"round {rnd}: LP {lp.objective:.4f}, {len(cuts)} violated covers", flush=True)
    if not cuts:
        break
    for cut, k in cuts:
        coefs: dict[int, float] = {}
        rhs = float(k)
        for c, _w, comp in cut:
            coefs[c] = coefs.get(c, 0.0) + (-1.0 if comp else 1.0)
            rhs -= 1.0 if comp else 0.0
        md.row(list(coefs), list(coefs.values()), -np.inf, rhs)
    form.n_rows = len(md.r_lo)
    assert not form.violations(warm), "a cut removed the plan"
    lp = form.solve_highs(120, relax=True)
    x = lp.x
print(f"LP relaxation with the covers: {lp.objective:.4f}")
