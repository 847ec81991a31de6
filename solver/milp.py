"""The exact strategy: `solve` (and `sweep`, `minimum_peak`) over the MILP of `solver.formulation`.

The baselines run first and give warm starts; RINS from several of them and polishing
(`solver.local_search`) improve the plan inside a recompute window's MILP; HiGHS (or Gurobi)
runs the MILP itself, beside polishing, for a bound; the window widens while time allows
(`window_ladder`, `WIDEN_FACTOR`). Every plan is replayed by the simulator before it is kept, and
the schedule returned is the fastest that fits, with its status and proven gap.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from solver import local_search
from solver.formulation import Formulation, MilpResult, own_cells
from solver.gather import gather_backwards
from solver.plan import Plan
from solver.progress import log, mib, start_clock

if TYPE_CHECKING:
    from solver.schedule import Schedule


# how many nodes back (topological index) a backward stage may recompute; None: unbounded
AUTO_WINDOWS = (6, 12, 24, None)
# the next window starts only with this many times the previous window's wall time left, times
# the ratio of their windows
WIDEN_FACTOR = 1.5
# time mode: the share of the time a MILP leaves for `local_search.polish` if it runs out of time
# (Gurobi, or a MILP without a warm start; HiGHS runs beside polishing instead:
# `local_search.highs_beside_polish`)
POLISH_SHARE = 0.4
# time mode, after polishing that did not run beside HiGHS: when it stops improving with at least
# this many seconds left, HiGHS runs the polished MILP again for the rest (ResNet-50 b8 224 at
# 0.33 with 300 s: polishing was done at 175 s and the time after it went unused)
FINAL_RUN_MIN_S = 5.0
# time mode: HiGHS' bound run starts beside RINS if at least this many seconds are left
EARLY_MIN_S = 10.0
# time mode, where polishing does not run beside HiGHS: a warm-started MILP that has found nothing
# better by the end of its root node, or within this share of its time, gives the rest to
# `local_search.polish` (ResNet-50 b8 224 at 0.33, 60 s: HiGHS never beat the multilevel warm start; with the
# hand-over +48.5 % -> +30.7 % predicted, at the cost of 0.4: +14.7 % -> +20.7 %, where HiGHS' root
# heuristics needed ~25 s)
STALL_SHARE = 0.5
# time mode, after RINS: polishing goes on beside HiGHS' early run (on the window's own MILP),
# whichever MILP RINS ended in, instead of HiGHS again on RINS' MILP from its root (session 70,
# ResNet-50 b8 224, 60 s, one run each, with polishing going on from HiGHS' plans: kept 0.4
# 1.1848 s (0.99 %) -> 1.1755 (0.21 %), Adam 0.8 1.0879 -> 1.0799, Adam 0.25 1.2810 -> 1.2783,
# kept 0.33, 0.5, 0.6 the same plans; the early run's bound holds for all of the window's
# schedules, and it keeps its cuts and incumbents)
KEEP_EARLY_RUN = True


# ---------------------------------------------------------------------------------------------
class InfeasibleBudget(ValueError):
    """No schedule fits the budget; `minimum_bytes` is the smallest budget known to be needed/enough.
    `lowest`: the lowest-peak schedule the failed solve found (over the budget), if any: a later
    solve for `minimum_bytes` may start from it (`start_plan`) instead of searching again."""

    def __init__(self, message: str, minimum_bytes: int, lowest=None) -> None:
        super().__init__(message)
        self.minimum_bytes = int(minimum_bytes)
        self.lowest = lowest


class NoScheduleFound(InfeasibleBudget):
    """The budget is above the lower bound, but no schedule was found within the time limit."""


MILP_BACKENDS = ("highs", "gurobi")
_BACKEND_NAMES = {"highs": "HiGHS", "gurobi": "Gurobi"}


def check_backend(solver: str) -> None:
    """`solver` names a MILP backend this machine can run (`solver.gurobi_milp.GurobiUnavailable`
    when Gurobi is asked for and gurobipy or its licence is missing)."""
    if solver not in MILP_BACKENDS:
        raise ValueError(f"solver {solver!r} is not supported: one of {', '.join(MILP_BACKENDS)}")
    if solver == "gurobi":
        from solver.gurobi_milp import check_available

        check_available()


def resolve_budget(problem, budget) -> int:
    """Bytes from an int, or from a float in (0, 1] (fraction of the no-recompute peak, weight
    gradients not deferred: plain PyTorch's)."""
    from solver.baselines import no_recompute

    if isinstance(budget, bool):
        raise TypeError("budget must be bytes (int) or a fraction in (0, 1]")
    if isinstance(budget, float):
        if not 0.0 < budget <= 1.0:
            raise ValueError(f"a fractional budget must be in (0, 1], got {budget}")
        return int(budget * no_recompute(problem.without_deferral()).predicted_peak_bytes)
    return int(budget)


def _solve(
    problem,
    budget,
    time_limit: float = 60.0,
    verbose: bool = True,
    mip_gap: float = 0.01,
    solver: str = "highs",
    threads: int = 2,
    warm_start: bool = True,
    window: int | str | None = "auto",
    start_plan: Plan | None = None,
    resume: bool = False,
) -> tuple[Schedule, Plan | None]:
    """`solve`, and the plan of the schedule it returns (None for a baseline that is no policy)."""
    from solver.baselines import analysis, fitting_baselines, lowest_peak_baseline, no_recompute, plan_of
    from solver.bounds import explain_lower_bound, min_feasible_lower_bound
    from solver.plan import PlanError, to_schedule
    from solver.schedule import Schedule, SolverInfo
    from solver.simulate import simulate

    t_start = time.perf_counter()
    start_clock(t_start)
    deadline = t_start + float(time_limit)
    check_backend(solver)
    name = f"{solver}-milp"
    budget_bytes = resolve_budget(problem, budget)
    lb = min_feasible_lower_bound(problem)
    if budget_bytes < lb:
        raise InfeasibleBudget(
            f"budget {budget_bytes} bytes is below the minimum any schedule needs: "
            f"{explain_lower_bound(problem)} (minimum_bytes={lb})",
            lb,
        )
    an = analysis(problem)
    fastest = _fastest_if_it_fits(problem, an, budget_bytes, name, t_start)
    if fastest is not None:
        log(
            verbose,
            "nothing recomputed, every node's fastest implementation: fits, and no schedule is faster",
        )
        return fastest
    if an.T == 0:
        # nothing needs a backward (every parameter frozen, no gradient reaching the model):
        # nothing is kept for one, so no schedule peaks below the plain forward's (the MILP,
        # built for backward stages, failed with an IndexError)
        plain = no_recompute(problem).predicted_peak_bytes
        raise InfeasibleBudget(
            f"budget {budget_bytes} bytes is below the minimum any schedule needs: {plain} bytes; "
            "nothing in the model needs a backward (are all its parameters frozen?), so there is "
            f"nothing to recompute (minimum_bytes={plain})",
            plain,
        )
    greedy_time = min(10.0, max(0.5, 0.15 * time_limit))
    log(verbose, f"budget {budget_bytes} B, lower bound {lb} B; the baselines (warm starts) first")
    fits = fitting_baselines(problem, budget_bytes, greedy_time=greedy_time)
    lowest: list = []  # the budget-free baseline with the smallest peak, once computed

    def known_peak() -> tuple[int, str]:
        """`baselines.min_known_peak`, computed once (a multilevel search of up to 10 s)."""
        if not lowest:
            lowest.append(lowest_peak_baseline(problem))
        return lowest[0].predicted_peak_bytes, lowest[0].strategy

    if not fits and known_peak()[0] <= budget_bytes:
        # the budget-driven searches found nothing that fits; the budget-free baseline with the
        # smallest peak does (the error message below names it: a CI run of the timm ViT test at
        # a budget 272 bytes above it raised "no schedule found" after a 4-s solve)
        fits = [Schedule(**{**lowest[0].__dict__, "budget_bytes": budget_bytes})]
    base = fits[0] if fits else None
    log(
        verbose,
        f"{len(fits)} baselines fit; the fastest: "
        + (
            f"{base.strategy} {base.predicted_time_s:.4f} s, peak {base.predicted_peak_bytes} B"
            if base
            else "none fits"
        ),
    )

    base_plans = []  # the fitting baselines' plans, fastest first: warm starts
    if warm_start:
        for fit in fits:
            try:
                plan = plan_of(problem, fit)
            except (PlanError, KeyError) as exc:  # pragma: no cover - defensive
                log(verbose, f"warm start {fit.strategy} unavailable: {exc}")
                continue
            if plan is not None:
                base_plans.append(plan)
    warm_plan = base_plans[0] if base_plans else None

    def fallback(reason: str, gap=None):
        elapsed = time.perf_counter() - t_start
        if base is None:
            known, name = known_peak()
            raise NoScheduleFound(
                f"no schedule within budget {budget_bytes} bytes found in {time_limit:.0f} s "
                f"({reason}); the lower bound is {lb} bytes and the smallest peak found is "
                f"{known} bytes ({name}); raise the budget or the time limit",
                known,
            )
        info = SolverInfo(
            name=base.solver.name, status=f"fallback:{base.strategy}", gap=gap, solve_time_s=elapsed
        )
        sched = Schedule(**{**base.__dict__, "solver": info, "budget_bytes": budget_bytes})
        return sched, plan_of(problem, base)

    start = None  # start_plan's schedule, if it fits

    def from_start(status: str):
        info = SolverInfo(name=name, status=status, solve_time_s=time.perf_counter() - t_start)
        return dataclasses.replace(start, solver=info), start_plan

    start_peak = None  # start_plan's peak, whether it fits or not
    if start_plan is not None:
        start_sched = to_schedule(an, start_plan, "milp", SolverInfo(name="start-plan"), budget_bytes)
        start_peak = simulate(problem, start_sched).peak_bytes
        if start_peak <= budget_bytes:
            start = start_sched
    if start is not None and (
        warm_plan is None or not warm_start or start.predicted_time_s < base.predicted_time_s
    ):
        warm_plan = start_plan
    if warm_plan is None and deadline - time.perf_counter() > 2.0:
        # no baseline fits: lower the peak with the MILP until a plan fits, and start from it
        # it stops at the first plan under the budget, so a generous share costs nothing when one
        # comes early; without one there is no schedule at all
        t_peak = time.perf_counter() + 0.75 * (deadline - time.perf_counter())
        # a tight gap: it stops at the first plan under the budget anyway, and a 1 % gap on
        # the peak can stop it just above the budget
        # (from start_plan if its peak is below every baseline's: a plan an earlier search found)
        low = _ladder(
            problem,
            an,
            None,
            window,
            _lowest_plan(problem, start_plan, start_peak),
            t_peak,
            0.001,
            threads,
            verbose,
            budget_bytes,
            backend=solver,
        )
        if low.best is not None:
            low_peak = low.best[0].predicted_peak_bytes
            log(verbose, f"smallest peak the MILP found: {low_peak} B (budget {budget_bytes} B)")
            if low_peak <= budget_bytes:
                warm_plan = low.best[2]
            else:
                known, name = known_peak()
                known = min(known, low_peak, start_peak or known)
                w_low, res_low = low.last
                if w_low is None and res_low is not None and res_low.status == "optimal":
                    # the peak MILP over every schedule ended optimal: more time is unlikely to find a
                    # lower peak (not a proof: its objective also prefers fast plans, by up to
                    # PEAK_MODE_TIME_MIB per no-recompute step time, and its rows over-approximate)
                    raise InfeasibleBudget(
                        f"budget {mib(budget_bytes)} ({budget_bytes} bytes) is below the smallest peak "
                        f"monet-opt finds: {mib(known)} ({known} bytes; the MILP minimising the peak over "
                        f"every schedule ended optimal, so a longer time limit is unlikely to find less; "
                        f"no schedule goes below {mib(lb)}, the memory none can avoid); a budget of "
                        f"{known} bytes works, and 'min' solves for the smallest peak",
                        known,
                        low.best[0],
                    )
                raise NoScheduleFound(
                    f"no schedule within budget {budget_bytes} bytes found in {time_limit:.0f} s; the "
                    f"lower bound is {lb} bytes and the smallest peak found is {known} bytes (MILP "
                    f"minimising the peak, {low.scope()}); raise the budget or the time limit",
                    known,
                    low.best[0],
                )
    # the other fitting baselines, fastest first: warm starts if the window's rows reject the first
    alternates = [p for p in base_plans if p is not warm_plan]
    lad = _ladder(
        problem,
        an,
        budget_bytes,
        window,
        warm_plan,
        deadline,
        mip_gap,
        threads,
        verbose,
        alternates=alternates,
        backend=solver,
        resume=resume and start_plan is not None and warm_plan is start_plan,
    )
    best, last, attempts = lad.best, lad.last, lad.attempts
    elapsed = time.perf_counter() - t_start
    w_last, res_last = last
    scope = "unbounded" if w_last is None else f"{w_last} nodes"
    if best is None:
        last_status = "time_limit (RINS only)" if res_last is None else res_last.status
        if last_status == "infeasible" and base is None:
            known, name = known_peak()
            proven = "" if w_last is None else f" with a recompute window of {scope}"
            raise InfeasibleBudget(
                f"no schedule fits budget {budget_bytes} bytes in this formulation{proven} (MILP infeasible); "
                f"lower bound {lb} bytes, smallest peak found {known} bytes ({name})",
                known,
            )
        if base is None and warm_plan is not None:
            # the time MILP found nothing in the time left: the plan it started from (the peak
            # MILP's, or start_plan) fits
            info = SolverInfo(
                name=name, status=f"fallback:warm-start plan ({last_status})", solve_time_s=elapsed
            )
            sched = to_schedule(an, warm_plan, "milp", info, budget_bytes)
            if simulate(problem, sched).peak_bytes <= budget_bytes:
                return sched, warm_plan
        if start is not None and (base is None or start.predicted_time_s < base.predicted_time_s):
            return from_start(f"fallback:start plan ({last_status})")
        return fallback(f"MILP {last_status}")
    sched, obj, plan = best
    if lad.proven is not None:
        w_last, gap, status = lad.proven
        bound = obj * (1.0 - gap)
    else:
        bound = Formulation.trivial_bound(an)
        gap = max(0.0, (obj - bound) / obj) if obj and obj > 0 else 0.0
        status = "time_limit"
    if status in ("time_limit", "unproven") and gap <= mip_gap:
        # proven within the gap asked for (by a bound from another run, an LP relaxation, or the
        # trivial bound): optimal in HiGHS' sense (a sweep's CSV said "time_limit, gap 0.0")
        status = "optimal"
    scope = "unbounded" if w_last is None else f"{w_last} nodes"
    info = SolverInfo(name=name, status=status, gap=gap, solve_time_s=elapsed)
    meta = {
        "milp_objective": obj,
        "milp_dual_bound": bound,
        "milp_window": w_last,
        "milp_gap_scope": f"recompute window {scope}",
        "milp_attempts": attempts,
    }
    if lad.widest is not None and lad.widest[0] != w_last:
        # the same plan's gap over the widest window whose bound holds for it (a looser bound
        # over more schedules): "0.26 % within window 6, 0.35 % within window 24"
        meta["milp_gap_widest"] = {"window": lad.widest[0], "gap": float(lad.widest[1])}
    if lad.proven is not None and (lad.own[1] > gap + 1e-12 if lad.own else gap > 0):
        # the gap proven over schedules that include the plan itself, where the plan departs from
        # the window's rule and the headline gap bounds only the window's own schedules (None: no
        # bound over a MILP holding the plan)
        meta["milp_gap_plan_milp"] = (
            None if lad.own is None else {"window": lad.own[0], "gap": float(lad.own[1])}
        )
    sched = dataclasses.replace(sched, solver=info, meta={**sched.meta, **meta})
    if base is not None and base.predicted_time_s < sched.predicted_time_s - 1e-12:
        return fallback("a baseline is faster", gap=gap)
    if start is not None and start.predicted_time_s < sched.predicted_time_s - 1e-12:
        return from_start("fallback:start plan (faster)")
    return sched, plan


def _fastest_if_it_fits(problem, an, budget_bytes: int, name: str, t_start: float):
    """(schedule, plan) of no recomputation with every node's fastest implementation, if it fits
    the budget and its time is the trivial bound (no schedule is faster: optimal without a
    search); else None. Generous budgets are answered at once (resnet18 at its no-recompute
    peak: 6.3 s of baselines and MILP before, 1.0 s now)."""
    from solver.baselines import no_recompute, plan_of
    from solver.schedule import SolverInfo
    from solver.simulate import simulate

    backward = set(an.bw)
    impls = {}
    for i, (node, ims) in enumerate(zip(problem.nodes, an.impls)):
        cost = (lambda im: im.fwd_time + im.bwd_time) if i in backward else (lambda im: im.fwd_time)
        impls[node.name] = min(ims, key=cost).name
    sched = no_recompute(problem, impls=impls)
    result = simulate(problem, sched)
    bound = Formulation.trivial_bound(an)
    if result.peak_bytes > budget_bytes or result.time_s > bound * (1 + 1e-12):
        return None
    plan = plan_of(problem, sched)
    if plan is None:  # pragma: no cover - a policy schedule always has its plan
        return None
    info = SolverInfo(name=name, status="optimal", gap=0.0, solve_time_s=time.perf_counter() - t_start)
    meta = {
        "milp_objective": result.time_s,
        "milp_dual_bound": bound,
        "milp_window": None,
        "milp_gap_scope": "recompute window unbounded",
        "milp_attempts": [],
    }
    sched = dataclasses.replace(
        sched, strategy="milp", solver=info, budget_bytes=budget_bytes, meta={**sched.meta, **meta}
    )
    return sched, plan


def solve(
    problem,
    budget,
    time_limit: float = 60.0,
    verbose: bool = True,
    mip_gap: float = 0.01,
    solver: str = "highs",
    threads: int = 2,
    warm_start: bool = True,
    window: int | str | None = "auto",
    start_plan: Plan | None = None,
    gather: bool = True,
    resume: bool = False,
):
    """The fastest schedule whose simulated peak fits `budget` (bytes, or fraction of no-recompute peak).

    Raises InfeasibleBudget when the budget is below the provable lower bound, and
    NoScheduleFound when neither the MILP (within `time_limit`) nor any baseline
    finds a fitting schedule. Never returns a schedule over budget: the result is
    replayed with `solver.simulate`; if the MILP's schedule did not fit, the best
    fitting baseline is returned and `solver.status` says "fallback:<baseline>".

    `start_plan`: a Plan known to fit (e.g. from `minimum_peak`, or a tighter budget's plan in a
    sweep), used as the warm start when no baseline fits or when it is faster than the best
    baseline; the result is never slower than it.
    `resume`: `start_plan` is what an earlier solve of this problem and budget ended on (RINS and
    polishing already ran from it): where it is the warm start, RINS is skipped and the time goes
    to polishing it beside HiGHS' bound run on the window's own MILP (ResNet-50 b8 224, kept
    gradients, 0.33: a second minute with RINS again spent 34 s of it on RINS rounds that found
    nothing, and polished 1.2453 -> 1.2397 s).
    `window`: "auto" (widen 6 -> 12 -> 24 -> unbounded while time remains), an int, or
    None (the unbounded formulation only); see the module docstring.
    `gather`: move backward steps together where the peak allows (`solver.gather`), so the
    runtime runs them in fewer autograd calls; the same steps, the same predicted time, every
    gradient's parts added in the same order (plain PyTorch's gradients bit for bit as before).
    """
    sched = _solve(
        problem, budget, time_limit, verbose, mip_gap, solver, threads, warm_start, window, start_plan, resume
    )[0]
    return gather_backwards(problem, sched) if gather else sched


def sweep(
    problem, budgets, time_limit: float = 60.0, verbose: bool = True, start_plan: Plan | None = None, **kw
) -> list:
    """`solve` for each budget, tightest first, each solve starting from the tighter budget's plan
    (which fits the looser budget too): a looser budget's schedule is never slower than a tighter
    one's. The tightest starts from `start_plan`, if given (`solve`'s). Returns, in the order
    given, each budget's Schedule or the error it raised (InfeasibleBudget, NoScheduleFound, or
    ValueError for a budget that is no budget)."""
    out: list = [None] * len(budgets)
    sizes = {}
    for k, b in enumerate(budgets):
        try:
            sizes[k] = resolve_budget(problem, b)
        except ValueError as exc:  # (a fraction outside (0, 1], say)
            out[k] = exc
    order = sorted(sizes, key=sizes.get)
    plan = start_plan
    for k in order:
        try:
            sched, found = _solve(problem, budgets[k], time_limit, verbose, start_plan=plan, **kw)
        except InfeasibleBudget as exc:
            out[k] = exc
            continue
        out[k] = gather_backwards(problem, sched)
        plan = found if found is not None else plan
    return out


def minimum_peak(
    problem,
    time_limit: float = 60.0,
    verbose: bool = True,
    window="auto",
    threads: int = 2,
    solver: str = "highs",
    start_plan: Plan | None = None,
):
    """The fastest schedule at the smallest peak the MILP finds within `time_limit`.

    Half the time minimises the peak (recompute windows widening as in `solve`), the
    rest minimises the step time at that peak. `meta["lower_bound_bytes"]` is
    `min_feasible_lower_bound`: no schedule peaks lower (the MILP's own dual bound
    is not one, since its memory rows over-approximate the simulator).
    `start_plan`: a plan found before (`monet_opt.fastest_found`); the peak search starts from it
    if its peak is below the lowest baseline's, so the peak found is never above it."""
    from solver.baselines import analysis, min_known_peak, no_recompute
    from solver.bounds import min_feasible_lower_bound
    from solver.plan import to_schedule
    from solver.schedule import SolverInfo
    from solver.simulate import simulate

    t_start = time.perf_counter()
    start_clock(t_start)
    an = analysis(problem)
    lb = min_feasible_lower_bound(problem)
    check_backend(solver)
    start_peak = None
    if start_plan is not None:
        start_peak = simulate(
            problem, to_schedule(an, start_plan, "start", SolverInfo(name="start"))
        ).peak_bytes
    low = _ladder(
        problem,
        an,
        None,
        window,
        _lowest_plan(problem, start_plan, start_peak),
        t_start + 0.5 * time_limit,
        0.001,
        threads,
        verbose,
        backend=solver,
    )
    if low.best is None:
        known, name = min_known_peak(problem)
        target = known
        log(verbose, f"the peak MILP found nothing; using the smallest baseline peak ({name})")
    else:
        known, _name = min_known_peak(problem)
        target = min(low.best[0].predicted_peak_bytes, known)
    remaining = max(1.0, time_limit - (time.perf_counter() - t_start))
    start = low.best[2] if low.best is not None and low.best[0].predicted_peak_bytes <= target else None
    if start_peak is not None and start_peak < target:  # (the window's rows rejected start_plan)
        target, start = start_peak, start_plan
    log(verbose, f"now the fastest schedule at {mib(int(target))} (a solve of its own: times restart)")
    sched = solve(
        problem,
        int(target),
        time_limit=remaining,
        verbose=verbose,
        window=window,
        threads=threads,
        start_plan=start,
        solver=solver,
    )
    meta = {
        "lower_bound_bytes": lb,
        "no_recompute_peak_bytes": no_recompute(problem.without_deferral()).predicted_peak_bytes,
        "min_peak_attempts": low.attempts,
    }
    return dataclasses.replace(sched, meta={**sched.meta, **meta})


def _lowest_plan(problem, start_plan: Plan | None = None, start_peak: int | None = None) -> Plan | None:
    """The peak MILP's warm start: the plan of the lowest-peak baseline, or `start_plan` (of
    simulated peak `start_peak`, found before) if it peaks lower or the baseline has no plan."""
    from solver.baselines import lowest_peak_baseline, plan_of
    from solver.plan import PlanError

    base = lowest_peak_baseline(problem)
    if start_plan is not None and start_peak < base.predicted_peak_bytes:
        return start_plan
    try:
        return plan_of(problem, base)
    except (PlanError, KeyError):  # pragma: no cover - defensive
        return start_plan


@dataclass
class _LadderResult:
    best: tuple | None  # (schedule, objective, plan)
    last: tuple  # (window, MilpResult) of the widest MILP run; MilpResult None if RINS took its time
    attempts: list[dict]
    proven: tuple | None = None  # (window, gap, status) of the tightest bound on the best plan
    widest: tuple | None = None  # (window, gap) of the bound over the most schedules on the best plan
    # (window, gap) over a MILP holding the best plan itself (built around it where it departs from
    # the window's rule), when that is all `proven` says less than
    own: tuple | None = None

    def scope(self) -> str:
        w = self.last[0]
        return "recompute window unbounded" if w is None else f"recompute window {w} nodes"


def _ladder(
    problem,
    an,
    budget_bytes,
    window,
    warm_plan,
    deadline,
    mip_gap,
    threads,
    verbose,
    stop_at_peak=None,
    alternates=(),
    backend: str = "highs",
    resume: bool = False,
) -> _LadderResult:
    """Widen the recompute window while time remains; each MILP starts from the best plan so far.
    resume: warm_plan is an earlier solve's result (`solve`'s `resume`): no RINS, polishing beside
    the early bound run.
    budget_bytes=None minimises the peak (best = smallest simulated peak, then time).
    alternates: further fitting plans, fastest first, to start from when the window's rows reject
    warm_plan (the rows count what the simulator counts for policy plans, tested on the synthetic
    zoo, but stay upper bounds where implementations of a node hand gradient buffers over
    differently: `Analysis` then follows what every implementation hands over)."""
    from solver.plan import PlanError, to_schedule
    from solver.schedule import SolverInfo
    from solver.simulate import ScheduleInvalid, simulate

    what = "peak" if budget_bytes is None else "time"
    best = None
    best_index = -1
    best_form = None
    attempts: list[dict] = []
    results: list[tuple] = []  # (window, MilpResult, the Formulation it solved)
    bounds: list[tuple] = []  # (window, MilpResult, Formulation) of LP relaxations solved (RINS)
    last = None
    # time mode: a plan that recomputes nothing and runs every node's fastest implementations is
    # optimal over every schedule (the trivial bound), whatever the window; no MILP can beat it
    floor = None if budget_bytes is None else Formulation.trivial_bound(an) * (1.0 + 1e-9)

    def accept(plan, objective: float, index: int) -> bool:
        """Keep `plan` if it replays, fits, and beats the best so far."""
        nonlocal best, best_index
        try:
            sched = to_schedule(an, plan, "milp", SolverInfo(name=f"{backend}-milp"), budget_bytes)
            sim = simulate(problem, sched)
        except (PlanError, ScheduleInvalid) as exc:
            log(verbose, f"MILP solution did not replay: {exc}")
            return False
        if budget_bytes is not None and sim.peak_bytes > budget_bytes:
            log(verbose, f"MILP schedule peak {sim.peak_bytes} > budget {budget_bytes}")
            return False
        key = (sim.peak_bytes, sim.time_s) if budget_bytes is None else (sim.time_s,)
        if best is not None and key >= best[3]:
            return False
        best = (sched, objective, plan, key)
        best_index = index
        if early is not None:
            early.offer(plan, objective)
        return True

    def at_floor() -> bool:
        return floor is not None and best is not None and best[1] <= floor

    def proven_gap() -> tuple:
        """(proven, widest): the tightest proven gap for the best plan so far, (window, gap,
        status), from the best bound of any MILP run whose feasible set holds the plan (the MILP
        that found it, a wider one it warm-started, the same MILP run again after polishing, or
        an earlier run of that MILP: each run's bound holds for all its points), or from the best
        bound of all runs of a window w or wider ones, which holds for window w's own schedules
        (every such MILP holds them all); and the (window, gap) of the widest window whose bound
        holds. None where none holds."""
        proven = widest = None
        holding: list[tuple] = []  # (window, gap) of every run whose bound holds for the best plan
        own = None  # (window, gap): the tightest over a MILP that holds the plan itself
        if at_floor():
            proven = (None, 0.0, "optimal")  # the trivial bound holds for every schedule
        elif best is not None:
            obj, plan = best[1], best[2]
            runs = [(w, res, form, res.status) for w, res, form in results]
            # (an LP relaxation's bound is as good as a MILP run's; it proves no optimality of its own)
            runs += [(w, res, form, "time_limit") for w, res, form in bounds]
            for w, res, form, status in runs:
                if res.dual_bound is None or form.point_of(plan, obj) is None:
                    continue
                gap = max(0.0, (obj - res.dual_bound) / obj) if obj > 0 else 0.0
                if proven is None or gap < proven[1]:
                    proven = (w, gap, status)
                if own is None or gap < own[1]:
                    own = (w, gap)
                holding.append((w, gap))
            for w in {w for w, *_ in runs}:
                # every MILP of window w (built around any plan: columns of its own only add
                # choices) or of a wider window holds all of window w's schedules, so the best of
                # their bounds bounds those schedules, whether or not the plan is one of them
                # (ResNet-50 b8 224, kept 1/3: the final MILP's bound 1.1389, an early run's on
                # the MILP around another start 1.1596; the plan, 1.1881, is only in the first)
                finite = [
                    res.dual_bound
                    for w2, res, _form, _status in runs
                    if _covers(w2, w) and res.dual_bound is not None and math.isfinite(res.dual_bound)
                ]
                if finite:
                    gap = max(0.0, (obj - max(finite)) / obj) if obj > 0 else 0.0
                    if proven is None or gap < proven[1]:
                        proven = (w, gap, "time_limit")
                    holding.append((w, gap))
        if holding:
            # a wider window's bound holds over more schedules: the gap it proves says more (the
            # smallest one, of that window's runs)
            widest = max(holding, key=lambda wg: (float("inf") if wg[0] is None else wg[0], -wg[1]))
        return proven, widest, own

    started = None  # (when the previous window's iteration started, its window)
    # HiGHS' run for the bound from the first window's start on, beside RINS (a
    # `local_search.BoundRun` on the window's own MILP, without columns of any start: its bound
    # holds for every schedule of the window, and it is the smallest of the window's MILPs);
    # polishing goes on beside it after RINS while it runs (ResNet-50 b8 224, kept gradients, 1/3,
    # session 65: 1.2005 s after 16 s on that MILP, one thread, against 1.1849 after 55 s on the MILP
    # around the plan, 1.2022 s, that the solve ended with)
    early = None
    early_window = None
    retired: list = []  # early runs stopped and not waited for (`close_early` keeps their results)

    def stop_early() -> None:
        """Stop the early bound run (if any) without waiting for it; `close_early` keeps its result."""
        nonlocal early
        if early is not None:
            early.cancel()
            retired.append(early)
            early = None

    stopped_proven = [False]  # a window's HiGHS run stopped by `proven_now`: as if it ended optimal

    def keep_retired(run) -> None:
        """Take a stopped early run off `retired` and keep its result (waits for it to end)."""
        retired.remove(run)
        res = run.result()
        if res.status != "not_started":
            record(early_window, res, run.form, {"early": True}, "HiGHS' early run")
        else:
            log(verbose, "HiGHS' moved bound run never started: the run it moved from was still ending")

    def harvest_early() -> None:
        """Keep the results of the stopped early runs that have ended (their bounds hold)."""
        for run in [r for r in retired if r.done.is_set()]:
            keep_retired(run)

    def proven_now() -> bool:
        """Whether the best plan is proven within mip_gap by the runs that have ended (in the
        scope `proven_gap` gives: a window's own schedules at least)."""
        harvest_early()
        proven = proven_gap()[0]
        if proven is None or proven[1] > mip_gap:
            return False
        scope = "every schedule" if proven[0] is None else f"window {proven[0]}'s schedules"
        log(verbose, f"the plan ({best[1]:.4f}) proven within {proven[1]:.2%} of {scope}: polishing stops")
        stopped_proven[0] = True
        return True

    def close_early() -> None:
        """Stop the early bound run (if any) and keep its result as a run of its MILP, and those
        of the runs it moved from."""
        stop_early()
        while retired:
            keep_retired(retired[0])

    def record(w, res: MilpResult, f: Formulation, flags: dict, what_run: str) -> None:
        """Keep a finished run of `f` (window `w`): its bound, its attempt, its plan if better."""
        results.append((w, res, f))
        attempts.append({**_attempt(what, w, res), **flags})
        log(
            verbose,
            f"{what_run} (window {w}): {res.status}, objective {res.objective}, bound {res.dual_bound}, "
            f"{res.solve_time_s:.1f} s",
        )
        if res.plan is not None:
            accept(res.plan, res.objective, len(results) - 1)

    started_rins = False  # RINS has run from several starts (the first window that runs it)
    polished_beside = False  # HiGHS ran with polishing beside it (`local_search.highs_beside_polish`)
    for w in window_ladder(window, an.n):
        now = time.perf_counter()
        remaining = deadline - now
        if remaining < 1.0 and last is not None:
            break
        if started is not None:
            # columns grow with the window: a wider MILP that would overrun the time limit proves
            # nothing in time (ViT at test size, 10-s limit: the unbounded MILP, 4.7x window 24's
            # columns, took 5.8 s of the 5.6 left; the solve ended at 11.9 s)
            growth = (w or an.n) / started[1]
            if remaining < WIDEN_FACTOR * growth * (now - started[0]):
                log(verbose, f"window {w or 'unbounded'} skipped: {remaining:.1f} s left")
                break
        started = (now, w or an.n)
        candidates = [p for p in (warm_plan, *alternates) if p is not None]
        form, warm = None, None
        for k, cand in enumerate(candidates):  # the fastest plan the window's rows accept
            built = Formulation(an, budget_bytes, window=w, warm_plan=cand, backend=backend)
            form = form or built
            vec = built.plan_to_vector(cand)
            bad = built.violations(vec)
            if not bad:
                form, warm, warm_plan = built, vec, cand
                break
            log(verbose, f"warm start {k + 1} violates {len(bad)} rows of the window-{w} MILP; not used")
        if form is None:
            form = Formulation(an, budget_bytes, window=w, warm_plan=None, backend=backend)
        if stop_at_peak is not None:
            form.stop_at_objective = stop_at_peak / 2**20
        if floor is not None and warm is not None and form.objective(warm) <= floor:
            accept(warm_plan, form.objective(warm), len(results))
            if at_floor():
                log(
                    verbose, "the warm start recomputes nothing and runs the fastest implementations: optimal"
                )
                last = (w, None)
                break
        log(
            verbose,
            f"MILP ({what}), recompute window {w if w is not None else 'unbounded'}: {form.n_cols} columns, "
            f"{form.n_rows} rows, built in {form.build_time_s:.2f} s",
        )
        if budget_bytes is not None and warm is not None:
            # the plan RINS finds is a plan of this window's MILP, which starts from it; in the
            # first window, RINS starts from several plans, and the MILP of the best goes on
            solved: list[tuple] = []  # (LP relaxation, its Formulation)
            others = [] if started_rins else [c for c in candidates if c is not warm_plan]
            if not started_rins and form.backend == "highs" and threads >= 2 and deadline - now > EARLY_MIN_S:
                # (one thread: RINS keeps the other core)
                own = form
                if own_cells(an, w, warm_plan) != own_cells(an, w, None):
                    own = Formulation(an, budget_bytes, window=w, backend=backend)
                own_warm = own.plan_to_vector(warm_plan)
                if own.violations(own_warm):
                    own_warm = None  # (HiGHS finds its own incumbent)
                early = local_search.BoundRun(own, own_warm, deadline, mip_gap, 1, verbose)
                early_window = w
                log(verbose, f"HiGHS runs for the bound from now on (window {w}), beside RINS")
            started_rins = True
            if resume:
                log(
                    verbose,
                    "resuming from an earlier solve's plan: no RINS, polishing beside HiGHS' bound run",
                )
            try:
                form, improved = (
                    (form, None)
                    if resume
                    else local_search.rins_from_starts(
                        an,
                        budget_bytes,
                        w,
                        form,
                        warm_plan,
                        others,
                        deadline,
                        threads,
                        verbose,
                        lambda plan, obj: accept(plan, obj, len(results)),
                        solved,
                    )
                )
            except BaseException:
                if early is not None:
                    early.cancel()  # (Ctrl-C in the CLI: no HiGHS left running to the deadline)
                raise
            relaxations = [lp for lp, f in solved if f is form]
            for lp, f in solved:
                # the relaxation's optimum bounds its MILP too; HiGHS' own run may end before its
                # root LP does (ResNet-50 b8 224, Adam, 0.25: stopped in presolve, reported bound
                # 1.466 against the relaxation's 1.687)
                bounds.append((w, lp, f))
                attempts.append({**_attempt(what, w, lp), "status": "lp_relaxation"})
            if improved is not None:
                form = _around(an, budget_bytes, w, form, improved, backend)
                warm_plan = improved
                warm = form.plan_to_vector(improved)
                best_form = form
                if at_floor():
                    last = (w, None)
                    break
            remaining = deadline - time.perf_counter()
            if remaining < 1.0:
                if last is None:
                    last = (w, None)  # RINS took the time: no HiGHS run in this window
                break
            if _lp_proves(relaxations, form, warm, mip_gap):
                close_early()
                # the relaxation already proves the incumbent within the gap asked for in this
                # window: HiGHS would stop at its root; the next window may still do better
                # (resnet18 b2 32 at its no-recompute peak: windows 6, 12, 24, unbounded each
                # ran HiGHS 1-3 s to the plan their relaxations had proven optimal)
                log(
                    verbose,
                    f"window {w}: the LP relaxation proves the plan within {mip_gap:.0%}; no MILP run",
                )
                # (the warm start is a baseline's plan if RINS kept it: the best so far, then)
                if accept(warm_plan, form.objective(warm), len(results)) or (best and best[2] is warm_plan):
                    best_form = form
                last = (w, None)
                continue
        beside = budget_bytes is not None and warm is not None and form.backend == "highs"
        run = None  # the early run, if polishing goes on beside it
        keep = KEEP_EARLY_RUN and early is not None and not early.done.is_set()
        if early is not None and beside and (early.form is form or resume or keep):
            # RINS ended in the early run's MILP (a run that already ended returns at once,
            # polishing nothing), or the early run goes on (KEEP_EARLY_RUN, resuming): polishing
            # goes on beside it whichever MILP it is on, its plans offered to it where they are
            # its points, HiGHS' plans taken up by polishing. Otherwise the early run is stopped
            # (its bound kept: it holds for the window's schedules) and HiGHS runs in RINS' MILP,
            # from its plan, polishing beside it. (Session 65 had kept the early run to the deadline
            # with HiGHS in RINS' MILP once it ended, on a worse plan at kept 1/3, 1.2133 s against
            # 1.2066; then polishing did not take up HiGHS' plans.)
            log(
                verbose,
                "RINS ended in the early run's MILP: polishing goes on beside that run"
                if early.form is form and not resume
                else "polishing goes on beside HiGHS' early run",
            )
            run, early = early, None
        if beside:
            # time mode: HiGHS on this MILP (or the early run's) for the rest of the time,
            # polishing beside it; polishing starts at once, HiGHS' run once the stopped runs
            # have ended (HiGHS may take seconds to notice a stop, 8 s on ResNet-50 b8 224 at 1/3
            # in session 54)
            stop_early()
            ending = [r.done for r in retired if not r.done.is_set()]
            polished_beside = True

            def accept_polished(plan, objective: float, form=form) -> bool:
                nonlocal best_form
                if accept(plan, objective, len(results)):
                    best_form = form
                    return True
                return False

            res = local_search.highs_beside_polish(
                form,
                warm_plan,
                warm,
                deadline,
                mip_gap,
                threads,
                verbose,
                accept_polished,
                run=run,
                after=ending,
                proven=proven_now,
                latest=lambda: None if best is None else (best[2], best[1]),
            )
            if best_form is form:
                warm_plan = best[2]  # (the next window starts from the polished plan)
        else:
            close_early()
            # time mode keeps a share for polishing the incumbent if this MILP runs out of time
            share = 1.0 if budget_bytes is None else 1.0 - POLISH_SHARE
            res = form.solve_milp(
                max(0.5, share * remaining),
                mip_gap=mip_gap,
                threads=threads,
                warm=warm,
                verbose=verbose,
                stall_s=None if budget_bytes is None else STALL_SHARE * share * remaining,
            )
        last = (w, res)
        if res.status == "not_started":  # (the stopped runs it waited for ended at the deadline)
            log(verbose, "HiGHS' last run never started: the runs stopped before it were still ending")
            break
        results.append((w, res, form if run is None else run.form))
        attempts.append(_attempt(what, w, res) if run is None else {**_attempt(what, w, res), "early": True})
        log(
            verbose,
            f"{_BACKEND_NAMES[form.backend]} ({what}, window {w}): {res.status}, objective {res.objective}, bound {res.dual_bound}, "
            f"gap {res.gap}, {res.solve_time_s:.1f} s" + (", polishing beside it" if beside else ""),
        )
        if res.plan is not None and accept(res.plan, res.objective, len(results) - 1):
            best_form = form
            warm_plan = res.plan
        if at_floor():
            break  # no wider window can do better
        if res.status not in ("optimal", "infeasible") and not stopped_proven[0]:
            break  # out of time (or HiGHS gave up): a wider window would not get further
        stopped_proven[0] = False
    close_early()
    found_by = results[best_index][1].status if best is not None and best_index < len(results) else None
    # a plan already proven within the gap asked for is not polished (HiGHS would have stopped
    # there: a run that stalled on it, interrupted, reports time_limit). ResNet-50 at test size, at
    # its no-recompute peak: proven within 0.06 % in 3 s, then polished to the 10-s limit
    within_gap = (proven_gap()[0] or (None, float("inf")))[1] <= mip_gap
    if (
        best is not None
        and budget_bytes is not None
        and found_by in ("time_limit", None)
        and not at_floor()
        and not within_gap
        and not polished_beside
    ):
        # (an optimal MILP's plan cannot be improved within its window)
        local_search.polish(
            best_form, best[2], deadline, threads, verbose, lambda plan, obj: accept(plan, obj, best_index)
        )
        remaining = deadline - time.perf_counter()
        if remaining >= FINAL_RUN_MIN_S:
            # polishing stopped improving with time to spare: HiGHS again on the same MILP, from
            # the polished plan, for the rest of the time (its bound tightens the proven gap; it
            # may still find a better plan)
            res = best_form.solve_milp(
                remaining,
                mip_gap=mip_gap,
                threads=threads,
                warm=best_form.plan_to_vector(best[2]),
                verbose=verbose,
            )
            record(
                best_form.window,
                res,
                best_form,
                {"after_polishing": True},
                f"{_BACKEND_NAMES[backend]} again after polishing",
            )
    proven, widest, own = proven_gap()
    return _LadderResult(best[:3] if best else None, last, attempts, proven, widest, own)


def _lp_proves(relaxations: list, form: Formulation, warm, mip_gap: float) -> bool:
    """Whether a solved LP relaxation of `form` bounds the warm start's objective within
    `mip_gap` (relative, as HiGHS' mip_rel_gap)."""
    if warm is None:
        return False
    obj = form.objective(warm)
    bound = max((lp.objective for lp in relaxations if lp.objective is not None), default=None)
    return bound is not None and obj - bound <= mip_gap * abs(obj) + 1e-12


def _attempt(what: str, window: int | None, res: MilpResult) -> dict:
    """One backend run, as `meta["milp_attempts"]` records it (RINS' LP relaxations too, with
    status "lp_relaxation": their objective bounds the same MILP)."""
    return {
        "minimise": what,
        "window": window,
        "status": res.status,
        "objective": res.objective,
        "bound": res.dual_bound,
        "seconds": round(res.solve_time_s, 2),
        "cols": res.n_cols,
        "rows": res.n_rows,
    }


def _around(an, budget_bytes, window, form: Formulation, plan: Plan, backend: str) -> Formulation:
    """The window's MILP built around `plan` (found by RINS in `form`), if it is smaller than
    `form` and its rows accept the plan; else `form`. A MILP gets columns of its own where the
    plan it is built around departs from the window's rule, so one built around RINS' start may
    be much larger than one around the plan RINS ended with: ResNet-50 b8 224, kept gradients,
    0.4: 19,247 integer columns around a 2.05-s start, 11,714 around RINS' 1.575-s plan. HiGHS'
    main run on the larger one stopped (7 s) before its root LP was done (its bound: the trivial
    one); on the smaller one its root bounds the plan within 3.8 % in 7 s."""
    built = Formulation(an, budget_bytes, window=window, warm_plan=plan, backend=backend)
    if built.n_cols < form.n_cols and not built.violations(built.plan_to_vector(plan)):
        return built
    return form


def _covers(wide: int | None, window: int | None) -> bool:
    """Whether window `wide`'s schedules include window `window`'s (None: unbounded)."""
    return wide is None or (window is not None and wide >= window)


def window_ladder(window, n: int) -> list[int | None]:
    """Recompute windows to try in turn: 'auto' widens 6 -> 12 -> 24 -> unbounded; an int or
    None is that window alone. Windows covering the whole graph are the unbounded formulation."""
    ladder = list(AUTO_WINDOWS) if window == "auto" else [window]
    out: list[int | None] = []
    for w in ladder:
        w = None if w is None or w >= n else int(w)
        if w not in out:
            out.append(w)
        if w is None:
            break
    return out
