"""LP relaxation against the optimum on small chains (unbounded window)."""

import dataclasses
import time

from solver import simulate, synthetic
from solver.baselines import analysis, no_recompute
from solver.formulation import Formulation

for single in (True, False):
    for n in (7, 10, 13, 16, 20):
        prob = synthetic.chain(n, seed=1)
        if single:
            prob = dataclasses.replace(
                prob, nodes=[dataclasses.replace(nd, impls=nd.impls[:1]) for nd in prob.nodes]
            )
        an = analysis(prob)
        sim = simulate(prob, no_recompute(prob))
        for frac in (0.6, 0.4):
            b = int(sim.peak_bytes * frac)
            f = Formulation(an, b, window=None)
            lp = f.solve_highs(60, relax=True)
            t = time.time()
            ip = Formulation(an, b, window=None).solve_highs(120, mip_gap=1e-4)
            dt = time.time() - t
            if ip.objective is None or lp.objective is None:
                print(
                    f"{'default impl' if single else 'all impls':12s} n={n:2d} {frac}: {ip.status}",
                    flush=True,
                )
                continue
            base = sim.time_s
            print(
                f"{'default impl' if single else 'all impls':12s} n={n:2d} {frac}: cols {f.n_cols:5d} LP {lp.objective / base:.4f} "
                f"optimum {ip.objective / base:.4f} ({ip.status}, bound {ip.dual_bound / base:.4f}, {dt:.1f} s) "
                f"LP gap {1 - lp.objective / ip.objective:.1%}",
                flush=True,
            )
