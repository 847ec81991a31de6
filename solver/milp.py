"""The exact strategy: a mixed-integer program over one stage per backward node, solved by HiGHS.

Formulation (MONeT-style grid; n nodes in topological order, backward stages
s = 0..T-1 in reverse topological order, stage s runs the backward of t_s):

  k[i,m]    node i runs implementation m in the forward (one-hot)
  F[i,m]    = A[0,i,m]: i computed with grad=True in the forward (state kept), F <= k
  S[s,i]    the handle of i is held when stage s starts (i <= t_s); S[0,i]: kept
            after the forward. For a base storage, S=1 also whenever a state or a
            view holds the storage (holding the handle then costs nothing), so
            "storage live" == S.
  A[s,i,m]  i's state (made with impl m) is held when stage s starts (s >= 1)
  R[s,i,m]  i is recomputed with impl m in stage s, before the backward of t_s
            (i an ancestor of t_s or t_s itself; never a storage the user holds)
            (outputs the user holds, and their bases: S = 1 at every stage; an output the user
            drops once the loss is computed, `Node.user_holds` False: S[0] = 1 only)
  P[s,j,k]  (continuous) value j, recomputed in stage s, is still live from its k-th
            consumer step on (a later consumer is recomputed in s, or it is carried)

  backward needs a state      sum_m A[s,t,m] + R[s,t,m] = 1
  recompute needs its inputs  R[s,i] <= S[s,j] + R[s,j]          (j input of i)
  carry                       S[s+1,i] <= S[s,i] + R[s,i];  A[s+1,i,m] <= A[s,i,m] + R[s,i,m]
  one state at a time         A[s+1,i,m] + sum_{m' != m} A[s,i,m'] <= 1   (i recomputable in s)
  no second copy              S[s,i] + R[s,i] <= 1               (i owns a storage)
  storages held by states     sum_m A[s,c,m] <= S[s,b]           (over the impls m of c that keep b)
  t's inputs, either way      S[s,base(j)] + R[s,j] >= sum_{m keeps j} A[s,t,m] + R[s,t]
                              (j input of t: the two rows above for t in one; tighter relaxation)
  views hold their base       S[s,v] <= S[s,base(v)]
  recompute step i of stage s C_s + sum_b a_b Q[s,b,k(i)] + states(i)
                              + sum_{j<i} a_j P[s,j,k(i)] + (a_i + fwd_workspace_i) R[s,i]
                              - a_i W[s,i] <= budget
                              (one row per step: a multi-level plan recomputes long chains in one
                              stage, and each value is counted only while it is live)
  Q[s,b,k]  (continuous) b, held when stage s starts, is still held from step k on: a later
            consumer (of b or of a view of it) is recomputed in s, it is carried, or t_s's state
            keeps it (else the schedule frees it after its last use, or when the stage starts)
  states(i) t_s's state; another node's state from its recompute step on if carried (A[s+1]: a
            state recomputed but not carried is not made), before it A[s] (held at the start)
  W[s,i,m]  (continuous) <= R[s,i,m]: i writes its output into the storage of its input j
            (`fwd_in_place`): j not carried, no later consumer of j recomputed in s, no state
            keeping j (the forward has the same column, W0 <= k, with S[0,j] and F)
  backward of t_s             carried storages and states + t's state + backward transient <= budget
  after the backward of t_s   carried storages and states + the gradients while t's input gradients
                              are summed and an optimizer step in the backward runs (per impl of t;
                              `Analysis.bwd_after`) <= budget
  forward memory (step i)     fixed + storages live at step i (needed later in the forward, or
                              kept: a_b S[0,b]) + a_i + private bytes of F states so far
                              + workspace of i <= budget
  minimise                    forward + backward + recompute time of the chosen implementations

Recompute windows: the full grid has O(n^2) columns (ResNet-50 at 224: 80k columns,
133k rows; HiGHS does not finish even the LP relaxation in 120 s). A window w keeps
columns only for nodes within w topological positions of each stage's node (see
`Formulation`); w=6 is ~9k columns and solves to optimality in seconds. `solve`
widens the window (6, 12, 24, unbounded), each MILP warm-started from the best plan
so far, while the next one fits in the time left (`WIDEN_FACTOR`) and no plan has reached
the trivial bound (no recomputation, every node's fastest implementation: optimal over every
schedule); the reported gap is that of the widest MILP it ran
(`meta["milp_gap_scope"]`), i.e. proven within that window, not over all schedules.

Terms that many memory rows share are written once, into a continuous column y >= sum(terms)
that the rows read (`Formulation._sum_col`): a stage's held storages, in each of its step rows;
the forward's released storages and states, from step to step; and the nodes outside the window
(held as the forward left them), a set that only shrinks from stage to stage, in a chain of such
columns (`_far_chain`, `_rebase`). The same LP, with 3.6x fewer nonzeros on ResNet-50 (385k ->
107k) and 6.8x on the 356-node synthetic ResNet (1.21M -> 178k): HiGHS' presolve and root cut
rounds then finish where they did not (356 nodes at 0.33: bound 1.425 -> 1.521 in a 60-s solve).

Every term is an upper bound of what the simulator counts for the emitted schedule
(which frees things as early as possible inside a stage), so a solution of the
MILP is a schedule within budget; `solve` still replays it with the simulator.
Matrices are assembled from integer index lists into a scipy sparse matrix and
passed to highspy directly (no per-scalar modelling-layer expressions).
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import scipy.sparse as sp

from solver.plan import Analysis, Plan, StagePlan

if TYPE_CHECKING:
    from solver.schedule import Schedule


@dataclass
class MilpResult:
    plan: Plan | None
    status: str  # optimal / time_limit / infeasible / no_solution
    objective: float | None
    dual_bound: float | None
    gap: float | None
    solve_time_s: float
    build_time_s: float
    n_cols: int
    n_rows: int
    x: np.ndarray | None = None  # the solution vector (model columns, original units)


class _Model:
    """Columns and rows accumulated as index lists."""

    def __init__(self) -> None:
        self.cost: list[float] = []
        self.lb: list[float] = []
        self.ub: list[float] = []
        self.integer: list[bool] = []
        self.r_idx: list[int] = []
        self.c_idx: list[int] = []
        self.vals: list[float] = []
        self.r_lo: list[float] = []
        self.r_hi: list[float] = []
        self.r_tag: list[tuple] = []  # what each row says (for debugging and tests)
        self.tag: tuple = ()
        self._seen: dict = {}

    def var(self, cost: float = 0.0, lb: float = 0.0, ub: float = 1.0, integer: bool = True) -> int:
        self.cost.append(cost)
        self.lb.append(lb)
        self.ub.append(ub)
        self.integer.append(integer)
        return len(self.cost) - 1

    def row(self, cols: list[int], coefs: list[float], lo: float, hi: float) -> int:
        """Add a row; repeated columns are merged, and a row equal to an earlier one (or empty) is
        dropped (shared far-node columns make many carry rows read x <= x)."""
        if len(set(cols)) == len(cols):  # (most rows: no column twice)
            pairs = zip(cols, coefs)
        else:
            merged: dict[int, float] = {}
            for c, v in zip(cols, coefs):
                merged[c] = merged.get(c, 0.0) + v
            pairs = merged.items()
        items = tuple(sorted(pairs))
        if 0.0 in coefs or len(items) != len(cols):
            items = tuple(cv for cv in items if cv[1] != 0.0)
        if not items:
            if lo > 0.0 or hi < 0.0:
                raise ValueError(f"empty row {self.tag} with bounds [{lo}, {hi}] cannot hold")
            return -1
        key = (items, lo, hi)
        known = self._seen.get(key)
        if known is not None:
            return known
        r = len(self.r_lo)
        self._seen[key] = r
        cs, vs = zip(*items)
        self.r_idx.extend([r] * len(cs))
        self.c_idx.extend(cs)
        self.vals.extend(vs)
        self.r_lo.append(lo)
        self.r_hi.append(hi)
        self.r_tag.append(self.tag)
        return r


INF = float("inf")
# how many nodes back (topological index) a backward stage may recompute; None: unbounded
AUTO_WINDOWS = (6, 12, 24, None)
# the next window starts only with this many times the previous window's wall time left, times
# the ratio of their windows
WIDEN_FACTOR = 1.5
# time mode: the share of the time a MILP leaves for `_polish` if it runs out of time (Gurobi,
# or a MILP without a warm start; HiGHS runs beside polishing instead: `_highs_beside_polish`), the
# band of backward stages each polishing sub-MILP may change, and its time limit
POLISH_SHARE = 0.4
POLISH_SPAN = 16
POLISH_SUB_LIMIT_S = 5.0
# ... and the node bands: this many consecutive nodes' columns at every stage, each sub-MILP's limit
POLISH_NODES = 24
POLISH_NODE_LIMIT_S = 5.0
# bands polished at once, each HiGHS run in its own thread on one core (HiGHS' branch and bound is
# mostly serial; highspy releases the GIL and keeps a scheduler per thread). Four node-band
# sub-MILPs of ResNet-50 b8 224 at 1/3: 10.9 s one after another with 2 threads each, 7.6 s two
# at a time
POLISH_WORKERS = 2
# time mode, after polishing that did not run beside HiGHS: when it stops improving with at least
# this many seconds left, HiGHS runs the polished MILP again for the rest (ResNet-50 b8 224 at
# 0.33 with 300 s: polishing was done at 175 s and the time after it went unused)
FINAL_RUN_MIN_S = 5.0
# time mode, where polishing does not run beside HiGHS: a warm-started MILP that has found nothing
# better by the end of its root node, or within this share of its time, gives the rest to
# `_polish` (ResNet-50 b8 224 at 0.33, 60 s: HiGHS never beat the multilevel warm start; with the
# hand-over +48.5 % -> +30.7 % predicted, at the cost of 0.4: +14.7 % -> +20.7 %, where HiGHS' root
# heuristics needed ~25 s)
STALL_SHARE = 0.5
# time mode: RINS (relaxation-induced neighbourhood search) before each window's MILP: the
# share of the remaining time its LP relaxation may take, each sub-MILP's time limit, and how
# many rounds (each re-fixes what agrees with the new incumbent) it may run
RINS_LP_SHARE = 0.3
RINS_SUB_LIMIT_S = 20.0
RINS_ROUNDS = 4
# ... in the first window, one round of RINS from each of up to RINS_STARTS fitting plans (the
# fastest that the window's rows accept; each in its own MILP, built around it) in this share of
# the remaining time, before the rounds go on from the best. Where RINS ends depends on where it
# starts, not on how fast the start is: ResNet-50 b8 224 (session-21 problems), RINS from four
# multilevel plans: kept 0.4 1.578 / 1.642 / 1.617 / 1.638 s (the fastest start gave the best),
# Adam 0.33 1.657 / 1.563 / 1.560 / 1.738 s
RINS_STARTS = 3
RINS_STARTS_SHARE = 0.5
# ... a further start only with this many seconds left per start
RINS_START_MIN_S = 3.0
# ... and only if its MILP has at most this many times the own columns (`own_cells`) of the
# fastest start's: building it and solving its LP relaxation grow faster than its size (356-node
# synthetic DAG at 0.6: segment_sweep's plan, 6.1 times, 152k columns against 26.5k, built in 8
# s, its LP not solved in the 5.8 s it had). Not lower: on ResNet-50 b8 224 (Adam step in the
# backward, 0.5) a start of 2.1 times led to the best plan (1.0728; 1.0787 with it skipped at 1.5)
RINS_START_SIZE_RATIO = 3.0
# peak mode's time preference: MiB added per no-recompute step time of predicted time
PEAK_MODE_TIME_MIB = 1.0
# forward memory rows: terms carried from step to step before they fold into one column
FWD_RUN_TERMS = 8
# verbose solves print one progress line per PROGRESS_EVERY_S seconds of a HiGHS run; HiGHS' own
# log (presolve, branch-and-bound tables) instead only with MONET_OPT_HIGHS_LOG=1 (--highs-log)
PROGRESS_EVERY_S = 10.0


def _useful_until(an: Analysis) -> list[int]:
    """useful_until[i]: the stage node t from which down i's storage may still be needed
    (some consumer c <= t, i's own state keeping its output, or a view of it)."""
    big = an.n + 1
    until = [big] * an.n
    for i in range(an.n):
        if an.consumers[i]:
            until[i] = min(an.consumers[i])
        if any(im.keeps_output for im in an.impls[i]):
            until[i] = min(until[i], i)
    for v in range(an.n - 1, -1, -1):  # a view keeps its base needed
        b = an.base[v]
        if b != v:
            until[b] = min(until[b], until[v])
    return until


def _var_from(an: Analysis, useful: list[int], window: int | None, plan: Plan | None) -> list[int]:
    """var_from[i]: the first backward stage at which node i has its own S/A/R columns in the
    window-`window` MILP built around `plan` (`Formulation`)."""
    if window is None:
        return [0] * an.n
    var_from = [an.T] * an.n
    for s, t in enumerate(an.bw):
        for i in range(max(0, t - window), t + 1):
            var_from[i] = min(var_from[i], s)
    if plan is not None:
        fimpl = {i: plan.impl[i] for i in plan.F}
        for s, t in enumerate(an.bw):
            for i, _m, _g in plan.stages[s].recompute:
                var_from[i] = min(var_from[i], s)
            if s == 0:
                continue
            prev = plan.stages[s - 1]
            for i in range(t + 1):
                if var_from[i] <= s or i in an.user_held:
                    continue
                far = i in plan.S0 and t >= useful[i]  # far i's handle: S[0,i] while still useful
                if (i in prev.carry_vals) != far:
                    var_from[i] = s
                elif an.rb[i] and prev.carry_states.get(i) != fimpl.get(i):
                    var_from[i] = s
    return var_from


def own_cells(an: Analysis, window: int | None, plan: Plan | None) -> int:
    """How many (node, backward stage) pairs have columns of their own in the window-`window`
    MILP built around `plan`: its size, known before it is built (its columns grow with it)."""
    var_from = _var_from(an, _useful_until(an), window, plan)
    # stages 0 .. upto[i] - 1 are the backwards of nodes t >= i (`an.bw` runs from the last node)
    upto = np.searchsorted(-np.asarray(an.bw), -np.arange(an.n), side="right")
    return int(np.maximum(upto - np.asarray(var_from), 0).sum())


class Formulation:
    """The MILP for one budget.

    `window` bounds how far back a stage may recompute: stage s (backward of t) has
    recompute columns only for nodes i >= t - window, and its own S/A columns only for
    those. A node further back ("far") is, at that stage, exactly as the forward left
    it: its handle column is S[0,i] while some consumer c <= t or its own state may
    still need it (a constant 0 once nothing can), its state columns are F[i]. The
    window only removes choices, so every solution is still a valid schedule (and
    `solve` replays it); nodes where `warm_plan` differs from that rule get their own
    columns from the stage where it differs, so the warm start stays feasible.
    `window=None` is the full formulation.
    """

    def __init__(
        self,
        an: Analysis,
        budget: int | None,
        window: int | None = None,
        warm_plan: Plan | None = None,
        backend: str = "highs",
    ) -> None:
        self.an = an
        self.budget = None if budget is None else int(budget)  # None: minimise the peak instead
        self.window = window
        # peak mode: the incumbent is what matters (its dual bound is no real bound anyway); on
        # ResNet-50 b8 224, window 12, heuristic effort 0.7 reached 0.373 of plain in 90 s where
        # HiGHS' default (0.05) stalled at 0.380 for 320 s. Time mode: 0.3, tried once on ResNet-50
        # b8 224 at 0.4 / 0.33 (+21.0 / +31.6 % vs +20.8 / +35.8 % at the default): within noise
        self.highs_options: dict = (
            {"mip_heuristic_effort": 0.7} if budget is None else {"mip_heuristic_effort": 0.3}
        )
        self.stop_at_objective: float | None = None  # peak mode: stop once a plan's peak (MiB) is <= this
        self.backend = backend  # "highs" or "gurobi" (`solver.gurobi_milp`): what `solve_milp` runs
        self.useful = _useful_until(an)
        self.var_from = _var_from(an, self.useful, window, warm_plan)
        t0 = time.perf_counter()
        self._build()
        self.build_time_s = time.perf_counter() - t0

    # ------------------------------------------------------------------------------------------
    def _build(self) -> None:  # noqa: C901 - one formulation, kept in one place
        an = self.an
        md = _Model()
        self.md = md
        n, T = an.n, an.T
        fixed = an.problem.fixed_bytes
        nimp = [len(im) for im in an.impls]
        user = an.user_held
        user_bases = set(an.user_bases)
        has_view = [False] * n
        # readers[b]: the nodes that read storage b, through its own handle or a view's
        self.readers: list[set[int]] = [set(an.consumers[b]) for b in range(n)]
        for v in range(n):
            if an.is_view[v]:
                has_view[an.base[v]] = True
                self.readers[an.base[v]].update(an.consumers[v])

        # budget=None: the budget is a column, and the objective is the peak (MiB) alone
        self.peak_col = None if self.budget is not None else md.var(integer=False, lb=0.0, ub=INF)
        # columns in bytes, which the backend sees in MiB (`_Scaling`): the peak, the sum columns
        self.byte_cols: list[int] = [] if self.peak_col is None else [self.peak_col]
        self.mem_rows: list[int] = []
        # forward implementation and kept states
        self.k = [[md.var(cost=an.impls[i][m].fwd_time) for m in range(nimp[i])] for i in range(n)]
        for i in range(n):
            if nimp[i] == 1:
                md.lb[self.k[i][0]] = 1.0
            else:
                md.row(self.k[i], [1.0] * nimp[i], 1.0, 1.0)
        # S[s] : dict node -> col ; A[s]: dict node -> list of cols ; R[s]: dict node -> list of cols
        self.S: list[dict[int, int]] = []
        self.A: list[dict[int, list[int]]] = []
        self.R: list[dict[int, list[int]]] = []
        anc = an.ancestors
        zero = md.var(lb=0.0, ub=0.0)  # the handle of a far node nothing needs any more
        var_from = self.var_from
        for s, t in enumerate(an.bw):
            Ss: dict[int, int] = {}
            rng = range(n) if s == 0 else range(t + 1)
            for i in rng:
                if i in user or (s == 0 and i in an.dropped):  # (held at the forward's end)
                    Ss[i] = md.var(lb=1.0, ub=1.0)
                elif i > t:
                    Ss[i] = md.var(lb=0.0, ub=0.0)
                elif s > 0 and s < var_from[i]:
                    Ss[i] = self.S[0][i] if t >= self.useful[i] else zero
                else:
                    Ss[i] = md.var()
            self.S.append(Ss)
            As: dict[int, list[int]] = {}
            for i in range(t + 1):
                if an.rb[i]:
                    if s > 0 and s < var_from[i]:
                        As[i] = self.A[0][i]
                        continue
                    cost_b = an.impls[i]
                    As[i] = [md.var(cost=cost_b[m].bwd_time if i == t else 0.0) for m in range(nimp[i])]
            self.A.append(As)
            Rs: dict[int, list[int]] = {}
            for i in sorted(anc[t] | {t}):
                if i in user or s < var_from[i]:
                    continue
                ims = an.impls[i]
                Rs[i] = [
                    md.var(cost=an.recompute_time(i, m) + (ims[m].bwd_time if i == t else 0.0))
                    for m in range(nimp[i])
                ]
                if i != t:  # restores (`Restore`): after the implementations, from a consumer's state
                    Rs[i] += [
                        md.var(cost=an.recompute_time(i, m))
                        for m in range(nimp[i], nimp[i] + len(an.restores[i]))
                    ]
            self.R.append(Rs)
        self.aux: list[tuple[int, list[tuple[list[int], float]]]] = []  # y >= sum(x[cols]) + const, each
        # y >= sum(coefs * x[cols]) (bytes), and the row that says so
        self.sums: list[tuple[int, list[int], list[float], int]] = []
        # while a stage's rows are built: its far nodes' chain column and terms (`_rebase`)
        self._ref: tuple[int, dict[int, float]] | None = None
        # in-place forwards: y <= x[c] for c in the first list, y <= 1 - x[c] for c in the second
        self.in_place: list[tuple[int, list[int], list[int]]] = []
        sources = [[_in_place_source(an, i, m, has_view) for m in range(nimp[i])] for i in range(n)]
        keepers: dict[int, list[tuple[int, int]]] = {}  # storage -> (node, impl) whose state keeps it
        for c in range(n):
            for m in range(nimp[c]):
                for b in an.kept_bases[c][m]:
                    keepers.setdefault(b, []).append((c, m))

        self._far_chain(zero, user, user_bases)

        # F <= k
        for i, cols in self.A[0].items():
            for m, c in enumerate(cols):
                md.row([c, self.k[i][m]], [1.0, -1.0], -INF, 0.0)

        for s, t in enumerate(an.bw):
            Ss, As, Rs = self.S[s], self.A[s], self.R[s]
            # backward needs a state
            # this stage's memory rows read the far nodes that stay far in the next stage through
            # the chain's column (`_rebase`)
            self._ref = self.far_sum[s + 1] if s + 1 < T else None
            md.tag = ("need_state", s, t)
            cols = list(As.get(t, [])) + list(Rs.get(t, []))
            md.row(cols, [1.0] * len(cols), 1.0, 1.0)
            # at most one state per node
            md.tag = ("one_state", s, t)
            for i, ac in As.items():
                if len(ac) > 1 and i != t:
                    md.row(ac, [1.0] * len(ac), -INF, 1.0)
            # recompute needs inputs; no second copy
            md.tag = ("inputs", s, t)
            A2s = self.A[s + 1] if s + 1 < T else {}
            for i, rc in Rs.items():
                ic = rc[: nimp[i]]
                for j in an.uinputs[i]:
                    cc = ic + [Ss[j]] + Rs.get(j, [])
                    md.row(cc, [1.0] * len(ic) + [-1.0] * (len(cc) - len(ic)), -INF, 0.0)
                if not an.is_view[i]:
                    md.row(rc + [Ss[i]], [1.0] * (len(rc) + 1), -INF, 1.0)
                # a restore reads the consumer's state: t's, or another one held through the stage
                # (held at its start and carried; the emitter frees the others when it starts)
                md.tag = ("restore", s, t)
                for r, (c, mc, _r) in enumerate(an.restores[i] if i != t else ()):
                    col = rc[nimp[i] + r]
                    if c == t:
                        md.row([col, As[t][mc]], [1.0, -1.0], -INF, 0.0)
                    elif c < t and c in A2s:
                        md.row([col, As[c][mc]], [1.0, -1.0], -INF, 0.0)
                        md.row([col, A2s[c][mc]], [1.0, -1.0], -INF, 0.0)
                        # (held at the start, c is recomputed in s without grad, if at all: its
                        # state stays; see vector_to_plan)
                    else:
                        md.ub[col] = 0.0
                md.tag = ("inputs", s, t)
            # storages held by states
            # (one row per node and storage over its implementations: at most one state per node
            # is held, so the sum is as valid as one row per implementation, and a tighter
            # relaxation, where half-held states of two implementations count once)
            md.tag = ("kept", s, t)
            for c, ac in As.items():
                keeping: dict[int, list[int]] = {}
                for m, col in enumerate(ac):
                    for b in an.kept_bases[c][m]:
                        keeping.setdefault(b, []).append(col)
                for b, cols in keeping.items():
                    md.row(cols + [Ss[b]], [1.0] * len(cols) + [-1.0], -INF, 0.0)
            # t's input j is held or recomputed, whether t's backward reads it from a held state or
            # t is recomputed from it: the two rows above in one (t has exactly one state, held or
            # recomputed), which the relaxation cannot meet with one half-held copy of j
            md.tag = ("input_of_t", s, t)
            for j in an.uinputs[t]:
                b = an.base[j]
                if b in user or j in user:
                    continue
                need = [col for m, col in enumerate(As.get(t, [])) if b in an.kept_bases[t][m]]
                need += Rs.get(t, [])[: nimp[t]]
                if not need:  # (t a user output whose state keeps nothing of j: nothing to say)
                    continue
                have = [Ss[b]] + Rs.get(j, [])
                md.row(have + need, [1.0] * len(have) + [-1.0] * len(need), 0.0, INF)
            # views hold their base
            md.tag = ("view", s, t)
            for v in range(t + 1 if s > 0 else n):
                if an.is_view[v] and v not in user and v <= t:
                    md.row([Ss[v], Ss[an.base[v]]], [1.0, -1.0], -INF, 0.0)
            # carry to the next stage
            md.tag = ("carry", s, t)
            if s + 1 < T:
                t2 = an.bw[s + 1]
                S2, A2 = self.S[s + 1], self.A[s + 1]
                for i in range(t2 + 1):
                    if i in user:
                        continue
                    cc = [S2[i], Ss[i]] + Rs.get(i, [])
                    md.row(cc, [1.0] + [-1.0] * (len(cc) - 1), -INF, 0.0)
                for i, ac2 in A2.items():
                    ac = As[i]
                    rc = Rs.get(i)
                    for m in range(nimp[i]):
                        cc = [ac2[m], ac[m]] + ([rc[m]] if rc else [])
                        md.row(cc, [1.0] + [-1.0] * (len(cc) - 1), -INF, 0.0)
                    if rc and nimp[i] > 1:
                        # a recomputation makes a state only if none is held when the stage
                        # starts (a Plan holds one state per node: `vector_to_plan`'s grad flag):
                        # no new state of another implementation beside a held one. Without this
                        # row HiGHS chose such switches, which replay with the held state's
                        # backward (ResNet-50 b8 224: 4 ms slower than the MILP's objective)
                        for m in range(nimp[i]):
                            cc = [ac2[m]] + [ac[m2] for m2 in range(nimp[i]) if m2 != m]
                            md.row(cc, [1.0] * len(cc), -INF, 1.0)
            # memory while recomputing, one row per compute step i of the stage: held at the
            # start + states + states recomputed so far + values recomputed earlier in the stage
            # that are still live at i (a consumer >= i recomputed here, carried, or viewed) +
            # step i's output and workspace
            md.tag = ("mem_rec", s, t)
            if Rs or s == 0:
                S2n = self.S[s + 1] if s + 1 < T else {}
                base_cols, base_coefs = [], []
                # held[j] / live[j]: (first step the column applies to, column), in step order, for
                # a value held when the stage starts / recomputed in it
                held: dict[int, list[tuple[int, int]]] = {}
                live: dict[int, list[tuple[int, int]]] = {}
                for i in range(t + 1):
                    if not an.is_view[i] and i not in user_bases and an.a[i]:
                        if Rs and S2n.get(i) != Ss[i]:
                            held[i] = self._held_live(s, t, i, Rs, As, S2n)
                        else:
                            base_cols.append(Ss[i])
                            base_coefs.append(an.a[i])
                if not Rs:
                    _add_state_terms(an, As, base_cols, base_coefs)
                    self._mem_row(base_cols, base_coefs, an.stage_const[s])
                # states: t's, held from the start (and recomputed: at step t); any other is freed
                # when the stage starts unless it is carried (A of the next stage); one recomputed
                # here is made at its step only if carried. So a state counts as A[s] before its
                # node's recompute step (or at every step, A[s+1], if it has none), as A[s+1] after
                A2n = self.A[s + 1] if s + 1 < T else {}
                states_before: list[tuple[int, int, float]] = []  # (node, col, bytes) to step node-1
                states_from: list[tuple[int, int, float]] = []  # (node, col, bytes) from step node
                for i, ac in As.items():
                    for m, c in enumerate(ac):
                        st = float(an.impls[i][m].state_bytes)
                        if not st:
                            continue
                        if i == t:
                            base_cols.append(c)
                            base_coefs.append(st)
                            if i in Rs:
                                states_from.append((i, Rs[i][m], st))
                        elif i not in Rs:
                            if i in A2n:
                                base_cols.append(A2n[i][m])
                                base_coefs.append(st)
                        else:
                            states_before.append((i, c, st))
                            if i in A2n:
                                states_from.append((i, A2n[i][m], st))
                for j in Rs:
                    if an.is_view[j] or j in user_bases or not an.a[j]:
                        continue
                    # (a view's handle holds j's storage: its readers count; a carried view
                    # carries j, S[s+1,v] <= S[s+1,j])
                    later = sorted(c for c in self.readers[j] if c in Rs)
                    carried = [S2n[j]] if j in S2n else []
                    steps = [j + 1] + [c + 1 for c in later]  # from step steps[k], consumers later[k:]
                    cols_j: list[tuple[int, int]] = []
                    # (P >= R_c + R_j - 1 and P >= S[s+1,j] + R_j - 1. The forms P >= R_c - S_j
                    # and P >= S[s+1,j] - S_j are as exact and dominate in the LP, but left the
                    # LP bound of ResNet-50 b8 224 at 0.33 unchanged and made HiGHS hand over
                    # before proving chain12 optimal: not used)
                    rj = Rs[j]
                    for k, start in enumerate(steps):
                        groups = [(rj + Rs[c], -1.0) for c in later[k:]]
                        groups += [([sc] + rj, -1.0) for sc in carried]
                        if not groups:
                            break
                        cols_j.append((start, self._max_col(groups)))
                    live[j] = cols_j
                if len(Rs) > 1 and len(base_cols) > 2:
                    # every step row of the stage counts the same base: one column for it, so each
                    # row has a handful of terms instead of every held storage (the same LP; the
                    # model is 2.2x smaller on the 356-node synthetic ResNet, and HiGHS' presolve
                    # and simplex work on it accordingly)
                    base_cols, base_coefs = [self._sum_col(base_cols, base_coefs)], [1.0]
                for i, rc in Rs.items():
                    cols, coefs = list(base_cols), list(base_coefs)
                    # written into its input's storage (the simulator's rule): no new bytes
                    for m, c in enumerate(rc[: nimp[i]]):
                        j = sources[i][m]
                        if j is None:
                            continue
                        blockers = [S2n[j]] if j in S2n else []
                        blockers += [x for cc in an.consumers[j] if cc > i and cc in Rs for x in Rs[cc]]
                        for cc, mm in keepers.get(j, []):
                            blockers += [x[mm] for x in (As.get(cc), Rs.get(cc)) if x is not None]
                        cols.append(self._in_place_col([c], blockers))
                        coefs.append(-float(an.a[i]))
                    for j2, c, st in states_from:
                        if j2 <= i:
                            cols.append(c)
                            coefs.append(st)
                    for j2, c, st in states_before:
                        if j2 > i:
                            cols.append(c)
                            coefs.append(st)
                    # values recomputed before step i, and values held from the start
                    for j, cols_j in [(j, c) for j, c in live.items() if j < i] + list(held.items()):
                        col = None
                        for start, pv in cols_j:
                            if start <= i:
                                col = pv
                        if col is not None:
                            cols.append(col)
                            coefs.append(float(an.a[j]))
                    # a view input's storage is already counted: its base is held at the start
                    # or recomputed here, and counts until the last reader of it or of its views
                    for m, c in enumerate(rc):
                        cols.append(c)
                        coefs.append(float(an.a[i] + an.step_workspace(i, m)))
                    self._mem_row(cols, coefs, an.stage_const[s])
            # memory at the backward of t: what is carried to the next stage, plus t's state
            md.tag = ("mem_bwd", s, t)
            cols, coefs = [], []
            tcols = [(m, c) for m, c in enumerate(As.get(t, []))] + [
                (m, c) for m, c in enumerate(Rs.get(t, []))
            ]
            keeps: dict[int, list[int]] = {}
            for m, c in tcols:
                for b in an.kept_bases[t][m]:
                    if b not in user_bases and an.a[b]:
                        keeps.setdefault(b, []).append(c)
                im = an.impls[t][m]
                own = im.state_bytes + im.bwd_workspace - an.grad_saving(t, m)
                if own:
                    cols.append(c)
                    coefs.append(float(own))
            S2 = self.S[s + 1] if s + 1 < T else {}
            A2 = self.A[s + 1] if s + 1 < T else {}
            for b, cs in keeps.items():
                y = self._max_col([(cs, 0.0)] + ([([S2[b]], 0.0)] if b in S2 else []))
                cols.append(y)
                coefs.append(an.a[b])
            for b, c in S2.items():
                if b not in keeps and not an.is_view[b] and b not in user_bases and an.a[b]:
                    cols.append(c)
                    coefs.append(an.a[b])
            _add_state_terms(an, A2, cols, coefs)
            self._mem_row(cols, coefs, an.stage_const[s] + an.bwd_extra_base[s])
            if an.bwd_after[s] is not None:
                # then, t's state dropped and its workspace freed: what is carried, plus the
                # gradients while t's input gradients are summed into new buffers and while an
                # optimizer step in the backward makes its temporaries (per implementation of t)
                acc_cols = [c for _m, c in tcols]
                acc_coefs = [float(an.bwd_after[s][m]) for m, _c in tcols]
                for b, c in S2.items():
                    if not an.is_view[b] and b not in user_bases and an.a[b]:
                        acc_cols.append(c)
                        acc_coefs.append(an.a[b])
                _add_state_terms(an, A2, acc_cols, acc_coefs)
                md.tag = ("mem_bwd_accumulate", s, t)
                self._mem_row(acc_cols, acc_coefs, an.stage_const[s])

        # forward memory per step
        self._ref = None
        md.tag = ("mem_fwd",)
        S0 = self.S[0]
        F = self.A[0]
        # kept storages already released by the forward, and states made so far: these terms only
        # grow from step to step; once there are more than FWD_RUN_TERMS, they are folded into one
        # `_sum_col` (the chain of such columns keeps each row short: the same LP, O(n) terms in
        # all instead of O(n^2))
        run_cols: list[int] = []
        run_coefs: list[float] = []
        freed_by: dict[int, list[int]] = {}
        for b in range(n):
            if not an.is_view[b] and an.a[b]:
                freed_by.setdefault(an.lastfs[b] + 1, []).append(b)
        live_const = 0
        for i in range(n):
            for b in freed_by.get(i, []):
                run_cols.append(S0[b])
                run_coefs.append(an.a[b])
                live_const -= an.a[b]
            if i in F:
                for m, c in enumerate(F[i]):
                    st = an.impls[i][m].state_bytes
                    if st:
                        run_cols.append(c)
                        run_coefs.append(st)
            if len(run_cols) > FWD_RUN_TERMS:
                run_cols, run_coefs = [self._sum_col(run_cols, run_coefs)], [1.0]
            ws_cols = [self.k[i][m] for m in range(nimp[i]) if an.impls[i][m].fwd_workspace]
            ws_coefs = [an.impls[i][m].fwd_workspace for m in range(nimp[i]) if an.impls[i][m].fwd_workspace]
            for m in range(nimp[i]):  # written into its input's storage, freed right after
                j = sources[i][m]
                if j is not None and an.lastfs[j] == i and j in S0:
                    blockers = [S0[j]] + [F[cc][mm] for cc, mm in keepers.get(j, []) if cc in F]
                    ws_cols.append(self._in_place_col([self.k[i][m]], blockers))
                    ws_coefs.append(-an.a[i])
            # live_const tracks -(bytes of storages already released); add all earlier storages
            self._mem_row(run_cols + ws_cols, run_coefs + ws_coefs, fixed + live_const + an.a[i])
            live_const += an.a[i]  # == bytes of storages created before i+1 and not yet released
        if self.peak_col is not None:
            # the peak in MiB, plus a small preference for fast plans: a plan twice as slow as
            # no recomputation costs PEAK_MODE_TIME_MIB more (ties and near-ties go to speed)
            scale = PEAK_MODE_TIME_MIB / max(self.trivial_bound(an), 1e-12)
            md.cost = [c * scale for c in md.cost]
            md.cost[self.peak_col] = 1.0 / 2**20
        self.n_cols = len(md.cost)
        self.n_rows = len(md.r_lo)

    def _far_chain(self, zero: int, user, user_bases) -> None:
        """far_sum[s]: (column, terms) for the memory terms of the nodes that are far at stage s
        (outside the recompute window: held, with their states, as the forward left them), or None.
        Nodes only stop being far as the backward goes on, so far_sum[s] is far_sum[s+1]'s column
        plus the terms of the nodes that stop being far at s+1: a chain of `_sum_col`s with O(n)
        terms in all, which each stage's rows read instead of O(n) terms each (`_rebase`)."""
        an = self.an
        T = an.T
        self.far_sum: list[tuple[int, dict[int, float]] | None] = [None] * (T + 1)
        for s in range(T - 1, 0, -1):
            t = an.bw[s]
            terms: dict[int, float] = {}
            for i in range(t + 1):
                if i in user or s >= self.var_from[i]:
                    continue
                c = self.S[s][i]
                if c != zero and not an.is_view[i] and i not in user_bases and an.a[i]:
                    terms[c] = terms.get(c, 0.0) + float(an.a[i])
                for m, c in enumerate(self.A[s].get(i, ())):
                    st = an.impls[i][m].state_bytes
                    if st:
                        terms[c] = terms.get(c, 0.0) + float(st)
            if not terms:
                continue
            nxt = self.far_sum[s + 1]
            if nxt is not None and all(terms.get(c) == v for c, v in nxt[1].items()):
                extra = {c: v for c, v in terms.items() if c not in nxt[1]}
                col = self._sum_col([nxt[0], *extra], [1.0, *extra.values()])
            else:
                col = self._sum_col(list(terms), list(terms.values()))
            self.far_sum[s] = (col, terms)

    def _rebase(self, cols: list[int], coefs: list[float]) -> tuple[list[int], list[float]]:
        """A memory row's terms as the stage's far column (`_far_chain`) plus their difference from
        its terms, when that is shorter. Exact: the column is >= its terms and only bounded from
        below, and it is read with coefficient 1 in rows bounded from above."""
        if self._ref is None:
            return cols, coefs
        ref, terms = self._ref
        merged: dict[int, float] = {}
        for c, v in zip(cols, coefs):
            merged[c] = merged.get(c, 0.0) + v
        diff = dict(merged)
        for c, v in terms.items():
            diff[c] = diff.get(c, 0.0) - v
        diff = {c: v for c, v in diff.items() if v != 0.0}
        if len(diff) + 1 >= len(merged):
            return cols, coefs
        return [ref, *diff], [1.0, *diff.values()]

    def _mem_row(self, cols: list[int], coefs: list[float], const: float) -> None:
        """const + sum(coefs * cols) <= budget (or <= the peak column)."""
        cols, coefs = self._rebase(cols, coefs)
        if self.peak_col is None:
            r = self.md.row(cols, coefs, -INF, self.budget - const)
        else:
            r = self.md.row(list(cols) + [self.peak_col], list(coefs) + [-1.0], -INF, -const)
        if r >= 0:
            self.mem_rows.append(r)

    def _held_live(self, s: int, t: int, b: int, Rs: dict, As: dict, S2n: dict) -> list[tuple[int, int]]:
        """Columns saying that storage b, held when stage s starts (S), is still held at a step:
        (first step, column) in step order, as for recomputed values. The schedule frees a held
        value after its last use in the stage unless it is carried (S of the next stage) or t's
        state keeps it; a value no step needs is freed when the stage starts (no column)."""
        an = self.an
        Sb = self.S[s][b]
        fixed_groups = [([Sb, S2n[b]], -1.0)] if b in S2n else []
        for m, c in enumerate(As.get(t, [])):
            if b in an.kept_bases[t][m]:
                fixed_groups.append(([Sb, c], -1.0))
        later = sorted(c for c in self.readers[b] if c in Rs)
        out: list[tuple[int, int]] = []
        for k, start in enumerate([-1] + [c + 1 for c in later]):
            groups = [([Sb] + Rs[c], -1.0) for c in later[k:]] + fixed_groups
            if not groups:
                break
            out.append((start, self._max_col(groups)))
        return out

    def _sum_col(self, cols: list[int], coefs: list[float]) -> int:
        """A continuous column y >= sum(coefs * x[cols]) (bytes; >= 0), for memory rows that share
        these terms: each row then reads y alone. Rows only bound y from above, so the LP and the
        MILP are the same as with the terms written out."""
        cols, coefs = self._rebase(cols, coefs)
        y = self.md.var(integer=False, lb=0.0, ub=INF)
        r = self.md.row([y] + list(cols), [1.0] + [-float(c) for c in coefs], 0.0, INF)
        self.sums.append((y, list(cols), [float(c) for c in coefs], r))
        self.byte_cols.append(y)
        return y

    def _max_col(self, groups: list[tuple[list[int], float]]) -> int:
        """A continuous column y >= sum(x[cols]) + const for each group (and >= 0)."""
        y = self.md.var(integer=False)
        for cols, const in groups:
            self.md.row([y] + cols, [1.0] + [-1.0] * len(cols), const, INF)
        self.aux.append((y, groups))
        return y

    def _in_place_col(self, needs: list[int], blockers: list[int]) -> int:
        """A continuous column y <= each of `needs` and <= 1 - each of `blockers`: 1 when a forward
        may write its output into its input's storage (memory rows subtract the output's bytes)."""
        md = self.md
        blockers = sorted(set(blockers))
        y = md.var(integer=False)
        for c in needs:
            md.row([y, c], [1.0, -1.0], -INF, 0.0)
        for c in blockers:
            md.row([y, c], [1.0, 1.0], -INF, 1.0)
        self.in_place.append((y, list(needs), blockers))
        return y

    # ------------------------------------------------------------------------------------------
    def plan_to_vector(self, plan: Plan) -> np.ndarray:
        """Column values of a Plan (for warm starts and consistency checks)."""
        an = self.an
        x = np.zeros(self.n_cols)
        lb = np.asarray(self.md.lb)
        for i in range(an.n):
            x[self.k[i][plan.impl[i]]] = 1
        for i in plan.F:
            if i in self.A[0]:
                x[self.A[0][i][plan.impl[i]]] = 1
        for s in range(an.T):
            vals = plan.S0 if s == 0 else plan.stages[s - 1].carry_vals
            for i, c in self.S[s].items():
                if i in vals:
                    x[c] = 1
            if s > 0:
                for i, m in plan.stages[s - 1].carry_states.items():
                    if i in self.A[s]:
                        x[self.A[s][i][m]] = 1
            for i, m, _g in plan.stages[s].recompute:
                if i in self.R[s]:
                    x[self.R[s][i][m]] = 1
        # auxiliary continuous columns: at their lower bounds
        x = np.maximum(x, lb)
        for y, groups in self.aux:
            x[y] = max([0.0] + [sum(x[k] for k in cols) + const for cols, const in groups])
        for y, needs, blockers in self.in_place:
            x[y] = min([1.0] + [x[c] for c in needs] + [1.0 - x[c] for c in blockers])
        x = np.maximum(x, lb)
        for y, cols, coefs, _row in self.sums:
            x[y] = max(0.0, float(np.dot(x[cols], coefs)))
        if self.peak_col is not None:  # the smallest peak column the memory rows allow
            x[self.peak_col] = 0.0
            act, _lo, hi = self.row_activity(x)
            rows = np.asarray(self.mem_rows, dtype=int)
            x[self.peak_col] = max(0.0, float(np.max(act[rows] - hi[rows]))) if len(rows) else 0.0
        return x

    def vector_to_plan(self, x: np.ndarray) -> Plan:
        an = self.an
        on = x > 0.5
        impl = [max(range(len(ks)), key=lambda m, ks=ks: x[ks[m]]) for ks in self.k]
        F = {i for i, cols in self.A[0].items() if any(on[c] for c in cols)}
        fimpl = list(impl)
        for i in F:
            fimpl[i] = max(range(len(self.A[0][i])), key=lambda m, i=i: x[self.A[0][i][m]])
        S0 = {i for i, c in self.S[0].items() if on[c]}
        stages = []
        for s, t in enumerate(an.bw):
            nxt_S = {i for i, c in self.S[s + 1].items() if on[c]} if s + 1 < an.T else set()
            nxt_A: dict[int, int] = {}
            if s + 1 < an.T:
                for i, cols in self.A[s + 1].items():
                    for m, c in enumerate(cols):
                        if on[c]:
                            nxt_A[i] = m
            held_A = {i for i, cols in self.A[s].items() if any(on[c] for c in cols)}
            rec = []
            for i in sorted(self.R[s]):
                for m, c in enumerate(self.R[s][i]):
                    if on[c]:
                        grad = an.rb[i] and (i == t or (nxt_A.get(i) == m and i not in held_A))
                        rec.append((i, m, grad))
                        break
            stages.append(StagePlan(recompute=rec, carry_vals=nxt_S, carry_states=nxt_A))
        return Plan(impl=fimpl, F=F, S0=S0, stages=stages)

    def row_activity(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        A = self.matrix()
        return A @ x, np.asarray(self.md.r_lo), np.asarray(self.md.r_hi)

    def matrix(self) -> sp.csc_matrix:
        md = self.md
        return sp.csc_matrix(
            (np.asarray(md.vals, dtype=float), (np.asarray(md.r_idx), np.asarray(md.c_idx))),
            shape=(self.n_rows, self.n_cols),
        )

    def violations(self, x: np.ndarray, tol: float = 1e-6) -> list[int]:
        """Rows (>= 0) and columns (-1 - col) that `x` violates, with absolute tolerance `tol`."""
        act, lo, hi = self.row_activity(x)
        bad = np.nonzero((act < lo - tol) | (act > hi + tol))[0]
        xb = np.asarray(self.md.lb)
        ub = np.asarray(self.md.ub)
        badc = np.nonzero((x < xb - tol) | (x > ub + tol))[0]
        return list(bad) + [-1 - int(c) for c in badc]

    def trivial_time_bound(self) -> float:
        return self.trivial_bound(self.an)

    @staticmethod
    def trivial_bound(an: Analysis) -> float:
        """A lower bound on every schedule's time. Each node runs forward at least once; a backward
        node's backward reads the state of one computation of it, with that computation's
        implementation: the first (its forward and backward time), or a recomputation (some first
        forward, then the implementation's recompute time, the runtime's overhead per
        recomputation and its backward). Nothing recomputed, every node at its fastest
        implementation, reaches it wherever keeping is the cheaper of the two."""
        overhead = an.problem.recompute_overhead_s
        backward = set(an.bw)
        total = 0.0
        for i, ims in enumerate(an.impls):
            first = min(im.fwd_time for im in ims)
            if i not in backward:
                total += first
                continue
            kept = min(im.fwd_time + im.bwd_time for im in ims)
            again = min(
                (im.fwd_time if im.recompute_time is None else im.recompute_time) + im.bwd_time for im in ims
            )
            total += min(kept, first + overhead + again)
        return total

    def band_columns(self, stages: range, nodes: range) -> set[int]:
        """The columns of backward stages `stages` and the forward choices of `nodes`."""
        cols: set[int] = set()
        for s in stages:
            cols.update(self.S[s].values())
            for table in (self.A[s], self.R[s]):
                for group in table.values():
                    cols.update(group)
        for i in nodes:
            cols.update(self.k[i])
            cols.update(self.A[0].get(i, ()))
            cols.add(self.S[0][i])
        return cols

    def node_columns(self, nodes: range) -> set[int]:
        """Every column of `nodes`, at every stage: their forward choices, and whether each stage
        holds, keeps the state of, or recomputes them."""
        cols: set[int] = set()
        for s in range(self.an.T):
            Ss, As, Rs = self.S[s], self.A[s], self.R[s]
            for i in nodes:
                if i in Ss:
                    cols.add(Ss[i])
                cols.update(As.get(i, ()))
                cols.update(Rs.get(i, ()))
        for i in nodes:
            cols.update(self.k[i])
        return cols

    def objective(self, x: np.ndarray) -> float:
        return float(np.asarray(self.md.cost) @ x)

    # ------------------------------------------------------------------------------------------
    def solve_milp(self, time_limit: float, **kw) -> MilpResult:
        """This MILP, solved by `self.backend`: `solve_highs`'s arguments and result."""
        if self.backend == "gurobi":
            from solver.gurobi_milp import solve_formulation

            return solve_formulation(self, time_limit, **kw)
        return self.solve_highs(time_limit, **kw)

    def solve_highs(
        self,
        time_limit: float,
        mip_gap: float = 0.01,
        threads: int = 2,
        warm: np.ndarray | None = None,
        verbose: bool = False,
        fixed: dict[int, float] | None = None,
        stall_s: float | None = None,
        relax: bool = False,
        cancel=None,
        incumbent=None,
    ) -> MilpResult:
        """fixed: column -> value, held there (the neighbourhoods of `_polish`).
        stall_s: give up if HiGHS has found nothing better than `warm` by the end of its root
        node or after stall_s seconds (on hard budgets the root's cut rounds can take the whole
        limit, and branching rarely finds what the root's heuristics did not: the caller has
        better uses for the time).
        relax: solve the LP relaxation instead (integrality dropped); the result has `x` and the
        LP's objective, and no plan.
        cancel: a `threading.Event`; once set, the run stops as at its time limit (a run in a
        thread of its own whose caller gave up: `_highs_beside_polish`).
        incumbent: returns the best plan's objective so far, found elsewhere (polishing beside
        this run), or None; verbose progress lines then give HiGHS' bound against it."""
        import highspy

        t_enter = time.perf_counter()
        md = self.md
        highs_log = bool(verbose) and os.environ.get("MONET_OPT_HIGHS_LOG", "") == "1"
        h = _new_highs(highspy, highs_log)
        h.setOptionValue("output_flag", highs_log)
        h.setOptionValue("log_to_console", highs_log)
        h.setOptionValue("time_limit", max(0.5, float(time_limit)))
        h.setOptionValue("mip_rel_gap", float(mip_gap))
        h.setOptionValue("threads", int(threads))
        h.setOptionValue("random_seed", 0)
        if self.n_cols > 150_000:
            # HiGHS' presolve cannot be interrupted and takes minutes at this size
            h.setOptionValue("presolve", "off")
        for key, val in (self.highs_options or {}).items():
            h.setOptionValue(key, val)
        lp = highspy.HighsLp()
        lp.num_col_ = self.n_cols
        lp.num_row_ = self.n_rows
        scaled, A, r_lo, r_hi, col_lower, col_upper = self.scaled_model(fixed)
        lp.col_cost_ = scaled.cost
        lp.col_lower_ = col_lower
        lp.col_upper_ = col_upper
        lp.row_lower_ = r_lo
        lp.row_upper_ = r_hi
        lp.a_matrix_.format_ = highspy.MatrixFormat.kColwise
        lp.a_matrix_.start_ = A.indptr.astype(np.int32)
        lp.a_matrix_.index_ = A.indices.astype(np.int32)
        lp.a_matrix_.value_ = A.data.astype(float)
        lp.a_matrix_.num_col_ = self.n_cols
        lp.a_matrix_.num_row_ = self.n_rows
        lp.integrality_ = [
            highspy.HighsVarType.kInteger if isint and not relax else highspy.HighsVarType.kContinuous
            for isint in md.integer
        ]
        h.passModel(lp)
        warm_model = scaled.to_model(np.asarray(warm, dtype=float)) if warm is not None else None
        if warm_model is not None:
            sol = highspy.HighsSolution()
            sol.col_value = list(map(float, warm_model))
            sol.value_valid = True
            h.setSolution(sol)
        t0 = time.perf_counter()
        deadline = t_enter + max(0.5, float(time_limit))
        h.setOptionValue("time_limit", max(0.5, deadline - t0))

        def _stop_at_deadline(event) -> None:
            # HiGHS' own time limit is not checked inside long presolve / separation rounds
            if time.perf_counter() > deadline or (cancel is not None and cancel.is_set()):
                event.interrupt()

        target = self.stop_at_objective
        peak_col = self.peak_col
        under_target = [False]
        # the objective to beat before `stall_s` (model units, from the solution vector itself:
        # HiGHS' reported objective can be its presolved model's, off by a constant)
        to_beat = float(scaled.cost @ warm_model) * (1 - 1e-6) if warm_model is not None else INF
        improved = [warm is None]

        def _improving(event) -> None:
            sol = event.data_out.mip_solution
            if target is not None and peak_col is not None and len(sol) > peak_col:
                # the model's peak column is in MiB (`_Scaling`), as is the target
                under_target[0] = under_target[0] or sol[peak_col] <= target
            if not improved[0] and len(sol) == len(scaled.cost):
                improved[0] = float(scaled.cost @ np.asarray(sol)) < to_beat

        next_note = [t0 + PROGRESS_EVERY_S]

        def _stop_mip(event) -> None:
            _stop_at_deadline(event)
            if verbose and not highs_log and time.perf_counter() >= next_note[0]:
                next_note[0] = time.perf_counter() + PROGRESS_EVERY_S
                gap = event.data_out.mip_gap
                note = f"gap {gap:.1%}" if np.isfinite(gap) and gap < 1e9 else "no plan yet"
                best = incumbent() if incumbent is not None else None
                bound = float(event.data_out.mip_dual_bound) / scaled.cost_factor
                if best is not None and np.isfinite(bound) and 0 < bound <= best:
                    # (beside polishing: HiGHS' own gap is to its own incumbent, not to the plan
                    # polishing holds; HiGHS' incumbent objective may be its presolved model's)
                    note = f"bound {bound:.4f}: the polished plan ({best:.4f}) within {(best - bound) / best:.1%}"
                log(
                    True,
                    f"HiGHS: {time.perf_counter() - t0:.0f} s, {int(event.data_out.mip_node_count)} nodes, {note}",
                )
            if under_target[0]:
                event.interrupt()  # good enough: a plan whose peak is under the target exists
            if stall_s is not None and not improved[0]:
                # stalled: the root node is done, or stall_s passed, and nothing beat the warm start
                if event.data_out.mip_node_count > 0 or time.perf_counter() > t0 + stall_s:
                    event.interrupt()

        for cb, fn in (
            (h.cbSimplexInterrupt, _stop_at_deadline),
            (h.cbIpmInterrupt, _stop_at_deadline),
            (h.cbMipInterrupt, _stop_mip),
            (h.cbMipImprovingSolution, _improving),
        ):
            try:
                cb.subscribe(fn)
            except Exception:  # pragma: no cover - older highspy without callbacks
                pass
        h.run()
        solve_time = time.perf_counter() - t0
        ms = h.getModelStatus()
        info = h.getInfo()
        has_sol = info.primal_solution_status == 2
        status_name = h.modelStatusToString(ms).lower()
        if ms == highspy.HighsModelStatus.kOptimal:
            status = "optimal"
        elif ms == highspy.HighsModelStatus.kInfeasible:
            status = "infeasible"
        elif "time" in status_name or "interrupt" in status_name:
            status = "time_limit"
        else:
            status = status_name.replace(" ", "_")
        has_sol = has_sol or (relax and status == "optimal")
        x_model = np.asarray(h.getSolution().col_value) if has_sol else None
        own_gap = float(info.mip_gap) if status == "optimal" and np.isfinite(info.mip_gap) else None
        return self.result(status, scaled, x_model, float(info.mip_dual_bound), solve_time, relax, own_gap)

    def scaled_model(self, fixed: dict[int, float] | None = None):
        """The model as a backend gets it (`_Scaling`'s units): (scaling, A (CSC, sorted), row
        lower, row upper, column lower, column upper); `fixed` columns held at their values."""
        md = self.md
        col_lower = np.asarray(md.lb, dtype=float)
        col_upper = np.asarray(md.ub, dtype=float)
        if fixed:
            cols = np.fromiter(fixed.keys(), dtype=int, count=len(fixed))
            vals = np.fromiter(fixed.values(), dtype=float, count=len(fixed))
            col_lower[cols] = vals
            col_upper[cols] = vals
        A = self.matrix()
        A.sort_indices()
        scaled = _Scaling(A, np.asarray(md.cost, dtype=float), self.byte_cols)
        A, r_lo, r_hi = scaled.rows(A, np.asarray(md.r_lo, dtype=float), np.asarray(md.r_hi, dtype=float))
        return scaled, A, r_lo, r_hi, scaled.to_model(col_lower), scaled.to_model(col_upper)

    def result(
        self,
        status: str,
        scaled: _Scaling,
        x_model: np.ndarray | None,
        bound_model: float,
        solve_time: float,
        relax: bool = False,
        own_gap: float | None = None,
    ) -> MilpResult:
        """A backend's run as a `MilpResult` in this formulation's units. x_model: the solution
        vector in model units (None: no solution); bound_model: the backend's dual bound (model
        units); own_gap: the backend's own gap when it proved optimality (may be below ours)."""
        plan = obj = gap = bound = x = None
        if relax:
            if x_model is not None:
                x = scaled.from_model(np.asarray(x_model, dtype=float))
                obj = self.objective(x)
            return MilpResult(
                None, status, obj, obj, None, solve_time, self.build_time_s, self.n_cols, self.n_rows, x
            )
        if x_model is not None:
            x = scaled.from_model(np.asarray(x_model, dtype=float))
            plan = self.vector_to_plan(x)
            # from the solution itself: when the incumbent is the warm start, HiGHS 1.16 reports
            # its presolved model's objective (ResNet-50 b8 224 at 0.4: 1.9005 for a 1.9036 plan)
            obj = self.objective(x)
            bound = bound_model / scaled.cost_factor
            # a bound the backend may not have reached yet: every node runs forward once and every
            # backward once, each with its fastest implementation
            trivial = self.trivial_time_bound() if self.peak_col is None else 0.0
            if not np.isfinite(bound) or bound < trivial:
                bound = trivial
            gap = max(0.0, (obj - bound) / obj) if obj > 0 else 0.0
            if own_gap is not None:
                gap = min(gap, own_gap)
        elif status != "infeasible":
            status = "no_solution"
        return MilpResult(
            plan, status, obj, bound, gap, solve_time, self.build_time_s, self.n_cols, self.n_rows, x
        )


class _Scaling:
    """Exact (power-of-two) scaling of the model handed to HiGHS.

    Memory rows are in bytes (coefficients ~1e8) next to 0/1 logic rows, and times are seconds
    (costs down to 1e-6): HiGHS warns that such a model is badly scaled, and it wastes its
    time on it. Each row with a coefficient above 2 is scaled so that its largest lies in [1, 2)
    (the 0/1 logic rows are left as they are), the costs so that the largest lies in [1024,
    2048), and columns in bytes (peak mode's peak, sum columns) are counted in MiB. Powers of two
    keep every coefficient, bound and solution exact."""

    PEAK_UNIT = 2.0**20

    def __init__(self, A, cost: np.ndarray, byte_cols=()) -> None:
        self.col = np.ones(A.shape[1])
        # columns in bytes (peak mode's peak, `Formulation._sum_col`'s): model column = bytes / PEAK_UNIT
        self.col[list(byte_cols)] = self.PEAK_UNIT
        cost = cost * self.col
        top = float(np.max(np.abs(cost))) if len(cost) else 0.0
        self.cost_factor = 2.0 ** (10 - np.floor(np.log2(top))) if top > 0 else 1.0
        self.cost = cost * self.cost_factor

    def rows(self, A, lo: np.ndarray, hi: np.ndarray):
        A = A.tocsc(copy=True)
        A.data = A.data * np.repeat(self.col, np.diff(A.indptr))
        top = np.zeros(A.shape[0])
        np.maximum.at(top, A.indices, np.abs(A.data))
        factor = np.ones(A.shape[0])
        big = top > 2.0
        factor[big] = 2.0 ** (-np.floor(np.log2(top[big])))
        A.data = A.data * factor[A.indices]
        return A, lo * factor, hi * factor

    def to_model(self, x: np.ndarray) -> np.ndarray:
        return x / self.col

    def from_model(self, x: np.ndarray) -> np.ndarray:
        return x * self.col


def _in_place_source(an, i: int, m: int, has_view: list[bool]) -> int | None:
    """The input storage implementation m of i may write its output into (`fwd_in_place`), if
    the problem allows it whatever the schedule: an owned storage of the output's size, no view
    of it, not held by the user, and no other input of i in it. Else None."""
    im = an.impls[i][m]
    if im.fwd_in_place is None or an.is_view[i] or not an.a[i]:
        return None
    j = an.inputs[i][im.fwd_in_place]
    if an.is_view[j] or has_view[j] or an.a[j] != an.a[i] or j in an.user_bases:
        return None
    if any(an.base[x] == j for pos, x in enumerate(an.inputs[i]) if pos != im.fwd_in_place):
        return None
    return j


def _add_state_terms(an, states: dict, cols: list, coefs: list) -> None:
    """Memory-row terms for held backward states: each state variable times its private bytes."""
    for i, ac in states.items():
        for m, c in enumerate(ac):
            st = an.impls[i][m].state_bytes
            if st:
                cols.append(c)
                coefs.append(st)


# when the solve that is logging started (`solve`, `minimum_peak`): each log line says the
# seconds since, so a log shows where the time went
_log_start = [time.perf_counter()]


def log(verbose: bool, msg: str) -> None:
    if verbose:
        print(f"[solver {time.perf_counter() - _log_start[0]:5.1f} s] {msg}", file=sys.stderr, flush=True)


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


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
    """Bytes from an int, or from a float in (0, 1] (fraction of the no-recompute peak)."""
    from solver.baselines import no_recompute

    if isinstance(budget, bool):
        raise TypeError("budget must be bytes (int) or a fraction in (0, 1]")
    if isinstance(budget, float):
        if not 0.0 < budget <= 1.0:
            raise ValueError(f"a fractional budget must be in (0, 1], got {budget}")
        return int(budget * no_recompute(problem).predicted_peak_bytes)
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
) -> tuple[Schedule, Plan | None]:
    """`solve`, and the plan of the schedule it returns (None for a baseline that is no policy)."""
    from solver.baselines import analysis, fitting_baselines, lowest_peak_baseline, plan_of
    from solver.bounds import explain_lower_bound, min_feasible_lower_bound
    from solver.plan import PlanError, to_schedule
    from solver.schedule import Schedule, SolverInfo
    from solver.simulate import simulate

    t_start = time.perf_counter()
    _log_start[0] = t_start
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
                        f"budget {_mib(budget_bytes)} ({budget_bytes} bytes) is below the smallest peak "
                        f"monet-opt finds: {_mib(known)} ({known} bytes; the MILP minimising the peak over "
                        f"every schedule ended optimal, so a longer time limit is unlikely to find less; "
                        f"no schedule goes below {_mib(lb)}, the memory none can avoid); a budget of "
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
    if status == "time_limit" and gap <= mip_gap:
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
    `window`: "auto" (widen 6 -> 12 -> 24 -> unbounded while time remains), an int, or
    None (the unbounded formulation only); see the module docstring.
    """
    return _solve(
        problem, budget, time_limit, verbose, mip_gap, solver, threads, warm_start, window, start_plan
    )[0]


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
        out[k] = sched
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
    `start_plan`: a plan found before (`monet_opt.lowest_found`); the peak search starts from it
    if its peak is below the lowest baseline's, so the peak found is never above it."""
    from solver.baselines import analysis, min_known_peak, no_recompute
    from solver.bounds import min_feasible_lower_bound
    from solver.plan import to_schedule
    from solver.schedule import SolverInfo
    from solver.simulate import simulate

    t_start = time.perf_counter()
    _log_start[0] = t_start
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
    log(verbose, f"now the fastest schedule at {_mib(int(target))} (a solve of its own: times restart)")
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
        "no_recompute_peak_bytes": no_recompute(problem).predicted_peak_bytes,
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

    def scope(self) -> str:
        w = self.last[0]
        return "recompute window unbounded" if w is None else f"recompute window {w} nodes"


_HIGHS_GREETED = False


def _new_highs(highspy, verbose: bool):
    """A Highs instance. The process's first one prints HiGHS' banner to the C stdout before
    any option can be set; with verbose=False that write goes to /dev/null instead."""
    global _HIGHS_GREETED
    if verbose or _HIGHS_GREETED:
        return highspy.Highs()
    _HIGHS_GREETED = True
    import os

    sys.stdout.flush()
    try:
        saved = os.dup(1)
    except OSError:  # no file descriptor 1: nothing to silence
        return highspy.Highs()
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 1)
        return highspy.Highs()
    finally:
        os.dup2(saved, 1)
        os.close(saved)
        os.close(devnull)


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
) -> _LadderResult:
    """Widen the recompute window while time remains; each MILP starts from the best plan so far.
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
        return True

    def at_floor() -> bool:
        return floor is not None and best is not None and best[1] <= floor

    def proven_gap() -> tuple:
        """(proven, widest): the tightest proven gap for the best plan so far, (window, gap,
        status), from the best bound of any MILP run whose feasible set holds the plan (the MILP
        that found it, a wider one it warm-started, the same MILP run again after polishing, or
        an earlier run of that MILP: each run's bound holds for all its points); and the
        (window, gap) of the widest window whose bound holds for it. None where none holds."""
        proven = widest = None
        holding: list[tuple] = []  # (window, gap) of every run whose bound holds for the best plan
        if at_floor():
            proven = (None, 0.0, "optimal")  # the trivial bound holds for every schedule
        elif best is not None:
            obj, plan = best[1], best[2]
            runs = [(w, res, form, res.status) for w, res, form in results]
            # (an LP relaxation's bound is as good as a MILP run's; it proves no optimality of its own)
            runs += [(w, res, form, "time_limit") for w, res, form in bounds]
            for w, res, form, status in runs:
                if res.dual_bound is None or not _holds(form, plan, obj):
                    continue
                gap = max(0.0, (obj - res.dual_bound) / obj) if obj > 0 else 0.0
                if proven is None or gap < proven[1]:
                    proven = (w, gap, status)
                holding.append((w, gap))
        if holding:
            # a wider window's bound holds over more schedules: the gap it proves says more (the
            # smallest one, of that window's runs)
            widest = max(holding, key=lambda wg: (float("inf") if wg[0] is None else wg[0], -wg[1]))
        return proven, widest

    started = None  # (when the previous window's iteration started, its window)
    started_rins = False  # RINS has run from several starts (the first window that runs it)
    polished_beside = False  # HiGHS ran with polishing beside it (`_highs_beside_polish`)
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
            started_rins = True
            form, improved = _rins_from_starts(
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
        if beside:
            # time mode: HiGHS on this MILP for the rest of the time, polishing beside it
            polished_beside = True

            def accept_polished(plan, objective: float, form=form) -> bool:
                nonlocal best_form
                if accept(plan, objective, len(results)):
                    best_form = form
                    return True
                return False

            res = _highs_beside_polish(
                form, warm_plan, warm, deadline, mip_gap, threads, verbose, accept_polished
            )
            if best_form is form:
                warm_plan = best[2]  # (the next window starts from the polished plan)
        else:
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
        results.append((w, res, form))
        attempts.append(_attempt(what, w, res))
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
        if res.status not in ("optimal", "infeasible"):
            break  # out of time (or HiGHS gave up): a wider window would not get further
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
        _polish(
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
            results.append((best_form.window, res, best_form))
            attempts.append({**_attempt(what, best_form.window, res), "after_polishing": True})
            log(
                verbose,
                f"{_BACKEND_NAMES[backend]} again after polishing (window {best_form.window}): {res.status}, objective "
                f"{res.objective}, bound {res.dual_bound}, {res.solve_time_s:.1f} s",
            )
            if res.plan is not None:
                accept(res.plan, res.objective, len(results) - 1)
    proven, widest = proven_gap()
    return _LadderResult(best[:3] if best else None, last, attempts, proven, widest)


def _lp_proves(relaxations: list, form: Formulation, warm, mip_gap: float) -> bool:
    """Whether a solved LP relaxation of `form` bounds the warm start's objective within
    `mip_gap` (relative, as HiGHS' mip_rel_gap)."""
    if warm is None:
        return False
    obj = form.objective(warm)
    bound = max((lp.objective for lp in relaxations if lp.objective is not None), default=None)
    return bound is not None and obj - bound <= mip_gap * abs(obj) + 1e-12


def _holds(form: Formulation, plan: Plan, objective: float) -> bool:
    """Whether `plan` is a feasible point of `form`'s MILP, at `objective` (a plan that needs
    columns the MILP lacks violates its rows, or costs something else there)."""
    x = form.plan_to_vector(plan)
    return not form.violations(x) and abs(form.objective(x) - objective) <= 1e-6 * max(1.0, abs(objective))


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


def _rins_from_starts(
    an, budget_bytes, window, form, plan, others, deadline, threads, verbose, accept, solved
) -> tuple[Formulation, Plan | None]:
    """RINS from `plan` in `form`, and first from up to RINS_STARTS - 1 of `others` (fitting
    plans, fastest first; each in a window-`window` MILP built around it, if its rows accept it):
    one round from each in RINS_STARTS_SHARE of the time left, then the rest of the rounds from
    the best plan found, in its MILP (from `plan` again, if no round found one). (One MILP
    holding every start has more columns, and RINS' neighbourhoods in it are wider: ResNet-50 b8
    224, Adam step in the backward, at 0.25, RINS from multilevel's plan found 1.674 s in 6.4 s in
    the MILP around it, nothing in 7 s in the MILP around three plans.) Returns (the MILP of the
    plan RINS ended with, that plan, or None if RINS found nothing better than the best so far);
    every LP relaxation solved is appended to `solved` as (its MilpResult, its Formulation)."""
    starts = [(form, plan)]
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
            starts.append((built, other))
    if len(starts) == 1:
        found: list[MilpResult] = []
        got = _rins(form, plan, deadline, threads, verbose, accept, relaxations=found)
        solved.extend((lp, form) for lp in found)
        return form, got
    log(verbose, f"RINS from {len(starts)} starts")
    phase_end = time.perf_counter() + RINS_STARTS_SHARE * (deadline - time.perf_counter())
    winner = None  # (MILP, plan, LP relaxation) of the last start whose round beat every other
    first_lp = None  # the fastest start's LP relaxation
    # a round's plan wins only if it is faster than the fastest start itself: `accept` keeps any
    # plan that beats the plans found so far, which need not include the start (356-node DAG at
    # 0.6: the greedy start's round found nothing in its share, the next start's round found
    # 1.5584 s against greedy's 1.4806, RINS went on from there and the solve fell back to greedy)
    bar = form.objective(form.plan_to_vector(plan))
    for k, (f, start) in enumerate(starts):
        now = time.perf_counter()
        if deadline - now < 2.0:
            break
        # (the LP takes what it needs; the round, what is left of this start's share)
        lp = _relaxation(f, RINS_LP_SHARE * (deadline - now), threads, verbose)
        if lp is None:
            continue
        solved.append((lp, f))
        got = _rins(
            f, start, now + (phase_end - now) / (len(starts) - k), threads, verbose, accept, rounds=1, lp=lp
        )
        if f is form:
            first_lp = lp
        if got is not None and f.objective(f.plan_to_vector(got)) < bar - 1e-9:
            winner = (f, got, lp)
    if winner is None:
        if first_lp is None or deadline - time.perf_counter() < 2.0:
            return form, None
        # no start's round found a plan faster than the fastest start in its share: RINS goes on
        # from the fastest start with the rest of the time, as it would from that start alone
        # (356-node synthetic DAG at 0.33: its neighbourhood needs 8 s, and each start's round had 6)
        log(verbose, "no start's round beat the fastest start: RINS goes on from the fastest start")
        return form, _rins(form, plan, deadline, threads, verbose, accept, lp=first_lp)
    f, got, lp = winner
    return f, _rins(f, got, deadline, threads, verbose, accept, rounds=RINS_ROUNDS - 1, lp=lp) or got


def _relaxation(form: Formulation, seconds: float, threads: int, verbose: bool) -> MilpResult | None:
    """`form`'s LP relaxation solved within `seconds` (RINS' start), or None if not optimal."""
    lp = form.solve_milp(seconds, threads=threads, relax=True)
    if lp.x is None or lp.status != "optimal":
        log(verbose, f"RINS: LP relaxation {lp.status} in {lp.solve_time_s:.1f} s; skipped")
        return None
    log(verbose, f"RINS: LP relaxation {lp.objective:.4f} in {lp.solve_time_s:.1f} s")
    return lp


def _rins(
    form: Formulation,
    plan: Plan,
    deadline: float,
    threads: int,
    verbose: bool,
    accept,
    relaxations=None,
    rounds: int = RINS_ROUNDS,
    lp: MilpResult | None = None,
) -> Plan | None:
    """Relaxation-induced neighbourhood search (Danna, Rothberg & Le Pape 2005) from `plan`.

    Solves the LP relaxation of `form` once, then the MILP with every integer column fixed
    where the relaxation agrees with the incumbent; repeats with the new incumbent while it
    improves. HiGHS runs RINS itself, but only after its root cut rounds: on ResNet-50 b8 224
    at 0.33 (window 6) those took 42 s before its RINS took the multilevel plan from +60 % to
    +35 % predicted; the bare LP takes 2 s and the neighbourhood MILP 4 s to reach +38 %.
    Returns the best plan accepted (`accept(plan, objective)` replays and keeps it), or None.
    relaxations: a list the solved LP relaxation is appended to (its objective bounds the MILP).
    rounds: at most this many; lp: `form`'s LP relaxation, if solved before (else solved here)."""
    remaining = deadline - time.perf_counter()
    if lp is None:
        if remaining < 2.0:
            return None
        lp = _relaxation(form, RINS_LP_SHARE * remaining, threads, verbose)
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
        res = form.solve_milp(
            min(remaining, RINS_SUB_LIMIT_S), mip_gap=1e-4, threads=threads, warm=x, fixed=fixed
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


def _highs_beside_polish(
    form: Formulation, plan: Plan, warm, deadline: float, mip_gap: float, threads: int, verbose: bool, accept
) -> MilpResult:
    """HiGHS on `form` from `warm` (the vector of `plan`) until `deadline`, in a thread of its
    own, while `_polish` improves `plan` beside it with one sub-MILP at a time; polishing stops
    when HiGHS ends (optimal, or out of time). Returns HiGHS' run; `accept(plan, objective)`
    receives what polishing finds (plans of `form`: HiGHS' bound holds for them).

    One after the other, HiGHS' run was cut on a stall before its root node was done (ResNet-50
    b8 224, kept gradients, 0.4: 5.7 s, bound below its LP relaxation's) and polishing took the
    rest; HiGHS needs ~10 s for its root bound there (3.4 % against 6.3 %). Its branch and bound
    is mostly serial: beside one polishing worker it reached the same bound in 10 s as alone."""
    import threading

    done = threading.Event()
    cancel = threading.Event()  # set when polishing fails (an interrupt): HiGHS stops then too
    out: dict = {}
    best = [form.objective(warm)]  # the best objective polishing has reached (progress lines)

    def accept_best(plan: Plan, objective: float) -> bool:
        if accept(plan, objective):
            best[0] = min(best[0], objective)
            return True
        return False

    def run() -> None:
        try:
            out["res"] = form.solve_highs(
                max(0.5, deadline - time.perf_counter()),
                mip_gap=mip_gap,
                threads=threads,
                warm=warm,
                verbose=verbose,
                cancel=cancel,
                incumbent=lambda: best[0],
            )
        except BaseException as exc:  # (raised again in the caller's thread)
            out["error"] = exc
        finally:
            done.set()

    worker = threading.Thread(target=run, name="monet-opt-highs", daemon=True)
    worker.start()
    try:
        _polish(form, plan, deadline, 1, verbose, accept_best, stop=done.is_set)
    except BaseException:
        cancel.set()  # (Ctrl-C in the CLI: no wait for HiGHS' deadline)
        raise
    finally:
        worker.join()
    if "error" in out:
        raise out["error"]
    return out["res"]


def _polish(
    form: Formulation, plan: Plan, deadline: float, threads: int, verbose: bool, accept, stop=None
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
    Within each family, bands that recompute the most are visited first: there is the most to
    win, and time may run out. A pass that improves nothing, with every band's sub-MILP solved to
    optimality, proves the plan optimal in every band of that size: the bands then double (while
    a node band fits in the graph) and polishing goes on (356-node synthetic ResNet at 0.33: no
    16-stage or 24-node band improved RINS' plan, each solved in 0.3-0.7 s; doubled bands did,
    1.5877 -> 1.5839 s in 40 s). Every improved plan is a plan of `form`'s MILP (its dual bound
    still bounds it). Up to POLISH_WORKERS bands are solved at once, each HiGHS run in a thread of its own on one
    core; a band started before another band's improvement is kept only if it beats that.
    `accept(plan, objective)` replays and keeps a plan; `stop()`, if given, ends polishing early
    (no further band starts once it returns True)."""
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
        recomputed = [0.0] * an.n  # recompute time of each node in the plan, over all stages
        work = [0.0] * an.T  # recompute time of each stage
        for s, st in enumerate(plan.stages):
            for i, m, _g in st.recompute:
                cost = an.recompute_time(i, m)
                recomputed[i] += cost
                work[s] += cost
        hoods: list[tuple[float, str, range, float]] = []
        step = max(1, band_nodes // 2)
        for a in range(0, an.n, step):
            nodes = range(a, min(an.n, a + band_nodes))
            hoods.append((sum(recomputed[i] for i in nodes), "nodes", nodes, POLISH_NODE_LIMIT_S))
        step = max(1, span // 2)
        for a in range(0, an.T, step):
            stages = range(a, min(an.T, a + span))
            hoods.append((sum(work[s] for s in stages), "stages", stages, POLISH_SUB_LIMIT_S))
        # stage bands first (small sub-MILPs: quick steps from a rough plan), then node bands
        # (moves stage bands cannot make); each family by recompute work. Measured on ResNet-50
        # b8 224, 60-s solves, against stage bands alone: never worse, kept gradients 0.4 1.5763
        # -> 1.5665 s, Adam in the backward 1/3 1.7696 -> 1.7583; node bands first lost at 1/3
        # and at Adam 0.25 (1.8213 -> 1.8396: their 5-s sub-MILPs took the time)
        hoods.sort(key=lambda h: (h[1] != "stages", -h[0]))
        todo = hoods[::-1]  # (popped from the end: in order)
        running: dict = {}  # future -> its neighbourhood
        with ThreadPoolExecutor(workers) as pool:
            while todo or running:
                if stop is not None and stop():
                    todo.clear()
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
        if deadline - time.perf_counter() < 1.0:
            return


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
        form.solve_milp, min(remaining, limit), mip_gap=1e-4, threads=threads, warm=x, fixed=fixed
    )


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
