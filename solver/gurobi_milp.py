"""Gurobi as the MILP backend of `solver.solve(..., solver="gurobi")` (optional).

The same matrices as HiGHS gets (`Formulation.matrix()`, rescaled by `_Scaling`), handed to
gurobipy's matrix API; the same semantics as `Formulation.solve_highs`: warm start, columns held
at fixed values (polishing neighbourhoods), a stall rule, the LP relaxation, the peak mode's
stop once a plan's peak is under a target, and the returned bound never below the trivial one.

Needs `pip install gurobipy` and a licence for the model's size: the licence bundled with the
pip package is limited to 2000 variables and 2000 rows (enough for small problems, not for
ResNet-50's ~17k columns); a run on a larger model raises `GurobiUnavailable` saying so.
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np

SIZE_LIMITED = 10010  # GurobiError: model too large for a size-limited licence
NO_LICENCE = (10009, 10032)  # no licence found / licence expired


class GurobiUnavailable(RuntimeError):
    """gurobipy is missing, has no licence, or its licence does not cover the model's size."""


def check_available() -> None:
    """Raise `GurobiUnavailable` unless gurobipy imports and a licence lets it start."""
    try:
        import gurobipy as gp
    except ImportError as exc:
        raise GurobiUnavailable(
            "solver='gurobi' needs gurobipy (pip install gurobipy) and a Gurobi licence; "
            "solver='highs' (command line: --milp-solver highs) needs neither"
        ) from exc
    try:
        with gp.Env(params={"OutputFlag": 0}):
            pass
    except gp.GurobiError as exc:
        raise GurobiUnavailable(f"gurobipy is installed but cannot start: {exc} (error {exc.errno})") from exc


def solve_formulation(
    form,
    time_limit: float,
    mip_gap: float = 0.01,
    threads: int = 2,
    warm: np.ndarray | None = None,
    verbose: bool = False,
    fixed: dict[int, float] | None = None,
    stall_s: float | None = None,
    relax: bool = False,
):
    """`Formulation.solve_highs`, solved by Gurobi: a `MilpResult` in the formulation's units."""
    import gurobipy as gp
    from gurobipy import GRB

    from solver.formulation import INF

    t_enter = time.perf_counter()
    scaled, A, r_lo, r_hi, lower, upper = form.scaled_model(fixed)
    A = A.tocsr()  # rows are sliced by sense
    integer = np.asarray(form.md.integer, dtype=bool) & (not relax)
    vtype = np.where(integer, GRB.INTEGER, GRB.CONTINUOUS)

    env = gp.Env(empty=True)
    env.setParam("OutputFlag", 1 if verbose else 0)
    env.start()
    m = gp.Model("monet-opt", env=env)
    try:
        m.Params.TimeLimit = max(0.5, float(time_limit) - (time.perf_counter() - t_enter))
        m.Params.MIPGap = float(mip_gap)
        m.Params.Threads = int(threads)
        m.Params.Seed = 0
        x = m.addMVar(
            form.n_cols,
            lb=np.where(np.isinf(lower), -GRB.INFINITY, lower),
            ub=np.where(np.isinf(upper), GRB.INFINITY, upper),
            vtype=vtype,
        )
        eq = np.isfinite(r_lo) & np.isfinite(r_hi) & (r_lo == r_hi)
        le = np.isfinite(r_hi) & ~eq
        ge = np.isfinite(r_lo) & ~eq
        for mask, sense, rhs in ((eq, "=", r_hi), (le, "<", r_hi), (ge, ">", r_lo)):
            rows = np.flatnonzero(mask)
            if len(rows):
                m.addMConstr(A[rows], x, sense, rhs[rows])
        m.setObjective(scaled.cost @ x, GRB.MINIMIZE)
        warm_model = scaled.to_model(np.asarray(warm, dtype=float)) if warm is not None else None
        if warm_model is not None and not relax:
            x.Start = warm_model
        m.update()

        target = form.stop_at_objective
        peak_col = form.peak_col
        to_beat = float(scaled.cost @ warm_model) * (1 - 1e-6) if warm_model is not None else INF
        t0 = time.perf_counter()
        state = {"improved": warm is None}
        xvars = x.tolist()

        def callback(model, where) -> None:
            if where == GRB.Callback.MIPSOL:
                obj = model.cbGet(GRB.Callback.MIPSOL_OBJ)
                state["improved"] = state["improved"] or obj < to_beat
                if target is not None and peak_col is not None:
                    if model.cbGetSolution(xvars[peak_col]) <= target:
                        model.terminate()  # good enough: a plan whose peak is under the target
            elif where == GRB.Callback.MIP and stall_s is not None and not state["improved"]:
                nodes = model.cbGet(GRB.Callback.MIP_NODCNT)
                if nodes > 0 or time.perf_counter() > t0 + stall_s:
                    model.terminate()  # stalled: as `solve_highs`

        try:
            m.optimize(callback)
        except gp.GurobiError as exc:
            if exc.errno == SIZE_LIMITED:
                raise GurobiUnavailable(
                    f"the Gurobi licence is size-limited and this MILP has {form.n_cols} columns and "
                    f"{form.n_rows} rows (the licence bundled with pip allows 2000 of each): use a full "
                    "licence, or solver='highs' (command line: --milp-solver highs)"
                ) from exc
            if exc.errno in NO_LICENCE:
                raise GurobiUnavailable(f"Gurobi licence: {exc}") from exc
            raise
        solve_time = time.perf_counter() - t0
        st = m.Status
        if st == GRB.OPTIMAL:
            status = "optimal"
        elif st in (GRB.INFEASIBLE, GRB.INF_OR_UNBD):
            status = "infeasible"
        elif st in (GRB.TIME_LIMIT, GRB.INTERRUPTED):
            status = "time_limit"
        else:
            status = f"gurobi_status_{st}"
        x_model = np.asarray(x.X) if m.SolCount > 0 else None
        bound = float(m.ObjBound) if m.SolCount > 0 and not relax else float("nan")
        res = form.result(status, scaled, x_model, bound, solve_time, relax)
        if res.status == "time_limit" and res.gap is not None and res.gap <= mip_gap:
            # stopped by a callback with the gap already closed: optimal, as HiGHS reports it
            res = dataclasses.replace(res, status="optimal")
        return res
    finally:
        m.dispose()
        env.dispose()
