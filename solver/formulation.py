"""The MILP over one stage per backward node: its columns and rows, built as sparse matrices, and its runs on HiGHS.

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
                              (R[s,t,m] of an implementation with `bwd_from_inputs`: a make_state
                              step, no forward time, and its step row counts no output or
                              workspace of t; R[s,t,m] <= k[t,m]: see `Analysis.makes_state_only`)

Recompute windows: the full grid has O(n^2) columns (ResNet-50 at 224: 80k columns,
133k rows; HiGHS does not finish even the LP relaxation in 120 s). A window w keeps
columns only for nodes within w topological positions of each stage's node (see
`Formulation`); w=6 is ~9k columns and solves to optimality in seconds. `solver.milp.solve`
widens the window (6, 12, 24, unbounded), each MILP warm-started from the best plan
so far, while the next one fits in the time left (`solver.milp.WIDEN_FACTOR`) and no plan has reached
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

import os
import re
import sys
import time
from dataclasses import dataclass

import numpy as np
import scipy.sparse as sp

from solver.plan import Analysis, Plan, StagePlan
from solver.progress import log


@dataclass
class MilpResult:
    plan: Plan | None
    status: str  # optimal / time_limit / infeasible / no_solution / unproven (`Formulation.result`)
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
                    md.var(cost=an.entry_time(t, t, m, True) + ims[m].bwd_time)
                    if i == t
                    else md.var(cost=an.recompute_time(i, m))
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
        # a state made from t's inputs in t's own stage follows t's forward of that implementation
        md.tag = ("make_state",)
        for s, t in enumerate(an.bw):
            for m, c in enumerate(self.R[s].get(t, [])[: nimp[t]]):
                if an.makes_state_only(t, m):
                    md.row([c, self.k[t][m]], [1.0, -1.0], -INF, 0.0)

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
                        if i == t and an.makes_state_only(t, m):
                            continue  # (a make_state step: no output, no workspace)
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
            # workspace: without grad k's, with grad (F <= k) F's instead
            ws_cols, ws_coefs = [], []
            for m in range(nimp[i]):
                im = an.impls[i][m]
                if im.forward_workspace(False):
                    ws_cols.append(self.k[i][m])
                    ws_coefs.append(im.forward_workspace(False))
                if i in F and im.fwd_workspace != im.forward_workspace(False):
                    ws_cols.append(F[i][m])
                    ws_coefs.append(im.fwd_workspace - im.forward_workspace(False))
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

    def written_out(self, rows: list[int]) -> list[dict[int, float]]:
        """Each of `rows` with its `_sum_col` columns written out as the terms they stand for
        (column -> coefficient; a sum may read earlier sums: written out in turn). The same
        constraint at any point where each sum column equals its terms (a plan's vector), and
        what a probe of the rows' structure reads (cover cuts, knapsacks over binaries)."""
        sums = {y: (cols, coefs) for y, cols, coefs, _r in self.sums}
        memo: dict[int, dict[int, float]] = {}

        def terms_of(c: int) -> dict[int, float]:
            if c not in sums:
                return {c: 1.0}
            if c not in memo:
                out: dict[int, float] = {}
                for c2, v in zip(*sums[c]):
                    for c3, v3 in terms_of(c2).items():
                        out[c3] = out.get(c3, 0.0) + v * v3
                memo[c] = out
            return memo[c]

        A = self.matrix().tocsr()
        written = []
        for r in rows:
            row: dict[int, float] = {}
            for c, v in zip(A.indices[A.indptr[r] : A.indptr[r + 1]], A.data[A.indptr[r] : A.indptr[r + 1]]):
                for c2, v2 in terms_of(int(c)).items():
                    row[c2] = row.get(c2, 0.0) + v * v2
            written.append({c: v for c, v in row.items() if abs(v) > 1e-9})
        return written

    def matrix(self) -> sp.csc_matrix:
        md = self.md
        return sp.csc_matrix(
            (np.asarray(md.vals, dtype=float), (np.asarray(md.r_idx), np.asarray(md.c_idx))),
            shape=(self.n_rows, self.n_cols),
        )

    def point_of(self, plan: Plan, objective: float) -> np.ndarray | None:
        """`plan`'s vector if it is a feasible point of this MILP at `objective`, else None (a
        plan that needs columns the MILP lacks violates its rows, or costs something else here)."""
        x = self.plan_to_vector(plan)
        if self.violations(x) or abs(self.objective(x) - objective) > 1e-6 * max(1.0, abs(objective)):
            return None
        return x

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
        recomputation and its backward; a state made from the inputs, `Impl.bwd_from_inputs`,
        follows a forward of the same implementation, so costs more than keeping that one's).
        Nothing recomputed, every node at its fastest implementation, reaches it wherever keeping
        is the cheaper of the two."""
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
        options: dict | None = None,
        supply=None,
        found=None,
    ) -> MilpResult:
        """fixed: column -> value, held there (the neighbourhoods of `polish`).
        stall_s: give up if HiGHS has found nothing better than `warm` by the end of its root
        node or after stall_s seconds (on hard budgets the root's cut rounds can take the whole
        limit, and branching rarely finds what the root's heuristics did not: the caller has
        better uses for the time).
        relax: solve the LP relaxation instead (integrality dropped); the result has `x` and the
        LP's objective, and no plan.
        cancel: a `threading.Event`; once set, the run stops as at its time limit (a run in a
        thread of its own whose caller gave up: `highs_beside_polish`).
        incumbent: returns the best plan's objective so far, found elsewhere (polishing beside
        this run), or None; verbose progress lines then give HiGHS' bound against it.
        options: HiGHS options over `highs_options`, for this run.
        supply: returns a solution vector of this MILP found elsewhere (this formulation's
        units), or None; HiGHS takes it as its incumbent when it next asks for one (a better
        incumbent prunes its tree and stops it at `mip_gap`).
        found: called with each improving solution HiGHS finds or takes (this formulation's
        units), in HiGHS' thread, as it finds it."""
        highspy = import_highspy()
        t_enter = time.perf_counter()
        md = self.md
        highs_log = bool(verbose) and os.environ.get("MONET_OPT_HIGHS_LOG", "") == "1"
        h = new_highs(highspy, highs_log)
        h.setOptionValue("output_flag", highs_log)
        h.setOptionValue("log_to_console", highs_log)
        h.setOptionValue("time_limit", max(0.5, float(time_limit)))
        h.setOptionValue("mip_rel_gap", float(mip_gap))
        h.setOptionValue("threads", int(threads))
        h.setOptionValue("random_seed", 0)
        if self.n_cols > 150_000:
            # HiGHS' presolve cannot be interrupted and takes minutes at this size
            h.setOptionValue("presolve", "off")
        for key, val in {**(self.highs_options or {}), **(options or {})}.items():
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
        # the warm start waiting for HiGHS' first call for a user solution (`_user_solution`)
        start_pending = []
        presolve = h.getOptionValue("presolve")
        presolve_on = (presolve[1] if isinstance(presolve, tuple) else presolve) != "off"
        if warm_model is not None and presolve_on and not relax:
            # HiGHS 1.16 maps a start set before its presolve into the presolved space without
            # checking the point postsolve makes of it, and prunes by its objective there: on a
            # 10-node chain (471 columns) it took a 0.027678-s start as 0.025289 ("untransformed
            # violations" of a row) and called it optimal where the MILP's optimum is 0.027044.
            # A solution handed over in its user-solution callback is postsolved and checked first
            # (the same start there: refused, and the run found 0.027044)
            start_pending.append(warm_model)
        elif warm_model is not None:
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
            if found is not None and len(sol) == len(scaled.cost):
                found(scaled.from_model(np.asarray(sol, dtype=float)))

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
                    note = f"bound {bound:.4f}: the best plan ({best:.4f}) within {(best - bound) / best:.1%}"
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

        def _user_solution(event) -> None:
            if start_pending:
                event.data_in.setSolution(np.asarray(start_pending.pop(), dtype=float))
                return
            x = supply() if supply is not None else None
            if x is not None:
                event.data_in.setSolution(np.asarray(scaled.to_model(x), dtype=float))

        callbacks = [
            (h.cbSimplexInterrupt, _stop_at_deadline),
            (h.cbIpmInterrupt, _stop_at_deadline),
            (h.cbMipInterrupt, _stop_mip),
            (h.cbMipImprovingSolution, _improving),
        ]
        if supply is not None or start_pending:
            callbacks.append((h.cbMipUserSolution, _user_solution))
        for cb, fn in callbacks:
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
        return self.result(
            status, scaled, x_model, float(info.mip_dual_bound), solve_time, relax, own_gap, mip_gap
        )

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
        mip_gap: float | None = None,
    ) -> MilpResult:
        """A backend's run as a `MilpResult` in this formulation's units. x_model: the solution
        vector in model units (None: no solution); bound_model: the backend's dual bound (model
        units); own_gap: the backend's own gap when it proved optimality (may be below ours);
        mip_gap: the gap it was asked for. A run the backend calls optimal whose own bound does
        not prove the plan within mip_gap is "unproven" (its bound stands, its claim does not)."""
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
            if status == "optimal" and mip_gap is not None and gap > mip_gap * (1 + 1e-6) + 1e-9:
                # the backend's claim rests on an incumbent value of its own that is not this
                # plan's (HiGHS 1.16 with a start set before presolve: `solve_highs`)
                status = "unproven"
            elif own_gap is not None:
                gap = min(gap, own_gap)
        elif status != "infeasible":
            status = "no_solution"
            # a run stopped before it found a plan still bounds its MILP (HiGHS' root LP with the
            # cuts so far; ResNet-50 b8 224, kept gradients, 0.33 of the no-recompute peak: the
            # early run's 52 s all in its root node, with no incumbent)
            b = bound_model / scaled.cost_factor
            if np.isfinite(b) and b > 0:
                bound = max(b, self.trivial_time_bound() if self.peak_col is None else 0.0)
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


_HIGHS_GREETED = False


# the oldest highspy whose MIP callbacks `solve_highs` uses all work: 1.8-1.10 have no user-solution
# callback (`supply`; AttributeError), 1.11-1.15 call it but drop the solution handed over
# (`BoundRun`'s test fails on them), 1.7 has no callbacks at all
HIGHSPY_MIN = (1, 16)


def import_highspy():
    """highspy, or ImportError naming the version needed (pyproject asks for it; an older one
    already installed in the environment would otherwise fail deep inside a solve)."""
    from importlib.metadata import PackageNotFoundError, version

    import highspy

    try:
        found = version("highspy")
    except PackageNotFoundError:  # (no metadata: a build of its own; trust it)
        return highspy
    parts = tuple(int(p) for p in re.findall(r"\d+", found)[:2])
    if parts < HIGHSPY_MIN:
        need = ".".join(map(str, HIGHSPY_MIN))
        raise ImportError(
            f"monet-opt's solver needs highspy >= {need}, found {found}: pip install -U 'highspy>={need}'"
        )
    return highspy


def new_highs(highspy, verbose: bool):
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
