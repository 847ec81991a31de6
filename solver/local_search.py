"""Improving a plan inside one MILP: RINS (relaxation-induced neighbourhood search, from one or
several start plans) and polishing (sub-MILPs over bands of stages or nodes, beside or after
HiGHS' own run). Each helper takes the `Formulation` to search in and an `accept(plan,
objective)` that replays a candidate with the simulator and keeps it; `solver.milp` decides when
each runs and for how long."""

from __future__ import annotations

import time
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait

import numpy as np

from solver.formulation import Formulation, MilpResult, own_cells
from solver.plan import Plan
from solver.progress import log

# polishing: the band of backward stages each sub-MILP may change, and its time limit
POLISH_SPAN = 16
POLISH_SUB_LIMIT_S = 5.0
# ... and the node bands: this many consecutive nodes' columns at every stage, each sub-MILP's limit
POLISH_NODES = 24
POLISH_NODE_LIMIT_S = 5.0
# the relative gap each band's sub-MILP is solved to (of the whole step time)
POLISH_SUB_GAP = 1e-4
# the order in which each pass visits the bands (each family, stage and node bands, by the
# recompute work of the plan inside a band, the most first): "by_work" (both families mixed, by
# that work), "stages_first" (every stage band, then every node band: the order until session 71),
# "alternate" (a stage band, a node band, and so on). 60-s solves (benchmarks/results/session71):
# ResNet-50 b8 224 (session-65 problems), kept 0.33: stages_first 1.2320-1.2321 s in four runs,
# by_work 1.2275-1.2279 in four of five (1.2339 in the fifth; the deciding band, stages 112-127,
# ends at the deadline or not), gap 1.4 -> 1.1 %, alternate 1.2346 in three; Adam 0.25 1.2783 ->
# 1.2764 by work, the README table's other rows the same plans. But the 356-node synthetic DAG at
# 0.4: stages_first 1.5183-1.5184 (1.8 %), by_work 1.5254-1.5261 (2.3 %), alternate 1.5175 (two
# runs each); its other rows and the smaller DAGs' the same or better by work (176 nodes at 0.33
# 0.8 -> 0.4 %) but 51 nodes at 0.8 (1.016 -> 1.023, within 1 % both). Which band moves the plan
# most, and whether it ends before the deadline, depends on the plan the bands before it left.
POLISH_ORDER = "by_work"
# ... and after each improvement, the bands left in the pass are ranked again on the improved
# plan (their recompute work moves with it). 60 s, with by_work: ResNet-50 b8 224 kept 0.33
# 1.2275-1.2279 s -> 1.2275, 1.2238, 1.2238 (0.77 %: proven within 1 %); the 356-node synthetic
# DAG at 0.4 1.5254-1.5261 -> 1.5167, 1.5195; kept 0.4 the same plan, Adam 0.25 1.078 (was 1.079
# of no recompute's time), the README table's other rows the same (benchmarks/results/session71)
POLISH_RERANK = True
# bands polished at once, each HiGHS run in its own thread on one core (HiGHS' branch and bound is
# mostly serial; highspy releases the GIL and keeps a scheduler per thread). Four node-band
# sub-MILPs of ResNet-50 b8 224 at 1/3: 10.9 s one after another with 2 threads each, 7.6 s two
# at a time
POLISH_WORKERS = 2
# polishing beside HiGHS goes on from faster plans found beside it (`highs_beside_polish`)
ADOPT = True
# (beside HiGHS' run polishing has one thread, one band at a time. Two bands at once beside it,
# session 72, 60 s: ResNet-50 b8 224 kept 0.33 1.2317 s in three runs against 1.2238-1.2264, the
# 356-node synthetic DAG at 0.4 1.5142 twice against 1.5254 but at 0.33 1.5877 against 1.5580:
# more bands end, on another path; not adopted)
# time mode: RINS (relaxation-induced neighbourhood search) before each window's MILP: the
# share of the remaining time its LP relaxation may take, each sub-MILP's time limit, and how
# many rounds (each re-fixes what agrees with the new incumbent) it may run from one start alone
# (from several: one round each, `rins_from_starts`)
RINS_LP_SHARE = 0.3
RINS_SUB_LIMIT_S = 20.0
RINS_ROUNDS = 4
# ... and the gap each round's sub-MILP is solved to (of the neighbourhood's own optimum): a round
# finds its plan early and then proves it (ResNet-50 b8 224, kept gradients, 0.33, session 68: the
# first start's round found 1.2830 s at 3.9 s, 0.65 % from its neighbourhood's bound, and spent 16
# s more proving it; the second start's round 1.2533 at 6.0 s, 1.2471 at 13.3 s). At 1 % the time
# left over goes to the later starts (with RINS_STARTS_SHARE 0.7: that problem 1.2646 -> 1.2374
# s in 60 s, gap 4.0 -> 1.9 %; kept 0.5 1.1353 -> 1.1342, Adam 0.25 1.2955 -> 1.2840, Adam 0.33
# the same, kept 0.4 1.1755 -> 1.1805, all proven within 1 %; benchmarks/results/session68)
RINS_SUB_GAP = 0.01
# ... a round after a start's first may take at most this share of the time left: polishing
# beside HiGHS gets the rest (ResNet-50 b8 224, session-21 problem, kept gradients, 0.33: the
# second round from the winning start's plan took the last 16 s and found nothing; polishing, which
# took 1.7175 -> 1.6707 s in session 40, never ran)
RINS_LATER_SHARE = 0.5
# ... in the first window, one round of RINS from each of up to RINS_STARTS fitting plans (the
# fastest that the window's rows accept; each in its own MILP, built around it) in this share of
# the remaining time, before the rounds go on from the best. Where RINS ends depends on where it
# starts, not on how fast the start is: ResNet-50 b8 224 (session-21 problems), RINS from four
# multilevel plans: kept 0.4 1.578 / 1.642 / 1.617 / 1.638 s (the fastest start gave the best),
# Adam 0.33 1.657 / 1.563 / 1.560 / 1.738 s. The share was 0.5 until session 68: ResNet-50 b8 224
# (session-65 problem), kept 0.33, the second start's round, the one that leads to the best plans,
# had 6-8 s of a minute and found nothing; with 0.7 (and RINS_SUB_GAP) 11.8 s, 1.6865 -> 1.2496
RINS_STARTS = 3
RINS_STARTS_SHARE = 0.7
# ... a further start only with this many seconds left per start
RINS_START_MIN_S = 3.0
# ... and only if its MILP has at most this many times the own columns (`own_cells`) of the
# fastest start's: building it and solving its LP relaxation grow faster than its size (356-node
# synthetic DAG at 0.6: segment_sweep's plan, 6.1 times, 152k columns against 26.5k, built in 8
# s, its LP not solved in the 5.8 s it had). On ResNet-50 b8 224 (Adam step in the backward, 0.5)
# a start of 2.1 times once led to the best plan (session-21 problem: 1.0728; 1.0787 with it
# skipped at 1.5), but on the session-65 problems no start of 2-3 times helped: kept gradients at
# 0.33, a third start of 2.2 times took 11.5 s for nothing once its LP was given the time it needs
# (3.0 -> 2.0: 1.2422 -> 1.2387 s in 60 s; every other frontier row skips no start; session 69)
RINS_START_SIZE_RATIO = 2.0
# ... and a further start's LP relaxation may take at most this many times the fastest start's
# took (counted as at least 1 s), times its MILP's size ratio (as above; LP time grows faster
# than columns): past that its round is skipped (ResNet-50 b8 224, gradients kept, 0.33, session
# 40: the third start's LP took 6.1 s against 1.1 s, and its round found nothing in the 2.3 s left
# to it). Session 69, same row: the second start (1.7 times) needs 2.0-2.7 s against 0.8-0.9 s;
# without the size ratio its cap was 3 s, and one run in three it ran out and its round, the one
# that leads to the best plans, was skipped (1.2643 s against 1.2321-1.2374)
RINS_START_LP_RATIO = 3.0


def rins_from_starts(
    an, budget_bytes, window, form, plan, others, deadline, threads, verbose, accept, solved, on_winner=None
) -> tuple[Formulation, Plan | None]:
    """RINS from `plan` in `form`, and first from up to RINS_STARTS - 1 of `others` (fitting
    plans, fastest first; each in a window-`window` MILP built around it, if its rows accept it):
    one round from each in RINS_STARTS_SHARE of the time left; the best plan a round found is
    then left to polishing, in its MILP (if no round beat `plan`, the rest of the rounds run
    from `plan`). (One MILP
    holding every start has more columns, and RINS' neighbourhoods in it are wider: ResNet-50 b8
    224, Adam step in the backward, at 0.25, RINS from multilevel's plan found 1.674 s in 6.4 s in
    the MILP around it, nothing in 7 s in the MILP around three plans.) Returns (the MILP of the
    plan RINS ended with, that plan, or None if RINS found nothing better than the best so far);
    every LP relaxation solved is appended to `solved` as (its MilpResult, its Formulation).
    on_winner(MILP, plan): called when a start other than `plan` won (`solver.milp` moves HiGHS'
    bound run to its MILP)."""
    starts = [(form, plan, 1.0)]  # (MILP, start plan, its own columns / the fastest start's)
    size = own_cells(an, window, plan)
    for other in others:
        if len(starts) >= RINS_STARTS or deadline - time.perf_counter() < RINS_START_MIN_S * (
            len(starts) + 1
        ):
            break
        ratio = own_cells(an, window, other) / max(1, size)
        if ratio > RINS_START_SIZE_RATIO:
            log(verbose, f"a RINS start skipped: its MILP would be {ratio:.1f} times the fastest start's")
            continue
        built = Formulation(an, budget_bytes, window=window, warm_plan=other, backend=form.backend)
        if not built.violations(built.plan_to_vector(other)):
            starts.append((built, other, ratio))
    if len(starts) == 1:
        found: list[MilpResult] = []
        got = rins(form, plan, deadline, threads, verbose, accept, relaxations=found)
        solved.extend((lp, form) for lp in found)
        return form, got
    log(verbose, f"RINS from {len(starts)} starts")
    phase_end = time.perf_counter() + RINS_STARTS_SHARE * (deadline - time.perf_counter())
    winner = None  # (MILP, plan) of the last start whose round beat every other
    first_lp = None  # the fastest start's LP relaxation
    # a round's plan wins only if it is faster than the fastest start itself: `accept` keeps any
    # plan that beats the plans found so far, which need not include the start (356-node DAG at
    # 0.6: the greedy start's round found nothing in its share, the next start's round found
    # 1.5584 s against greedy's 1.4806, RINS went on from there and the solve fell back to greedy)
    bar = form.objective(form.plan_to_vector(plan))
    for k, (f, start, ratio) in enumerate(starts):
        now = time.perf_counter()
        if deadline - now < 2.0:
            break
        # (the LP takes what it needs, a further start's at most RINS_START_LP_RATIO times the
        # fastest start's, times its size ratio; the round, what is left of this start's share)
        seconds = RINS_LP_SHARE * (deadline - now)
        if first_lp is not None:
            seconds = min(seconds, RINS_START_LP_RATIO * max(first_lp.solve_time_s, 1.0) * max(ratio, 1.0))
        lp = relaxation(f, seconds, threads, verbose)
        if lp is None:
            continue
        solved.append((lp, f))
        got = rins(
            f, start, now + (phase_end - now) / (len(starts) - k), threads, verbose, accept, rounds=1, lp=lp
        )
        if f is form:
            first_lp = lp
        if got is not None and f.objective(f.plan_to_vector(got)) < bar - 1e-9:
            winner = (f, got)
    if winner is None:
        if first_lp is None or deadline - time.perf_counter() < 2.0:
            return form, None
        # no start's round found a plan faster than the fastest start in its share: RINS goes on
        # from the fastest start with the rest of the time, as it would from that start alone
        # (356-node synthetic DAG at 0.33: its neighbourhood needs 8 s, and each start's round had 6)
        log(verbose, "no start's round beat the fastest start: RINS goes on from the fastest start")
        return form, rins(form, plan, deadline, threads, verbose, accept, lp=first_lp, first=False)
    f, got = winner
    if on_winner is not None and f is not form:
        on_winner(f, got)
    # no further RINS round from the winner's plan: polishing (beside HiGHS) takes it on. ResNet-50
    # b8 224 (session-65 problems), 60 s, one run each, against rounds from it (session 69): kept
    # 0.33 1.2325 -> 1.2320 s (its next round took 9.4 s for 0.3 %; polishing reached 1.2324 by
    # 44 s), kept 0.5 1.1342 -> 1.1331, Adam 0.25 1.2840 -> 1.2792, Adam 0.5 1.1374 -> 1.1371, kept
    # 0.4 and Adam 0.33 the same plans
    return f, got


def relaxation(form: Formulation, seconds: float, threads: int, verbose: bool) -> MilpResult | None:
    """`form`'s LP relaxation solved within `seconds` (RINS' start), or None if not optimal."""
    lp = form.solve_milp(seconds, threads=threads, relax=True)
    if lp.x is None or lp.status != "optimal":
        log(verbose, f"RINS: LP relaxation {lp.status} in {lp.solve_time_s:.1f} s; skipped")
        return None
    log(verbose, f"RINS: LP relaxation {lp.objective:.4f} in {lp.solve_time_s:.1f} s")
    return lp


def rins(
    form: Formulation,
    plan: Plan,
    deadline: float,
    threads: int,
    verbose: bool,
    accept,
    relaxations=None,
    rounds: int = RINS_ROUNDS,
    lp: MilpResult | None = None,
    first: bool = True,
) -> Plan | None:
    """Relaxation-induced neighbourhood search (Danna, Rothberg & Le Pape 2005) from `plan`.

    Solves the LP relaxation of `form` once, then the MILP with every integer column fixed
    where the relaxation agrees with the incumbent; repeats with the new incumbent while it
    improves. HiGHS runs RINS itself, but only after its root cut rounds: on ResNet-50 b8 224
    at 0.33 (window 6) those took 42 s before its RINS took the multilevel plan from +60 % to
    +35 % predicted; the bare LP takes 2 s and the neighbourhood MILP 4 s to reach +38 %.
    Returns the best plan accepted (`accept(plan, objective)` replays and keeps it), or None.
    relaxations: a list the solved LP relaxation is appended to (its objective bounds the MILP).
    rounds: at most this many; lp: `form`'s LP relaxation, if solved before (else solved here);
    first: the first round is this start's first (later rounds take RINS_LATER_SHARE of the time
    left at most)."""
    remaining = deadline - time.perf_counter()
    if lp is None:
        if remaining < 2.0:
            return None
        lp = relaxation(form, RINS_LP_SHARE * remaining, threads, verbose)
        if lp is None:
            return None
        if relaxations is not None:
            relaxations.append(lp)
    integer = np.flatnonzero(np.asarray(form.md.integer))
    x = form.plan_to_vector(plan)
    current = form.objective(x)
    log(verbose, f"RINS from {current:.4f}")
    best = None
    for rnd in range(rounds):
        remaining = deadline - time.perf_counter()
        if remaining < 1.0:
            break
        agree = integer[np.abs(lp.x[integer] - x[integer]) < 1e-6]
        fixed = {int(c): float(round(x[c])) for c in agree}
        share = 1.0 if first and rnd == 0 else RINS_LATER_SHARE
        left = deadline - time.perf_counter()  # (at the call: fixing the columns took a few ms)
        res = form.solve_milp(
            min(share * left, RINS_SUB_LIMIT_S), mip_gap=RINS_SUB_GAP, threads=threads, warm=x, fixed=fixed
        )
        if res.plan is None or res.objective is None or res.objective >= current - 1e-9:
            break
        if not accept(res.plan, res.objective):
            break
        log(
            verbose,
            f"RINS round {rnd + 1} ({len(integer) - len(agree)} of {len(integer)} columns free, "
            f"{res.solve_time_s:.1f} s): {current:.4f} -> {res.objective:.4f}",
        )
        best = plan = res.plan
        x = form.plan_to_vector(plan)
        current = res.objective
    return best


# HiGHS' run for the bound (`BoundRun`, beside RINS and polishing): branching on pseudo-costs from
# the first node, without strong branching to make them reliable first. ResNet-50 b8 224
# (calibrated problem, kept gradients, 1/3), the window-6 MILP around a 0.9601-s plan, 60 s on one
# thread: bound 0.8967 with the solve's own options, 0.9066 with this and no heuristics. No
# heuristics (effort 0) let a 24-s run beside polishing branch where it had stayed at its root
# (gap 7.2 -> 5.8 %), but HiGHS' own heuristics found the best plan elsewhere (Adam step in the
# backward, 0.33: 1.5743 s against polishing's 1.5806), and since session 52 the run starts beside
# RINS with time for them: they stay (session 52's rows, benchmarks/results/session52). Session 72
# (kept 0.33, 60 s): the root's heuristics take 47k of 75k LP iterations and ~24 s and find
# nothing, but with them off (effort 0 alone leaves them on; mip_heuristic_run_rens, _rins,
# _root_reduced_cost, _feasibility_jump false) the root ends at ~19 s and its branching lifts the
# bound only 1.2144 -> 1.2150, while the busier thread slows RINS beside it: 1.2279 and 1.2439 s
# against 1.2238-1.2264 (benchmarks/results/session72)
BOUND_OPTIONS = {"mip_pscost_minreliable": 0}


class BoundRun:
    """HiGHS on `form` from `warm` until `deadline`, in a thread of its own, for its dual bound
    while plans are found beside it: `offer(plan, objective)` hands it each plan found elsewhere
    that is a plan of `form` (the best so far becomes HiGHS' incumbent when it next asks for
    one: it prunes by it, and stops once its bound proves that plan within `mip_gap`).
    `result()` waits for the run and returns it (a `MilpResult`); `cancel()` ends it early.
    after: `threading.Event`s; HiGHS starts only once every one is set (cancelled runs on other MILPs
    still winding down: HiGHS notices a cancel only at points of its own, 9 s after it in its root
    on ResNet-50 b8 224 at 1/3 in session 54, and the caller goes on meanwhile); a run cancelled
    or out of time before then returns no plan and no bound."""

    def __init__(
        self,
        form: Formulation,
        warm,
        deadline: float,
        mip_gap: float,
        threads: int,
        verbose: bool,
        after=None,
    ) -> None:
        import threading

        self.form = form
        self.done = threading.Event()
        self._cancel = threading.Event()
        self._lock = threading.Lock()
        self._pending = None  # the best offered plan's vector HiGHS has not taken yet
        # the best objective offered (or the warm start's; none: HiGHS finds its own incumbent)
        self.best = form.objective(warm) if warm is not None else float("inf")
        self._out: dict = {}
        self.started = not after  # HiGHS has started (not while it waits for `after`)
        self.ended_at: float | None = None  # when the run ended (perf_counter)
        # (vector, objective) of the best plan HiGHS found itself, better than every plan offered
        # to it (its heuristics or its tree), not yet taken by `take_found`
        self._found = None

        def run() -> None:
            try:
                while not self.started:
                    if all(event.is_set() for event in after):
                        self.started = True
                    elif self._cancel.is_set() or time.perf_counter() >= deadline:
                        self._out["res"] = not_started(form)
                        return
                    else:
                        time.sleep(0.05)
                self._out["res"] = form.solve_highs(
                    max(0.5, deadline - time.perf_counter()),
                    mip_gap=mip_gap,
                    threads=threads,
                    warm=warm,
                    verbose=verbose,
                    cancel=self._cancel,
                    incumbent=lambda: self.best if self.best < float("inf") else None,
                    options=BOUND_OPTIONS,
                    supply=self._take,
                    found=self._found_one,
                )
            except BaseException as exc:  # (raised again in the caller's thread)
                self._out["error"] = exc
            finally:
                self.ended_at = time.perf_counter()
                self.done.set()

        self._thread = threading.Thread(target=run, name="monet-opt-highs", daemon=True)
        self._thread.start()

    def offer(self, plan: Plan, objective: float) -> bool:
        """Hand HiGHS `plan` if it beats the best offered and is a plan of this MILP (True)."""
        if objective >= self.best - 1e-12 or self.done.is_set():
            return False
        x = self.form.point_of(plan, objective)
        if x is None:
            return False
        with self._lock:
            self._pending = x
            self.best = objective
        return True

    def _found_one(self, x) -> None:
        objective = self.form.objective(x)
        with self._lock:
            if objective < self.best - 1e-9:
                self.best = objective
                self._found = (x, objective)

    def take_found(self) -> tuple | None:
        """(plan, objective) of the best plan HiGHS found itself since the last call, if it beats
        every plan offered to it; else None."""
        with self._lock:
            found, self._found = self._found, None
        return None if found is None else (self.form.vector_to_plan(found[0]), found[1])

    def _take(self):
        with self._lock:
            x, self._pending = self._pending, None
        return x

    def cancel(self) -> None:
        self._cancel.set()

    def settled(self) -> bool:
        """The run has ended and settled its MILP (optimal or infeasible), or failed (an error for
        `result` to raise). Not a run out of HiGHS' own time: its clock is the system's, and a
        jump in it ended a 60-s solve's run at 34 s of 54 (ResNet-50 b8 224 kept 0.33, session 72:
        HiGHS' timer read 53.8 s; polishing beside it stopped with it, at 1.2346 s where the
        other runs went on to 1.2238)."""
        if not self.done.is_set():
            return False
        res = self._out.get("res")
        return "error" in self._out or (res is not None and res.status in ("optimal", "infeasible"))

    def result(self) -> MilpResult:
        self._thread.join()
        if "error" in self._out:
            raise self._out["error"]
        return self._out["res"]


def not_started(form: Formulation) -> MilpResult:
    """The result of a run that never started: no plan, no bound (not recorded as a run)."""
    return MilpResult(None, "not_started", None, None, None, 0.0, 0.0, form.n_cols, form.n_rows)


def highs_beside_polish(
    form: Formulation,
    plan: Plan,
    warm,
    deadline: float,
    mip_gap: float,
    threads: int,
    verbose: bool,
    accept,
    run: BoundRun | None = None,
    after=None,
    proven=None,
    latest=None,
) -> MilpResult:
    """HiGHS on `form` from `warm` (the vector of `plan`) until `deadline`, in a thread of its
    own (a `BoundRun`; or `run`, one already running on a MILP that holds `form`'s plans), while
    `polish` improves `plan` in `form` beside it with one sub-MILP at a time, handing HiGHS each
    plan it keeps; polishing stops when HiGHS settles the MILP (optimal) or at the deadline (not
    when HiGHS' own clock says its time is up: `BoundRun.settled`). Returns HiGHS' run;
    `accept(plan, objective)` receives what polishing finds.

    One after the other, HiGHS' run was cut on a stall before its root node was done (ResNet-50
    b8 224, kept gradients, 0.4: 5.7 s, bound below its LP relaxation's) and polishing took the
    rest; HiGHS needs ~10 s for its root bound there (3.4 % against 6.3 %). Its branch and bound
    is mostly serial: beside one polishing worker it reached the same bound in 10 s as alone.
    after: as `BoundRun`'s (polishing starts at once, HiGHS once they are set).
    proven(): True once the best plan is proven within `mip_gap` by bounds from elsewhere (HiGHS'
    early run on the window's own MILP): polishing stops and HiGHS' run is stopped, as it stops
    itself once its own bound proves that. (ResNet-50 b8 224, kept gradients, 0.33, 180 s: the
    early run's 1.2149 s proved the polished 1.2241-s plan within 0.8 % at 128 s; HiGHS here, its
    bound 1.1790, polished on to the deadline.)
    latest(): (plan, objective) of the best plan kept so far, from anywhere, or None. Polishing
    goes on from a plan HiGHS finds itself, or from `latest()`'s, where it beats polishing's own
    (ResNet-50 b8 224, kept gradients, 0.4: HiGHS' early run found 1.1874 s at its root while
    polishing, which never saw it, stayed at 1.2120 s for its last 37 s)."""
    if run is None:
        run = BoundRun(form, warm, deadline, mip_gap, threads, verbose, after=after)

    def accept_offer(plan: Plan, objective: float) -> bool:
        if accept(plan, objective):
            run.offer(plan, objective)
            return True
        return False

    proven_once = [False]  # proven() said so once

    def adopt(current: float):
        # HiGHS' own plans are kept as they come (polishing may go on from them), then the best
        # kept anywhere (`latest`: another run's) if it beats polishing's and is a plan of `form`
        found = run.take_found()
        if found is not None and accept(*found) and found[1] < current - 1e-9:
            if run.form is form or form.point_of(*found) is not None:
                return found
        if latest is not None:
            best = latest()
            if best is not None and best[1] < current - 1e-9 and form.point_of(*best) is not None:
                return best
        return None

    def stop() -> bool:
        # (HiGHS out of its own time before the deadline: polishing goes on to the deadline)
        if run.settled() or proven_once[0]:
            return True
        if proven is not None and proven():
            proven_once[0] = True
            run.cancel()
            return True
        return False

    try:
        polish(form, plan, deadline, 1, verbose, accept_offer, stop=stop, adopt=adopt if ADOPT else None)
    except BaseException:
        run.cancel()  # (Ctrl-C in the CLI: no wait for HiGHS' deadline)
        raise
    res = run.result()
    early = deadline - (run.ended_at or deadline)
    if res.status == "time_limit" and early > 2.0 and not proven_once[0]:
        log(
            verbose,
            f"HiGHS' run ended on its own time limit {early:.0f} s before the deadline; polishing went on",
        )
    return res


def polish(
    form: Formulation,
    plan: Plan,
    deadline: float,
    threads: int,
    verbose: bool,
    accept,
    stop=None,
    adopt=None,
) -> None:
    """Large-neighbourhood search on a time-mode incumbent, until `deadline`.

    HiGHS can spend a whole time limit in root cut rounds on a hard budget (ResNet-50 b8 224
    at 0.33: 50 s at node 0, incumbent never improved). Here the same MILP is solved again with
    every integer column fixed to the incumbent except those of one neighbourhood; each pass
    visits every neighbourhood, and passes repeat while one improves:
    - stage bands: the columns of POLISH_SPAN backward stages and the forward choices of the
      nodes they may recompute, sliding by half a span (what one stretch of the backward does);
    - node bands: every column of POLISH_NODES consecutive nodes, at every stage (their forward
      implementations, and where each stage holds, keeps or recomputes them), sliding by half a
      band. A better plan often changes how one block's tensors are held across the whole
      backward: stage bands alone stopped at local optima (ResNet-50 b8 224 kept gradients at
      1/3: 1.6853 s after 54 s of stage bands, 1.6876 -> 1.6649 s in 50 s of node bands, 1.6542 s
      in 150 s, below a 600-s solve's 1.6573).
    Within each family, bands that recompute the most are visited first (the families in
    `POLISH_ORDER`): there is the most to win, and time may run out. A pass that improves nothing,
    with every band's sub-MILP solved to optimality, proves the plan optimal in every band of that
    size: the bands then double (while a node band fits in the graph) and polishing goes on
    (356-node synthetic ResNet at 0.33: no 16-stage or 24-node band improved RINS' plan, each
    solved in 0.3-0.7 s; doubled bands did, 1.5877 -> 1.5839 s in 40 s). Every improved plan is a
    plan of `form`'s MILP (its dual bound still bounds it). Up to POLISH_WORKERS bands are solved
    at once, each HiGHS run in a thread of its own on one core; a band started before another
    band's improvement is kept only if it beats that.
    `accept(plan, objective)` replays and keeps a plan; `stop()`, if given, ends polishing early
    (no further band starts once it returns True); `adopt(objective)`, if given, returns a plan
    of `form` faster than the objective given, found elsewhere, and its objective (polishing goes
    on from it), or None."""
    an = form.an
    integer = np.flatnonzero(np.asarray(form.md.integer))
    x = form.plan_to_vector(plan)
    current = form.objective(x)
    # HiGHS in threads of its own, one core each (another backend: one band at a time)
    workers = max(1, min(POLISH_WORKERS, threads)) if form.backend == "highs" else 1
    sub_threads = 1 if workers > 1 else threads
    improved = True
    passes = 0
    scale = 1  # band sizes, in multiples of POLISH_SPAN stages and POLISH_NODES nodes
    proved = False  # every sub-MILP of the last pass solved to optimality
    while True:
        if stop is not None and stop():
            return
        if not improved:
            # a pass without a better plan, every band's sub-MILP solved to optimality: the plan
            # is optimal in every band of this size; wider bands may still improve it (356-node
            # synthetic ResNet at 0.33: every 16-stage and 24-node band optimal in 0.3-0.7 s, RINS'
            # plan 11 % above the LP bound)
            if not proved or POLISH_NODES * scale * 2 > an.n:
                return
            scale *= 2
            log(
                verbose,
                f"polish: every band optimal; bands of {POLISH_SPAN * scale} stages, {POLISH_NODES * scale} nodes",
            )
        improved = False
        proved = True
        passes += 1
        span, band_nodes = POLISH_SPAN * scale, POLISH_NODES * scale
        # (work, kind, band, sub-MILP limit); the work is filled in by `_ranked`
        hoods: list[tuple[float, str, range, float]] = []
        step = max(1, band_nodes // 2)
        for a in range(0, an.n, step):
            hoods.append((0.0, "nodes", range(a, min(an.n, a + band_nodes)), POLISH_NODE_LIMIT_S))
        step = max(1, span // 2)
        for a in range(0, an.T, step):
            hoods.append((0.0, "stages", range(a, min(an.T, a + span)), POLISH_SUB_LIMIT_S))
        # in POLISH_ORDER (see there). Until session 71 every stage band first, then every node
        # band: small sub-MILPs first (quick steps from a rough plan), then moves stage bands
        # cannot make; each family by recompute work. Measured on ResNet-50
        # b8 224, 60-s solves, against stage bands alone: never worse, kept gradients 0.4 1.5763
        # -> 1.5665 s, Adam in the backward 1/3 1.7696 -> 1.7583; node bands first lost at 1/3
        # and at Adam 0.25 (1.8213 -> 1.8396: their 5-s sub-MILPs took the time)
        todo = _ranked(hoods, an, plan)[::-1]  # (popped from the end: in order)
        running: dict = {}  # future -> its neighbourhood
        with ThreadPoolExecutor(workers) as pool:
            while todo or running:
                if stop is not None and stop():
                    todo.clear()
                better = adopt(current) if adopt is not None else None
                if better is not None:
                    # a faster plan found elsewhere (HiGHS beside polishing): polishing goes on
                    # from it, the bands left in this pass around it
                    log(verbose, f"polish: on from {better[1]:.4f}, found beside it (was {current:.4f})")
                    plan, current = better
                    x = form.plan_to_vector(plan)
                    improved = True
                while todo and len(running) < workers:
                    hood = todo.pop()
                    job = _start_band(pool, form, x, integer, hood, span, deadline, sub_threads)
                    if job is None:
                        todo.clear()  # out of time
                        break
                    running[job] = hood
                if not running:
                    break
                done, _ = wait(running, return_when=FIRST_COMPLETED)
                for job in done:
                    _work, kind, band, _limit = running.pop(job)
                    res = job.result()
                    proved = proved and res.status == "optimal"
                    # (a band started before another band's improvement still holds a whole
                    # plan: kept if it beats the current one)
                    found = res.plan is not None and res.objective is not None
                    if found and res.objective < current - 1e-9 and accept(res.plan, res.objective):
                        log(
                            verbose,
                            f"polish pass {passes}, {kind} {band.start}-{band.stop - 1}: {current:.4f} -> {res.objective:.4f}",
                        )
                        plan = res.plan
                        x = form.plan_to_vector(plan)
                        current = res.objective
                        improved = True
                        if POLISH_RERANK and todo:
                            todo = _ranked(todo, an, plan)[::-1]
        if deadline - time.perf_counter() < 1.0:
            return


def _ranked(hoods: list, an, plan: Plan) -> list:
    """The neighbourhoods (work, kind, band, limit), each with the recompute time `plan` spends
    inside its band (a node band: its nodes' recomputations at every stage; a stage band: every
    recomputation in its stages), in the order a pass visits them (`_band_order`)."""
    recomputed = [0.0] * an.n  # recompute time of each node in the plan, over all stages
    work = [0.0] * an.T  # recompute time of each stage
    for s, st in enumerate(plan.stages):
        for i, m, g in st.recompute:
            cost = an.entry_time(an.bw[s], i, m, g, plan.impl[i])
            recomputed[i] += cost
            work[s] += cost
    return _band_order(
        [
            (sum((recomputed if kind == "nodes" else work)[k] for k in band), kind, band, limit)
            for _w, kind, band, limit in hoods
        ]
    )


def _band_order(hoods: list) -> list:
    """The neighbourhoods (work, kind, band, limit) in the order a pass visits them (POLISH_ORDER)."""
    if POLISH_ORDER == "by_work":
        return sorted(hoods, key=lambda h: -h[0])
    stages = sorted((h for h in hoods if h[1] == "stages"), key=lambda h: -h[0])
    nodes = sorted((h for h in hoods if h[1] != "stages"), key=lambda h: -h[0])
    if POLISH_ORDER == "stages_first":
        return stages + nodes
    if POLISH_ORDER != "alternate":
        raise ValueError(f"POLISH_ORDER {POLISH_ORDER!r}: stages_first, by_work or alternate")
    order = []
    for k in range(max(len(stages), len(nodes))):
        order.extend(family[k] for family in (stages, nodes) if k < len(family))
    return order


def _start_band(
    pool, form: Formulation, x: np.ndarray, integer, hood, span: int, deadline: float, threads: int
):
    """Submit one polishing neighbourhood's sub-MILP, every integer column outside it fixed to
    x; None when less than a second is left."""
    _work, kind, band, limit = hood
    remaining = deadline - time.perf_counter()
    if remaining < 1.0:
        return None
    if kind == "nodes":
        free = form.node_columns(band)
    else:
        ts = [form.an.bw[s] for s in band]
        free = form.band_columns(band, range(max(0, min(ts) - span), max(ts) + 1))
    fixed = {int(c): float(round(x[c])) for c in integer if c not in free}
    return pool.submit(
        form.solve_milp, min(remaining, limit), mip_gap=POLISH_SUB_GAP, threads=threads, warm=x, fixed=fixed
    )
