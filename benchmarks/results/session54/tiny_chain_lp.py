"""Session 54 probe: the LP relaxation and the optimum of the MILP of a 7-node chain
(conv-bn-relu twice, then a loss; `solver.synthetic.chain(7, seed=1)`, unbounded window), every
nonzero column of each, named by family (k: forward implementation; S: value held when the stage
starts; A: a node's backward state held, by implementation; R: recomputed in the stage, by
implementation). Stages run backwards: 0 the loss, 1 relu5, 2 bn4, 3 conv3, 4 relu2, 5 bn1, 6 conv0.

    python benchmarks/results/session54/tiny_chain_lp.py [FRACTION of the no-recompute peak]
"""

import sys

from solver import simulate, synthetic
from solver.baselines import analysis, no_recompute
from solver.formulation import Formulation

frac = float(sys.argv[1]) if len(sys.argv) > 1 else 0.6
prob = synthetic.chain(7, seed=1)
an = analysis(prob)
sim = simulate(prob, no_recompute(prob))
budget = int(sim.peak_bytes * frac)
f = Formulation(an, budget, window=None)
lp = f.solve_highs(60, relax=True)
ip = Formulation(an, budget, window=None).solve_highs(120, mip_gap=1e-4)
for nd in prob.nodes:
    impls = [(im.name, round(im.fwd_time * 1e6), round(im.bwd_time * 1e6)) for im in nd.impls]
    print(nd.name, nd.output_bytes, "B; implementations (name, forward us, backward us):", impls)
print(f"budget {budget} B of a no-recompute peak of {sim.peak_bytes} B")
print(
    f"LP {lp.objective / sim.time_s:.4f}, optimum {ip.objective / sim.time_s:.4f} ({ip.status}) of the no-recompute time"
)
name = {}
for i, ks in enumerate(f.k):
    for m, c in enumerate(ks):
        name[c] = f"k[{an.names[i]},{m}]"
for fam, grid in (("S", f.S), ("A", f.A), ("R", f.R)):
    for s, cols_of in enumerate(grid):
        for i, cols in cols_of.items():
            for m, c in enumerate(cols if isinstance(cols, list) else [cols]):
                name.setdefault(c, f"{fam}[{s},{an.names[i]}" + ("]" if fam == "S" else f",{m}]"))
for what, x in (("LP", lp.x), ("optimum", ip.x)):
    print(
        f"{what}:",
        " ".join(f"{name[c]}={x[c]:.2f}" for c in range(f.n_cols) if c in name and abs(x[c]) > 1e-3),
    )
