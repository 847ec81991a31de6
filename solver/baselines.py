"""Baseline strategies. Each returns an explicit `Schedule`, replayed by the simulator.

* `no_recompute`   plain PyTorch: keep every backward state, recompute nothing.
* `checkpoint_all` keep only segment-boundary values, recompute everything else once.
* `chen_sqrt`      Chen et al.: about sqrt(n) segments over the topological order.
* `greedy`         budget-driven: drop states of whole segments or single nodes and
                   switch to lower-memory implementations, best bytes per second first.
* `best_baseline`  the fastest of the above that fits a budget.

All but `no_recompute` go through one policy builder (`policy_schedule`): per node an
implementation, whether its state is kept from the forward (F), and whether its
value is kept (K); lazy recompute-once semantics fill in the backward stages.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
import time
from dataclasses import dataclass

from solver.plan import Analysis, Plan, lazy_plan, plan_of_schedule, plan_time, to_schedule
from solver.problem import Problem
from solver.schedule import Schedule, SolverInfo
from solver.simulate import simulate

_ANALYSIS_CACHE: dict[int, tuple[Problem, Analysis]] = {}


def analysis(problem: Problem) -> Analysis:
    """Cached `Analysis` of a problem (problems are immutable)."""
    hit = _ANALYSIS_CACHE.get(id(problem))
    if hit is not None and hit[0] is problem:
        return hit[1]
    an = Analysis(problem)
    if len(_ANALYSIS_CACHE) > 32:
        _ANALYSIS_CACHE.clear()
    _ANALYSIS_CACHE[id(problem)] = (problem, an)
    return an


def _impl_indices(an: Analysis, impls: dict[str, str] | list[int] | None) -> list[int]:
    if impls is None:
        return an.default_impls()
    if isinstance(impls, dict):
        out = an.default_impls()
        for name, im in impls.items():
            i = an.idx[name]
            out[i] = an.impl_index(i, im)
        return out
    return list(impls)


def policy_plan(problem: Problem, impl, F, K, levels=(), split=()) -> Plan:
    an = analysis(problem)
    return lazy_plan(an, _impl_indices(an, impl), set(F), set(K), levels, frozenset(split))


def policy_schedule(
    problem: Problem,
    impl=None,
    F=None,
    K=(),
    strategy: str = "policy",
    budget_bytes: int | None = None,
    solver_name: str | None = None,
    levels=(),
    split=(),
    plan: Plan | None = None,
) -> Schedule:
    """Schedule of a policy: impl (list of impl indices or {node: impl name}), F, K and the finer
    checkpoint levels [K2, K3, ...] (node indices; see `lazy_plan`); `plan`: its lazy plan, if
    made before."""
    an = analysis(problem)
    if F is None:
        F = {i for i in range(an.n) if an.rb[i]}
    impl = _impl_indices(an, impl)
    if plan is None:
        plan = lazy_plan(an, impl, set(F), set(K), levels, frozenset(split))
    policy = {
        "impl": {an.names[i]: an.impls[i][m].name for i, m in enumerate(impl) if m != 0},
        "F": [an.names[i] for i in sorted(F)],
        "K": [an.names[i] for i in sorted(K)],
    }
    if levels:
        policy["levels"] = [[an.names[i] for i in sorted(lv)] for lv in levels]
    if split:
        policy["split"] = [an.names[i] for i in sorted(split)]
    return to_schedule(
        an, plan, strategy, SolverInfo(name=solver_name or strategy), budget_bytes, meta={"policy": policy}
    )


def plan_of(problem: Problem, schedule: Schedule) -> Plan:
    """The plan of a schedule: a policy schedule's made by this module (from meta['policy']),
    else the one its steps follow (`solver.plan.plan_of_schedule`)."""
    pol = schedule.meta.get("policy")
    an = analysis(problem)
    if not pol:
        return plan_of_schedule(an, schedule)
    impl = _impl_indices(an, pol.get("impl", {}))
    levels = [frozenset(an.idx[x] for x in lv) for lv in pol.get("levels", [])]
    split = frozenset(an.idx[x] for x in pol.get("split", []))
    return lazy_plan(an, impl, {an.idx[x] for x in pol["F"]}, {an.idx[x] for x in pol["K"]}, levels, split)


# ---------------------------------------------------------------------------------------------
def no_recompute(problem: Problem, impls: dict[str, str] | None = None) -> Schedule:
    """Plain PyTorch: every state kept from the forward; values freed after their last forward use."""
    return policy_schedule(problem, impls, None, (), strategy="no_recompute")


def boundaries(an: Analysis) -> list[tuple[int, frozenset[int]]]:
    """Positions p in topological order with the set of values crossing from <= p to > p
    (`Analysis.crossings`); articulation points have crossing == {p}."""
    return list(enumerate(an.crossings))


def _crossing_bytes(an: Analysis, cross) -> int:
    return sum(an.a[b] for b in {an.base[j] for j in cross})


def _segments(an: Analysis, max_cross_nodes: int = 1) -> list[int]:
    """Cut positions (node indices) whose crossing set is small: segment ends."""
    cuts = []
    for p, cross in boundaries(an):
        if 0 < len(cross) <= max_cross_nodes:
            cuts.append(p)
    return cuts


def _policy_from_cuts(an: Analysis, cuts: list[int], impl: list[int]) -> tuple[set[int], set[int]]:
    """F = {} except outputs, K = values crossing each cut."""
    cross = an.crossings
    K: set[int] = set()
    for p in cuts:
        K |= cross[p]
    return set(), K


def checkpoint_all(problem: Problem, impls: dict[str, str] | None = None) -> Schedule:
    """Keep only the values crossing every articulation point; recompute every state once."""
    an = analysis(problem)
    cuts = _segments(an, 1)
    impl = _impl_indices(an, impls)
    F, K = _policy_from_cuts(an, cuts, impl)
    return policy_schedule(problem, impl, F, K, strategy="checkpoint_all")


def chen_sqrt(problem: Problem, impls: dict[str, str] | None = None) -> Schedule:
    """Chen et al. (2016): about sqrt(n) segments; boundary values kept, the rest recomputed."""
    an = analysis(problem)
    impl = _impl_indices(an, impls)
    cand = _segments(an, 1) or [p for p, c in boundaries(an) if c]
    k = max(1, round(math.sqrt(an.n)))
    seg_len = an.n / k
    chosen: list[int] = []
    for g in range(1, k):
        target = g * seg_len
        best = min(cand, key=lambda p: abs(p - target))
        if best not in chosen:
            chosen.append(best)
    F, K = _policy_from_cuts(an, sorted(chosen), impl)
    return policy_schedule(problem, impl, F, K, strategy="chen_sqrt")


def _even_cuts(an: Analysis, k: int) -> list[int]:
    cand = _segments(an, 1) or [p for p, c in boundaries(an) if c]
    if not cand or k <= 1:
        return []
    seg_len = an.n / k
    chosen: set[int] = set()
    for g in range(1, k):
        target = g * seg_len
        chosen.add(min(cand, key=lambda p: abs(p - target)))
    return sorted(chosen)


def segment_sweep(problem: Problem, budget: int | None = None, time_limit: float = 5.0) -> Schedule | None:
    """Chen-style segmentations with 2..n segments and two implementation profiles.

    With a budget: the fastest that fits (or None); without: the smallest peak.
    """
    t0 = time.perf_counter()
    an = analysis(problem)
    fast = an.fastest_impls()
    low = [min(range(len(ims)), key=lambda m, i=i: _state_cost(an, i, m)) for i, ims in enumerate(an.impls)]
    ks = sorted(
        {k for k in [2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128] if k <= an.n} | {round(math.sqrt(an.n))}
    )
    best: Schedule | None = None
    for impl in (fast, low):
        for k in ks:
            if time.perf_counter() - t0 > time_limit:
                break
            _F, K = _policy_from_cuts(an, _even_cuts(an, k), impl)
            sch = policy_schedule(problem, impl, set(), K, strategy="segment_sweep", budget_bytes=budget)
            if budget is None:
                if best is None or sch.predicted_peak_bytes < best.predicted_peak_bytes:
                    best = sch
            elif sch.predicted_peak_bytes <= budget and (
                best is None or sch.predicted_time_s < best.predicted_time_s
            ):
                best = sch
    return best


def _articulation_cuts(an: Analysis) -> list[int]:
    """One cut per run of consecutive single-value crossings (the cheapest, then the latest)."""
    cuts: list[int] = []
    run: list[int] = []
    for p, cross in boundaries(an) + [(an.n, frozenset())]:
        if len(cross) == 1 and p not in an.user_held and p < an.n - 1:
            run.append(p)
        elif run:
            cuts.append(min(run, key=lambda q: (_crossing_bytes(an, an.crossings[q]), -q)))
            run = []
    return cuts


def _inner_cuts(an: Analysis, coarse: list[int]) -> list[int]:
    """Cuts inside the articulation segments: the last position of each run of positions that
    two values cross with equal bytes (in a residual block: after each conv-bn-relu)."""

    def key(p: int):
        cross = an.crossings[p]
        return _crossing_bytes(an, cross) if len(cross) == 2 else None

    return [p for p in range(an.n - 1) if key(p) is not None and key(p) != key(p + 1) and p not in coarse]


# schedules `multilevel` may replay in its local search: ResNet-50 b8 224 (175 nodes) at 0.4
# of its no-recompute peak, kept gradients, reached its local optimum (1.7017 s) after 1210
# replays, 24 s on this 2-core machine; 400 reach 1.7154 s, 6.8 s with the scan before them.
# On the session-65 problems (ResNet-50 b8 224 kept gradients and Adam step, 0.8-0.25 of the
# no-recompute peak) 200 reach the same plans as 400 (Adam 0.25: 1.4848 s against 1.4832) in
# 3.3-4.4 s against 4.4-7.4 s: the rest only confirms a local optimum, and a solve's search
# starts from these plans anyway (session 69: kept 0.33 with the time saved, 1.2387 -> 1.2325 s)
REFINE_EVALS = 200


def multilevel(problem: Problem, budget: int | None = None, time_limit: float = 5.0) -> Schedule | None:
    """The best `multilevel_starts` schedule (the refined one), or None."""
    found = multilevel_starts(problem, budget, time_limit, starts=0)
    return found[0] if found else None


def multilevel_starts(
    problem: Problem,
    budget: int | None = None,
    time_limit: float = 5.0,
    starts: int = 2,
    max_evals: int = REFINE_EVALS,
) -> list[Schedule]:
    """Recursive checkpointing (Chen et al. 2016, section 4.2) over articulation points.

    The forward keeps every k-th articulation value (K); a K-segment is recomputed once
    down to its articulation values (level 2), optionally its inner cuts (level 3); states
    are made one articulation segment, or one node (`split`), at a time (`lazy_plan`).
    Tries k, offsets, levels, split and two implementation profiles; without a budget
    returns the smallest peak; with one, the fastest that fits, then improves it segment by
    segment (`_refine`) for at most `max_evals` schedules replayed (the same plan on every
    machine fast enough to finish them within `time_limit`). Returns that schedule first
    (none: []), then, with a budget, up to `starts` more: the fastest fitting policies of other
    tries, as they were before refining (starts for a search that should not all begin in one
    place: the MILP's RINS from each of four such plans of ResNet-50 b8 224 at 0.4 ended
    1.578-1.642 s, the best from the fastest unrefined one, 1.619 s from the refined plan).
    """
    t0 = time.perf_counter()
    an = analysis(problem)
    coarse = _articulation_cuts(an)
    if not coarse:
        return []
    inner = _inner_cuts(an, coarse)
    fast = an.fastest_impls()
    low = [min(range(len(ims)), key=lambda m, i=i: _state_cost(an, i, m)) for i, ims in enumerate(an.impls)]
    every = frozenset(range(an.n))
    scored: list[tuple] = []  # (key, order, config, schedule): smallest peak, or fastest fitting
    ks = sorted({k for k in (1, 2, 3, 4, 6, len(coarse) + 1) if k <= len(coarse) + 1})
    configs = [
        (impl, k, off, fine, split)
        for split in (True, False)
        for impl in (low, fast)
        for k in ks
        for off in range(min(k, 3))
        for fine in (False, True)
    ]
    for impl, k, off, fine, split in configs:
        if time.perf_counter() - t0 > time_limit / 2:
            break
        top = {c for j, c in enumerate(coarse) if j % k == off}
        config = _MultiLevel(
            list(impl),
            frozenset(),
            frozenset(top),
            frozenset(inner) if fine else frozenset(),
            every if split else frozenset(),
        )
        sch = config.schedule(problem, an, coarse, budget)
        if budget is None:
            key = (sch.predicted_peak_bytes, sch.predicted_time_s)
        elif sch.predicted_peak_bytes <= budget:
            key = (sch.predicted_time_s,)
        else:
            continue
        scored.append((key, len(scored), config, sch))
    if not scored:
        return []
    scored.sort()
    out = scored[0][3]
    if budget is None:
        return [out]
    # local search from the fastest fitting policies in turn (each ends in a local optimum)
    distinct = sorted({round(entry[3].predicted_time_s, 9): entry for entry in scored}.values())
    evals = [max_evals]  # replays left, shared by the local searches
    for _key, _n, config, sch in distinct[:4]:
        if time.perf_counter() > t0 + time_limit or evals[0] <= 0:
            break
        found = _refine(problem, an, coarse, inner, fast, low, budget, config, sch, t0 + time_limit, evals)
        if found.predicted_time_s < out.predicted_time_s:
            out = found
    return [out] + [entry[3] for entry in distinct if entry[3] is not out][:starts]


@dataclass(frozen=True)
class _MultiLevel:
    """A `multilevel` policy: implementations, forward-kept states F, the articulation cuts
    whose values the forward keeps (top; the other articulation cuts are level 2), the inner
    cuts of level 3, and the split nodes (ends of the finest segments)."""

    impl: list[int]
    F: frozenset[int]
    top: frozenset[int]
    fine: frozenset[int]
    split: frozenset[int]

    def _kept(self, an, coarse) -> tuple[set[int], list[frozenset[int]]]:
        cross = an.crossings
        K = {v for c in self.top for v in cross[c]}
        levels = [frozenset(v for c in coarse for v in cross[c]) - K]
        if self.fine:
            levels.append(frozenset(v for c in self.fine for v in cross[c]) - K - levels[0])
        return K, levels

    def plan(self, an, coarse) -> Plan:
        K, levels = self._kept(an, coarse)
        return lazy_plan(an, self.impl, set(self.F), K, levels, self.split)

    def schedule(self, problem, an, coarse, budget, plan: Plan | None = None) -> Schedule:
        """The policy's schedule (`plan`: its `plan`, if made before)."""
        K, levels = self._kept(an, coarse)
        return policy_schedule(
            problem,
            self.impl,
            set(self.F),
            K,
            strategy="multilevel",
            budget_bytes=budget,
            levels=levels,
            split=self.split,
            plan=plan,
        )


def _refine(problem, an, coarse, inner, fast, low, budget, config, sched, deadline, evals) -> Schedule:
    """First-improvement local search on a fitting multilevel policy: per articulation segment,
    keep its states from the forward, drop or add its split and inner cuts, use the fast or the
    low-memory implementations; per articulation cut, keep it in the forward or not; per node,
    keep its state from the forward, merge its finest segment with the next, use its fastest
    implementation. Stops at `deadline` or when `evals[0]` (replays left) reaches 0; a move
    whose plan is no faster (`plan_time`) costs no replay."""
    bounds = [-1] + list(coarse) + [an.n - 1]
    segments = [list(range(bounds[g] + 1, bounds[g + 1] + 1)) for g in range(len(bounds) - 1)]
    inner_of = [[c for c in inner if seg[0] <= c <= seg[-1]] for seg in segments]
    rb_of = [frozenset(i for i in seg if an.rb[i] and i not in an.user_held) for seg in segments]

    def apply(cfg: _MultiLevel, mv: tuple) -> _MultiLevel | None:
        kind, x = mv
        if kind == "seg_F":
            return None if rb_of[x] <= cfg.F else dataclasses.replace(cfg, F=cfg.F | rb_of[x])
        if kind == "seg_split":
            members = frozenset(segments[x])
            split = cfg.split - members if cfg.split & members else cfg.split | members
            return dataclasses.replace(cfg, split=split)
        if kind == "seg_fine":
            fin = frozenset(inner_of[x])
            return dataclasses.replace(cfg, fine=cfg.fine - fin if fin <= cfg.fine else cfg.fine | fin)
        if kind in ("seg_fast", "seg_low"):
            prof = fast if kind == "seg_fast" else low
            impl = list(cfg.impl)
            for i in segments[x]:
                impl[i] = prof[i]
            return None if impl == cfg.impl else dataclasses.replace(cfg, impl=impl)
        if kind == "top":
            return dataclasses.replace(cfg, top=cfg.top ^ {x})
        if kind == "node_F":
            return None if x in cfg.F else dataclasses.replace(cfg, F=cfg.F | {x})
        if kind == "node_merge":
            return None if x not in cfg.split else dataclasses.replace(cfg, split=cfg.split - {x})
        impl = list(cfg.impl)  # node_fast
        impl[x] = fast[x]
        return None if impl == cfg.impl else dataclasses.replace(cfg, impl=impl)

    moves: list[tuple] = []
    for g in range(len(segments)):
        moves += [("seg_F", g), ("seg_split", g), ("seg_fast", g), ("seg_low", g)]
        if inner_of[g]:
            moves.append(("seg_fine", g))
    moves += [("top", c) for c in coarse]
    for i in range(an.n):
        if an.rb[i] and i not in an.user_held:
            moves.append(("node_F", i))
        moves += [("node_merge", i), ("node_fast", i)]
    # first improvement, cycling through the moves from the last one taken until a whole
    # cycle improves nothing
    k = since = 0
    while since < len(moves) and time.perf_counter() < deadline and evals[0] > 0:
        cand = apply(config, moves[k])
        k = (k + 1) % len(moves)
        since += 1
        if cand is None:
            continue
        plan = cand.plan(an, coarse)
        if plan_time(an, plan) >= sched.predicted_time_s - 1e-9:
            continue  # (no faster: not worth emitting and simulating)
        s2 = cand.schedule(problem, an, coarse, budget, plan)
        evals[0] -= 1
        if s2.predicted_peak_bytes <= budget and s2.predicted_time_s < sched.predicted_time_s - 1e-9:
            config, sched, since = cand, s2, 0
    return sched


# ---------------------------------------------------------------------------------------------
class _Evaluator:
    def __init__(self, problem: Problem) -> None:
        self.problem = problem
        self.an = analysis(problem)
        self.n_evals = 0

    def schedule(self, impl, F, K, strategy="greedy", budget=None) -> Schedule:
        return policy_schedule(self.problem, impl, F, K, strategy=strategy, budget_bytes=budget)

    def evaluate(self, impl, F, K) -> tuple[int, float]:
        self.n_evals += 1
        sch = self.schedule(impl, F, K)
        return sch.predicted_peak_bytes, sch.predicted_time_s


def _units(an: Analysis, min_size: int = 3) -> list[tuple[int, list[int]]]:
    """Recompute units: runs of nodes between articulation points, merged to >= min_size nodes.

    Each unit is (start cut, members): dropping the members' states and keeping the
    values crossing the start cut makes the unit recompute from there.
    """
    cuts = _segments(an, 1)
    units: list[tuple[int, list[int]]] = []
    prev = -1
    members: list[int] = []
    for p in cuts + [an.n - 1]:
        members += [i for i in range(prev + 1, p + 1)]
        if len(members) >= min_size or p == an.n - 1:
            start = units[-1][1][-1] if units else -1
            units.append((start, members))
            members = []
        prev = p
    return [(st, [i for i in m if an.rb[i] and i not in an.user_held]) for st, m in units if m]


def greedy(
    problem: Problem,
    budget: int,
    time_limit: float = 10.0,
    max_evals: int = 2000,
) -> Schedule | None:
    """Budget-driven heuristic: the fastest fitting schedule found, or None.

    Starts from no recompute with the fastest implementations. Moves: recompute a
    unit (the nodes between two articulation points, at two granularities: drop
    their kept states, keep the values crossing the unit's start), or switch every
    node of one operator type to its lowest-memory implementation. Each step applies
    the move with the most bytes of peak saved per second of time added (lazy
    priority queue, re-evaluated with the simulator) until the schedule fits; a
    clean-up pass then restores states and fast implementations that still fit.
    """
    t0 = time.perf_counter()
    ev = _Evaluator(problem)
    an = ev.an
    budget = int(budget)
    best: tuple[float, tuple] | None = None

    def consider(impl, F, K, peak, tm):
        nonlocal best
        if peak <= budget and (best is None or tm < best[0]):
            best = (tm, (list(impl), set(F), set(K)))

    impl0 = an.fastest_impls()
    low = [min(range(len(ims)), key=lambda m, i=i: _state_cost(an, i, m)) for i, ims in enumerate(an.impls)]
    F0 = {i for i in range(an.n) if an.rb[i]}
    cross = an.crossings
    units = _units(an, 3) + _units(an, 12)
    ops = sorted({problem.nodes[i].op for i in range(an.n) if low[i] != impl0[i]})

    def moves(impl, F):
        out = [("unit", g) for g, (_s, mem) in enumerate(units) if any(i in F for i in mem)]
        for op in ops:
            if any(problem.nodes[i].op == op and impl[i] != low[i] for i in range(an.n)):
                out.append(("impl", op))
        return out

    def apply(mv, impl, F, K):
        impl, F, K = list(impl), set(F), set(K)
        if mv[0] == "unit":
            start, members = units[mv[1]]
            F -= set(members)
            if start >= 0:
                K |= cross[start]
        else:
            for i in range(an.n):
                if problem.nodes[i].op == mv[1]:
                    impl[i] = low[i]
        return impl, F, K

    def score(dp, dt):
        if dp <= 0:
            return -math.inf
        return dp / max(dt, 1e-9)

    def out_of_time():
        return time.perf_counter() - t0 > time_limit or ev.n_evals > max_evals

    state = (impl0, F0, set())
    peak, tm = ev.evaluate(*state)
    consider(*state, peak, tm)
    if peak > budget:
        heap: list[tuple[float, int, tuple]] = []
        cnt = 0
        for mv in moves(state[0], state[1]):
            heapq.heappush(heap, (-math.inf, cnt, mv))  # unknown: evaluate on pop
            cnt += 1
        stale: set[int] = set()
        while heap and peak > budget and not out_of_time():
            _negs, c, mv = heapq.heappop(heap)
            cand = apply(mv, *state)
            p2, t2 = ev.evaluate(*cand)
            s2 = score(peak - p2, t2 - tm)
            if heap and -heap[0][0] > s2 and c not in stale:
                stale.add(cnt)
                heapq.heappush(heap, (-s2, cnt, mv))
                cnt += 1
                continue
            if s2 == -math.inf:
                # no move lowers the peak alone: take the one saving most bytes of states
                continue
            state, peak, tm = cand, p2, t2
            consider(*state, peak, tm)
            live = set(moves(state[0], state[1]))
            heap = [(h, c2, m2) for h, c2, m2 in heap if m2 in live]
            heapq.heapify(heap)
            stale = set()
        if best is None:
            # fall back: everything recomputed by units, low-memory impls
            for impl in (impl0, low):
                st = (impl, set(), set())
                for _g, (start, _m) in enumerate(units[: len(_units(an, 3))]):
                    if start >= 0:
                        st[2].update(cross[start])
                p2, t2 = ev.evaluate(*st)
                consider(*st, p2, t2)
    if best is None:
        return None
    impl, F, K = best[1]
    tm = best[0]
    # clean-up: restore units' states, then single states, then fast impls, while it fits
    for g in range(len(units)):
        if out_of_time():
            break
        mem = set(units[g][1])
        if mem and not mem <= F:
            p2, t2 = ev.evaluate(impl, F | mem, K)
            if p2 <= budget and t2 < tm - 1e-12:
                F, tm = F | mem, t2
    for i in range(an.n):
        if out_of_time():
            break
        if an.rb[i] and i not in F:
            p2, t2 = ev.evaluate(impl, F | {i}, K)
            if p2 <= budget and t2 < tm - 1e-12:
                F, tm = F | {i}, t2
        if impl[i] != impl0[i]:
            im2 = list(impl)
            im2[i] = impl0[i]
            p2, t2 = ev.evaluate(im2, F, K)
            if p2 <= budget and t2 < tm - 1e-12:
                impl, tm = im2, t2
    return ev.schedule(impl, F, K, strategy="greedy", budget=budget)


def all_baselines(
    problem: Problem, budget: int | None = None, greedy_time: float = 10.0
) -> dict[str, Schedule]:
    out = {
        "no_recompute": no_recompute(problem),
        "checkpoint_all": checkpoint_all(problem),
        "chen_sqrt": chen_sqrt(problem),
    }
    an = analysis(problem)
    low = [
        min(range(len(ims)), key=lambda m, ims=ims: _state_cost(an, i, m)) for i, ims in enumerate(an.impls)
    ]
    out["checkpoint_all_lowmem"] = policy_schedule(
        problem, low, set(), _policy_from_cuts(an, _segments(an, 1), low)[1], strategy="checkpoint_all_lowmem"
    )
    sweep = segment_sweep(problem, budget)
    if sweep is not None:
        out["segment_sweep"] = sweep
    deep = multilevel_starts(problem, budget, time_limit=greedy_time)
    if deep:
        out["multilevel"] = deep[0]
    for k, start in enumerate(deep[1:]):
        out[f"multilevel_start{k + 1}"] = start
    if budget is not None:
        g = greedy(problem, budget, time_limit=greedy_time)
        if g is not None:
            out["greedy"] = g
    return out


def _state_cost(an: Analysis, i: int, m: int) -> tuple:
    """Memory an implementation adds: what its backward keeps, plus the larger of its forward
    transient and its backward transient (workspace less any gradient written in place)."""
    im = an.impls[i][m]
    kept = im.state_bytes + sum(an.a[b] for b in an.kept_bases[i][m])
    transient = max(im.fwd_workspace, im.bwd_workspace - an.grad_saving(i, m))
    return (kept + transient, im.fwd_time + im.bwd_time)


def fitting_baselines(problem: Problem, budget: int, greedy_time: float = 10.0) -> list[Schedule]:
    """The baseline schedules whose simulated peak fits `budget`, fastest first."""
    fits = [
        s for s in all_baselines(problem, budget, greedy_time).values() if s.predicted_peak_bytes <= budget
    ]
    fits.sort(key=lambda s: s.predicted_time_s)
    return [Schedule(**{**s.__dict__, "budget_bytes": int(budget)}) for s in fits]


def best_baseline(problem: Problem, budget: int, greedy_time: float = 10.0) -> Schedule | None:
    """The fastest baseline schedule whose simulated peak fits `budget`, or None."""
    fits = fitting_baselines(problem, budget, greedy_time)
    return fits[0] if fits else None


def min_known_peak(problem: Problem) -> tuple[int, str]:
    """The smallest simulated peak among the budget-free baselines, and which one."""
    s = lowest_peak_baseline(problem)
    return s.predicted_peak_bytes, s.strategy


def lowest_peak_baseline(problem: Problem) -> Schedule:
    """The budget-free baseline with the smallest simulated peak (the fastest among equals)."""
    scheds = all_baselines(problem, None)
    name = min(scheds, key=lambda k: (scheds[k].predicted_peak_bytes, scheds[k].predicted_time_s))
    return scheds[name]


__all__ = [
    "no_recompute",
    "checkpoint_all",
    "chen_sqrt",
    "greedy",
    "best_baseline",
    "segment_sweep",
    "multilevel",
    "policy_schedule",
    "min_known_peak",
    "lowest_peak_baseline",
    "simulate",
]
