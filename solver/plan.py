"""Shared machinery for strategies: problem analysis, stage plans, and the emitter.

A `Plan` is the stage-wise description every strategy produces (the MILP's
variables map onto it one to one):

* forward: implementation per node, `F` (nodes computed with grad=True in the
  forward, i.e. whose backward state is kept from the forward), `S0` (value
  handles held when the forward ends);
* per backward stage s (node t_s, reverse topological order): the recomputes
  `(node, impl, grad)` in topological order, then the handles `carry_vals` and
  states `carry_states` held when the next stage starts.

`emit(plan)` turns it into an explicit `Schedule` (compute / backward / free
steps), freeing every value and state as early as the plan allows. The
schedule is then judged by `solver.simulate`, which shares no code with this.

`lazy_plan(analysis, impl, F, K)` is the policy builder used by the baselines:
lazy recompute-once semantics (see its docstring).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from solver.problem import Problem, ProblemError
from solver.schedule import DEFERRED_META, Schedule, SolverInfo, Stage, Step


class Analysis:
    """Index-based facts about a problem that every strategy needs."""

    def __init__(self, problem: Problem) -> None:
        self.problem = problem
        nodes = problem.nodes
        self.n = n = len(nodes)
        self.names = [nd.name for nd in nodes]
        idx = {nd.name: i for i, nd in enumerate(nodes)}
        self.idx = idx
        self.inputs = [[idx[x] for x in nd.inputs] for nd in nodes]
        self.uinputs = [sorted(set(ins)) for ins in self.inputs]
        self.is_view = [nd.alias_of is not None for nd in nodes]
        self.base = [0] * n
        for i, nd in enumerate(nodes):
            self.base[i] = self.base[self.inputs[i][nd.alias_of]] if nd.alias_of is not None else i
        self.a = [0 if self.is_view[i] else nodes[i].output_bytes for i in range(n)]
        self.rb = [nd.requires_backward for nd in nodes]
        self.impls = [nd.impls for nd in nodes]
        self.nimp = [len(ims) for ims in self.impls]
        # restores[i]: (consumer index, consumer impl index, Restore); a plan's recompute entry
        # (i, m, False) with m >= nimp[i] is restore m - nimp[i]
        self.restores: list[list[tuple[int, int, object]]] = [
            [
                (idx[r.consumer], [im.name for im in nodes[idx[r.consumer]].impls].index(r.consumer_impl), r)
                for r in nd.restores
            ]
            for nd in nodes
        ]
        self.consumers: list[list[int]] = [[] for _ in range(n)]
        for i in range(n):
            for j in self.uinputs[i]:
                self.consumers[j].append(i)
        self.lastfwd = [max(c) if c else -1 for c in self.consumers]
        # storage of base b is live in the forward (without keeping) until lastfs[b]
        self.lastfs = list(range(n))
        for v in range(n):
            b = self.base[v]
            self.lastfs[b] = max(self.lastfs[b], v, self.lastfwd[v])
        self.outputs = [i for i in range(n) if nodes[i].is_output]
        # held by the user through the backward (never recomputed); an output the user drops
        # once the loss is computed (`user_holds` False) is held to the end of the forward only
        held = [i for i in self.outputs if nodes[i].user_holds]
        self.user_bases = sorted({self.base[i] for i in held})
        self.user_held = set(self.user_bases) | set(held)
        self.dropped = {i for i in self.outputs if not nodes[i].user_holds}
        self.dropped |= {self.base[i] for i in self.dropped}
        self.dropped -= self.user_held
        self.user_bytes = sum(self.a[b] for b in self.user_bases)
        # backward stages
        self.bw = [i for i in range(n - 1, -1, -1) if self.rb[i]]
        self.T = len(self.bw)
        self.stage_of = {t: s for s, t in enumerate(self.bw)}
        # kept storages (bases) of each (node, impl)
        self.kept_bases: list[list[tuple[int, ...]]] = []
        for i, nd in enumerate(nodes):
            row = []
            for im in nd.impls:
                ks = {self.base[self.inputs[i][p]] for p in im.keeps_inputs}
                if im.keeps_output:
                    ks.add(self.base[i])
                row.append(tuple(sorted(ks)))
            self.kept_bases.append(row)
        # (i, m) makes a state that costs nothing: no private bytes, keeps no storage
        self.free_state = [
            [not im.state_bytes and not self.kept_bases[i][m] for m, im in enumerate(self.impls[i])]
            for i in range(n)
        ]
        self._grad_constants()
        self._anc: list[frozenset[int]] | None = None
        self._crossings: list[frozenset[int]] | None = None

    def _grad_constants(self) -> None:
        """Gradient bytes live during each backward stage, which no schedule changes.

        Gradients are buffers, as in `solver.simulate`: an addition hands its gradient to both
        arguments, one buffer counted once while both hold it. An input shares its node's fed
        buffer here only if every implementation of the node hands it over (`grad_in_place` or
        `grad_shared`), so where implementations differ these constants are upper bounds."""
        nodes = self.problem.nodes
        grads = _GradBuffers()
        for i in self.outputs:
            if self.rb[i] and nodes[i].output_grad:  # (the user's loss gives it a gradient)
                grads.slot[i] = grads.new(nodes[i].grad_bytes)
                grads.holders[grads.slot[i]].update({("loss", i), ("slot", i)})  # (to i's backward's end)
                grads.loss[i] = grads.slot[i]
                grads.loss_made.add(grads.slot[i])
        pgrad = 0
        self.stage_const: list[int] = []  # fixed + user-held outputs + live grads + param grads
        self.bwd_extra_base: list[int] = []  # new input grads + param grads of t (transient)
        self.fed_shared: list[bool] = [False] * self.n  # t's gradient buffer is shared at its backward
        # per stage and implementation of t: the most gradient bytes (buffers and t's parameter
        # gradients) live above stage_const once t's state is dropped: while its input gradients
        # are summed into new buffers, and at an optimizer step in the backward (None: neither)
        self.bwd_after: list[list[int] | None] = []
        for t in self.bw:
            if t not in grads.slot:
                raise ProblemError(
                    f"node {self.names[t]!r} needs a backward but no gradient reaches it "
                    "(no consumer with a backward and not an output)"
                )
            self.stage_const.append(self.problem.fixed_bytes + self.user_bytes + grads.live + pgrad)
            gin = [j for j in self.inputs[t] if self.rb[j]]
            self.bwd_extra_base.append(sum(nodes[j].grad_bytes for j in gin) + nodes[t].param_grad_bytes)
            # (an optimizer step in the backward frees its parameters' gradients from the next
            # stage on)
            pgrad += nodes[t].param_grad_bytes - nodes[t].param_grad_freed_bytes
            after = []
            for im in self.impls[t]:
                trial = grads.copy()
                peak = self._backward_buffers(trial, t, self._receivers(t, im), im.grad_in_place is not None)
                step = nodes[t].param_step_bytes
                if step:  # the optimizer's temporaries, once every input gradient is accumulated
                    peak = trial.live + step if peak is None else max(peak, trial.live + step)
                after.append(None if peak is None else peak - grads.live + nodes[t].param_grad_bytes)
            self.bwd_after.append(
                None
                if all(a is None for a in after)
                else [nodes[t].param_grad_bytes if a is None else a for a in after]
            )
            self.fed_shared[t] = grads.shared(grads.slot[t])
            receive = set.intersection(*(self._receivers(t, im) for im in self.impls[t]))
            copies = any(im.grad_in_place is not None for im in self.impls[t])
            self._backward_buffers(grads, t, receive, copies)

    def _backward_buffers(self, grads: _GradBuffers, t: int, receive: set[int], copies: bool) -> int | None:
        """t's backward on the gradient buffers, as `solver.simulate` does it: its gradient fed
        (copied first if shared and `copies`), a new buffer per input that needs a gradient but the
        positions in `receive` (they get the fed one), each accumulated in turn. Returns the
        most bytes live while a sum is made into a new buffer (None: none is)."""
        nodes = self.problem.nodes
        own = grads.slot.pop(t)
        fed = grads.new(nodes[t].grad_bytes) if copies and grads.shared(own) else own
        grads.holders[fed].add(("fed", t))
        grads.release(own, ("slot", t))
        made = [
            (j, fed if pos in receive else grads.new(nodes[j].grad_bytes))
            for pos, j in enumerate(self.inputs[t])
            if self.rb[j]
        ]
        peak = None
        for j, b in made:
            grads.holders[b].add(("new", j))
            prev = grads.slot.get(j)
            if prev is None:
                grads.slot[j] = b
                grads.holders[b].add(("slot", j))
            elif prev == b or grads.holders[prev] != {("slot", j)}:
                grads.slot[j] = grads.new(nodes[j].grad_bytes)
                peak = grads.live if peak is None else max(peak, grads.live)
                grads.holders[grads.slot[j]].add(("slot", j))
                grads.release(prev, ("slot", j))
            grads.release(b, ("new", j))
        grads.release(fed, ("fed", t))
        if t in grads.loss:  # (an output's: the buffer the loss made, let go)
            grads.release(grads.loss.pop(t), ("loss", t))
        return peak

    def _receivers(self, t: int, im) -> set[int]:
        """Input positions whose new gradient is the buffer t's backward is fed (same size)."""
        nodes = self.problem.nodes
        size = nodes[t].grad_bytes
        given = {*im.grad_shared} | ({im.grad_in_place} - {None})
        return {p for p in given if nodes[self.inputs[t][p]].grad_bytes == size}

    def grad_saving(self, t: int, m: int) -> int:
        """Bytes of new input gradient that implementation m of t does not allocate: the inputs
        it hands its fed gradient buffer (`grad_in_place`, `grad_shared`), less the copy the
        runtime makes of that buffer when it is shared (`fed_shared`)."""
        im = self.impls[t][m]
        receivers = {self.inputs[t][p] for p in self._receivers(t, im)}
        saved = sum(self.problem.nodes[j].grad_bytes for j in receivers if self.rb[j])
        if im.grad_in_place is not None and self.fed_shared[t]:
            saved -= self.problem.nodes[t].grad_bytes  # (may be negative: a copy, nothing saved)
        return saved

    @property
    def crossings(self) -> list[frozenset[int]]:
        """crossings[p]: the values crossing from <= p to > p in the forward (topological order);
        articulation points have crossings[p] == {p}."""
        if self._crossings is None:
            out: list[frozenset[int]] = []
            live: set[int] = set()
            for p in range(self.n):
                live.add(p)
                live = {j for j in live if self.lastfwd[j] > p}
                out.append(frozenset(live))
            self._crossings = out
        return self._crossings

    @property
    def ancestors(self) -> list[frozenset[int]]:
        """ancestors[i]: proper ancestors of node i."""
        if self._anc is None:
            anc: list[frozenset[int]] = []
            for i in range(self.n):
                s: set[int] = set()
                for j in self.uinputs[i]:
                    s.add(j)
                    s |= anc[j]
                anc.append(frozenset(s))
            self._anc = anc
        return self._anc

    def is_restore(self, i: int, m: int) -> bool:
        return m >= self.nimp[i]

    def step_name(self, i: int, m: int) -> str:
        """The name a compute step uses for recompute entry (i, m): an implementation's or a
        restore's."""
        return self.impls[i][m].name if m < self.nimp[i] else self.restores[i][m - self.nimp[i]][2].name

    def step_inputs(self, i: int, m: int) -> list[int]:
        """The values recompute entry (i, m) reads (a restore reads none)."""
        return self.uinputs[i] if m < self.nimp[i] else []

    def recompute_time(self, i: int, m: int) -> float:
        """Time of recompute entry (i, m): the implementation's `recompute_time` (else its
        `fwd_time`), or the restore's, plus the problem's `recompute_overhead_s` (the runtime's
        own cost of any compute step in a backward stage)."""
        overhead = self.problem.recompute_overhead_s
        if m >= self.nimp[i]:
            return self.restores[i][m - self.nimp[i]][2].time + overhead
        im = self.impls[i][m]
        return (im.fwd_time if im.recompute_time is None else im.recompute_time) + overhead

    def makes_state_only(self, t: int, m: int, forward_impl: int | None = None) -> bool:
        """Whether recompute entry (t, m) with grad in t's own backward stage is emitted as a
        make_state step (`Impl.bwd_from_inputs`, and t's forward ran with that same implementation:
        `forward_impl`, None for the formulation, whose rows say so): nothing else reads t's output
        there, so only its state is made, from its inputs, without running its forward. (Not
        beside a forward of another implementation: mixing the two priced one's forward against the
        other's backward, where a convolution's implementations differ in measured forward time
        only by how they were timed. ResNet-50 b8 224 at plain's peak: 29 such mixes, predicted
        1.1 % faster, measured 4.8 % slower.)"""
        return (
            m < self.nimp[t]
            and self.impls[t][m].bwd_from_inputs
            and (forward_impl is None or forward_impl == m)
        )

    def entry_time(self, t: int, i: int, m: int, grad: bool, forward_impl: int | None = None) -> float:
        """Time of recompute entry (i, m) in t's backward stage: a make_state step's when it is t's
        own state made so (`makes_state_only`: the problem's `recompute_overhead_s` alone), else
        `recompute_time`."""
        if i == t and grad and self.makes_state_only(t, m, forward_impl):
            return self.problem.recompute_overhead_s
        return self.recompute_time(i, m)

    def step_workspace(self, i: int, m: int) -> int:
        """Transient bytes of recompute entry (i, m) beyond its output: with grad or without,
        whichever is more (the MILP's recompute rows do not say which)."""
        if m >= self.nimp[i]:
            return self.restores[i][m - self.nimp[i]][2].workspace
        im = self.impls[i][m]
        return max(im.fwd_workspace, im.forward_workspace(False))

    def step_index(self, i: int, name: str) -> int:
        """The recompute-entry index of a compute step's name: an implementation's, or
        nimp[i] + r for restore r."""
        for r, (_c, _mc, restore) in enumerate(self.restores[i]):
            if restore.name == name:
                return self.nimp[i] + r
        return self.impl_index(i, name)

    def impl_index(self, i: int, name: str) -> int:
        for m, im in enumerate(self.impls[i]):
            if im.name == name:
                return m
        raise ProblemError(f"node {self.names[i]!r} has no implementation {name!r}")

    def fastest_impls(self) -> list[int]:
        return [
            min(range(len(ims)), key=lambda m, ims=ims: (ims[m].fwd_time + ims[m].bwd_time, m))
            for ims in self.impls
        ]

    def default_impls(self) -> list[int]:
        return [0] * self.n


class _GradBuffers:
    """Gradient buffers during a backward: node -> buffer id (`slot`), buffer id -> bytes and
    holders; `live` is the bytes of the buffers something holds."""

    def __init__(self) -> None:
        self.slot: dict[int, int] = {}
        self.size: dict[int, int] = {}
        self.holders: dict[int, set] = {}
        self.loss: dict[int, int] = {}  # output -> the buffer the loss made, held to its backward's end
        self.loss_made: set[int] = set()  # the buffers the loss made (an in-place backward copies them)
        self.live = 0
        self.made = 0

    def new(self, nbytes: int) -> int:
        self.made += 1
        self.size[self.made], self.holders[self.made] = nbytes, set()
        self.live += nbytes
        return self.made

    def shared(self, b: int) -> bool:
        """Buffer b is copied before an in-place backward writes into it: something else holds
        it, or the loss made it (the user may hold it)."""
        return len(self.holders[b]) > 1 or b in self.loss_made

    def release(self, b: int, token) -> None:
        self.holders[b].discard(token)
        if not self.holders[b]:
            self.live -= self.size.pop(b)
            del self.holders[b]

    def copy(self) -> _GradBuffers:
        other = _GradBuffers()
        other.slot, other.size = dict(self.slot), dict(self.size)
        other.holders = {b: set(h) for b, h in self.holders.items()}
        other.loss, other.loss_made = dict(self.loss), set(self.loss_made)
        other.live, other.made = self.live, self.made
        return other


@dataclass
class StagePlan:
    recompute: list[tuple[int, int, bool]] = field(default_factory=list)  # (node, impl idx, grad)
    carry_vals: set[int] = field(default_factory=set)  # handles held when the next stage starts
    carry_states: dict[int, int] = field(default_factory=dict)  # node -> impl idx


@dataclass
class Plan:
    impl: list[int]  # forward implementation index per node
    F: set[int]
    S0: set[int]
    stages: list[StagePlan]


class PlanError(RuntimeError):
    """A plan is internally inconsistent (a bug in the strategy that made it)."""


def lazy_plan(
    an: Analysis,
    impl: list[int],
    F: set[int],
    K: set[int],
    levels: list[frozenset[int]] | tuple = (),
    split: frozenset[int] | set[int] = frozenset(),
) -> Plan:
    """Lazy recompute-once policy, optionally multi-level.

    Forward: every node with implementation `impl[i]`, grad=True iff i in F.
    Handles kept from the forward: K plus storages held by kept states (those cost
    nothing more) plus the outputs. At backward stage t, if t's state is missing,
    t is recomputed (grad=True) and, recursively, every input whose handle is not
    held (in topological order). Each recomputed node keeps its state until its
    own backward stage, so no node is recomputed twice. Each handle is kept until
    no later recompute uses it (a base storage's handle is also kept while a state
    or a view holds the storage: that costs nothing and avoids a second copy).
    Outputs (held by the user) always keep their forward state.

    Levels (Chen et al.'s recursive checkpointing): `levels` = [K2, K3, ...], value sets
    from coarse to fine. The nodes of K and of levels[0..l] cut the topological order
    into level-l segments (a cut node ends its segment). A recompute for stage t makes
    states only for nodes in t's finest segment; other nodes are recomputed without
    grad, and their handles are dropped when the stage ends, except a checkpoint of
    level l that lies in t's level-(l-1) segment (kept until no later recompute uses
    it) or a storage a live state holds. So the forward keeps only K, a K-segment is
    recomputed once down to its K2 checkpoints, a K2-segment once down to its K3
    checkpoints, and so on; only the finest segment holds states at a time.
    `split` adds ends of finest segments that keep nothing (their values are recomputed
    for each segment that needs them). With levels or a split, a node whose state costs
    nothing (no private bytes, keeps no storage) always gets it when recomputed.
    """
    F = {i for i in F if an.rb[i]} | {i for i in an.user_held if an.rb[i]}
    avail = set(K) | set(an.user_held)
    avail |= {an.base[v] for v in avail}  # a held view holds its base storage: keep its handle too
    for i in F:
        avail.update(an.kept_bases[i][impl[i]])
    states: dict[int, int] = {i: impl[i] for i in F}
    rec: list[list[tuple[int, int, bool]]] = [[] for _ in range(an.T)]
    levels = [frozenset(x) for x in levels]
    level_of: dict[int, int] = {}
    for depth in range(len(levels) - 1, -1, -1):
        level_of.update({v: depth for v in levels[depth]})
    # cuts[d]: segment ends at depth d (K and levels[0..d-1]); cuts[len(levels)] is the finest
    cuts = [sorted(set(K).union(*levels[:d])) for d in range(len(levels) + 1)]
    cuts[-1] = sorted(set(cuts[-1]) | set(split))
    layered = bool(levels or split)
    free_state = an.free_state

    def segment(v: int, depth: int) -> int:
        return bisect.bisect_left(cuts[depth], v)

    finest = len(levels)
    for s, t in enumerate(an.bw):
        out = rec[s]
        transient: set[int] = set()  # values made for this stage only

        def ensure(i: int, force: bool = False, out=out, transient=transient, t=t) -> None:
            if not force and i in avail:
                return
            # explicit stack instead of recursion (deep chains)
            order: list[int] = []
            stack = [(i, False)]
            seen: set[int] = set()
            while stack:
                v, done = stack.pop()
                if done:
                    order.append(v)
                    continue
                if v in seen:
                    continue
                seen.add(v)
                stack.append((v, True))
                for j in reversed(an.uinputs[v]):
                    if j not in avail and j not in seen:
                        stack.append((j, False))
            for v in sorted(order):
                in_segment = not layered or segment(v, finest) == segment(t, finest)
                grad = an.rb[v] and v not in states and (in_segment or free_state[v][impl[v]])
                out.append((v, impl[v], grad))
                avail.add(v)
                if grad:
                    states[v] = impl[v]
                if not in_segment:
                    depth = level_of.get(v)
                    if depth is None or segment(v, depth) != segment(t, depth):
                        transient.add(v)

        if t not in states:
            if t in an.user_held:
                raise PlanError(f"output {an.names[t]!r} has no forward state")
            ensure(t, force=True)
        del states[t]
        if transient:
            held = {b for i, m in states.items() for b in an.kept_bases[i][m]}
            avail.difference_update(transient - held)
    return _finish_plan(an, impl, F, rec)


def _finish_plan(an: Analysis, impl: list[int], F: set[int], rec: list[list[tuple[int, int, bool]]]) -> Plan:
    """Given the recomputes per stage, derive the handles and states carried between stages."""
    T = an.T
    # state lifetimes
    state_impl: dict[int, int] = {i: impl[i] for i in F}
    created: dict[int, int] = {i: -1 for i in F}  # stage index where created (-1: forward)
    for s in range(T):
        for i, m, g in rec[s]:
            if g and i != an.bw[s]:
                state_impl[i] = m
                created[i] = s
    # uses of handles per stage (inputs of recomputes not produced earlier in the stage)
    uses: list[set[int]] = []
    prods: list[set[int]] = []
    for s in range(T):
        produced: set[int] = set()
        used: set[int] = set()
        for i, m, _g in rec[s]:
            for j in an.step_inputs(i, m):
                if j not in produced:
                    used.add(j)
            produced.add(i)
        uses.append(used)
        prods.append(produced)
    # carry_vals into stage s' (s' = 0..T-1): next event at or after s' is a use
    need_into: list[set[int]] = [set() for _ in range(T + 1)]
    pending: set[int] = set()
    for s in range(T - 1, -1, -1):
        pending -= prods[s]
        pending |= uses[s]
        need_into[s] = set(pending)
    stages: list[StagePlan] = []
    carried: list[set[int]] = []
    by_stage: dict[int, list[int]] = {}
    for i, c in created.items():
        by_stage.setdefault(c, []).append(i)
    live_states: dict[int, int] = {}
    kept: dict[int, int] = {}  # storages the live states keep -> how many of them keep it

    def set_state(i: int, m: int | None) -> None:  # (None: i's state ends)
        old = live_states.pop(i, None)
        if old is not None:
            for b in an.kept_bases[i][old]:
                kept[b] -= 1
                if not kept[b]:
                    del kept[b]
        if m is not None:
            live_states[i] = m
            for b in an.kept_bases[i][m]:
                kept[b] = kept.get(b, 0) + 1

    for i in by_stage.get(-1, []):
        set_state(i, state_impl[i])
    for s_in in range(T + 1):  # handles held when stage s_in starts (T: after the last)
        if s_in > 0:
            set_state(an.bw[s_in - 1], None)
            for i in by_stage.get(s_in - 1, []):
                set_state(i, state_impl[i])
        if s_in < T:
            vals = _handed_on(an, need_into[s_in], live_states, an.bw[s_in], kept)
            st = dict(live_states)
        else:
            vals, st = set(), {}
        carried.append(vals)
        if s_in > 0:
            stages.append(StagePlan(recompute=rec[s_in - 1], carry_vals=vals, carry_states=st))
    return Plan(impl=list(impl), F=set(F), S0=carried[0], stages=stages)


def _handed_on(an: Analysis, vals, states: dict[int, int], upto: int, kept=None) -> set[int]:
    """The handles a plan holds when the stage of node `upto` starts: `vals`, the storages the
    held `states` keep, the bases of all of them (a view holds its base) and the user's values,
    those up to `upto` (the MILP's S: a storage something holds has its handle held).
    `kept`: the storages `states` keep, if known (a collection of bases)."""
    held = set(vals)
    held.update([an.base[v] for v in vals])
    if kept is None:
        for i, m in states.items():
            held.update(an.kept_bases[i][m])  # (bases already)
    else:
        held.update(kept)
    held.update(an.user_held)
    return {v for v in held if v <= upto}


def plan_of_schedule(an: Analysis, schedule: Schedule) -> Plan:
    """The plan an emitted schedule follows, whatever strategy made it: the forward's
    implementations and kept states, each backward stage's computes, and the handles and states
    held when each stage ends (with the storages held states and views keep, as the MILP counts
    them). Used to start a solve from an earlier schedule (`solve(start_plan=)`)."""
    idx = an.idx
    impl = an.default_impls()
    F: set[int] = set()
    held: set[int] = set()
    states: dict[int, int] = {}

    stages: list[StagePlan] = []
    for si, steps in enumerate(_ungathered(an, schedule)):
        rec: list[tuple[int, int, bool]] = []
        for step in steps:
            i = idx[step.node]
            if step.op == "make_state":
                m = an.step_index(i, step.impl)
                states[i] = m
                rec.append((i, m, True))
            elif step.op == "compute":
                m = an.step_index(i, step.impl)
                held.add(i)
                if step.grad:
                    states[i] = m
                if si == 0:
                    impl[i] = m
                    if step.grad:
                        F.add(i)
                else:
                    rec.append((i, m, step.grad))
            elif step.op == "free_value":
                held.discard(i)
            else:  # backward / free_state
                states.pop(i, None)
        if si == 0:
            S0 = _handed_on(an, held, states, an.n)
        else:
            upto = an.bw[si] if si < an.T else -1
            carried = {i: m for i, m in states.items() if i <= upto}
            stages.append(StagePlan(rec, _handed_on(an, held, states, upto), carried))
    return Plan(impl, F, S0, stages)


def _ungathered(an: Analysis, schedule: Schedule) -> list[list[Step]]:
    """Each stage's steps with every backward step back at the end of its node's own stage
    (`solver.gather` moves some earlier; nothing else)."""
    own = {an.names[t]: s + 1 for s, t in enumerate(an.bw)}
    stages: list[list[Step]] = [[] for _ in schedule.stages]
    late: list[list[Step]] = [[] for _ in schedule.stages]
    for si, stage in enumerate(schedule.stages):
        for step in stage.steps:
            target = own.get(step.node, si) if step.op == "backward" else si
            (late[target] if si < target < len(stages) else stages[si]).append(step)
    return [steps + moved for steps, moved in zip(stages, late)]


def with_restores(an: Analysis, plan: Plan) -> Plan:
    """The plan with each recompute without grad of a node that a consumer's state, held through
    the stage, can restore (`Restore`) replaced by that restore, when the restore is no slower,
    and the recomputes nothing needs any more dropped. Never slower, never more memory: a
    restore makes the same value and reads nothing."""
    held = {i: plan.impl[i] for i in plan.F if an.rb[i]}  # states held when the stage starts
    stages = []
    for s, t in enumerate(an.bw):
        sp = plan.stages[s]
        regrad = {i for i, _m, g in sp.recompute if g}
        through = {i: m for i, m in held.items() if i not in regrad and (i == t or i in sp.carry_states)}
        rec = []
        for i, m, g in sp.recompute:
            if not g and i != t and not an.is_restore(i, m):
                for r, (c, mc, _restore) in enumerate(an.restores[i]):
                    if through.get(c) == mc and an.recompute_time(i, an.nimp[i] + r) <= an.recompute_time(
                        i, m
                    ):
                        m = an.nimp[i] + r
                        break
            rec.append((i, m, g))
        needed = set(sp.carry_vals) | {t}
        kept = []
        for i, m, g in reversed(rec):
            if g or i in needed:
                kept.append((i, m, g))
                needed.update(an.step_inputs(i, m))
        stages.append(StagePlan(kept[::-1], sp.carry_vals, sp.carry_states))
        held = dict(sp.carry_states)
    return Plan(plan.impl, plan.F, plan.S0, stages)


def emit(an: Analysis, plan: Plan) -> list[Stage]:
    """The explicit schedule of a plan, freeing everything as early as the plan allows."""
    names = an.names
    impls = an.impls
    steps: list[Step] = []
    S0 = plan.S0 | set(an.outputs)
    for i in range(an.n):
        steps.append(Step("compute", names[i], impls[i][plan.impl[i]].name, i in plan.F and an.rb[i]))
        for j in an.uinputs[i]:
            if an.lastfwd[j] == i and j not in S0:
                steps.append(Step("free_value", names[j]))
        if an.lastfwd[i] == -1 and i not in S0:
            steps.append(Step("free_value", names[i]))
    stages = [Stage("forward", tuple(steps))]
    held_vals = set(S0)
    held_states = {i: plan.impl[i] for i in plan.F if an.rb[i]}
    for s, t in enumerate(an.bw):
        sp = plan.stages[s]
        steps = []
        rec_nodes = [i for i, _m, _g in sp.recompute]
        last_use: dict[int, int] = {}
        for k, (i, m, _g) in enumerate(sp.recompute):
            for j in an.step_inputs(i, m):
                last_use[j] = k
        recset = set(rec_nodes)
        regrad = {i for i, _m, g in sp.recompute if g}
        # states not carried (and not t's) go first (set algebra: the held sets are large)
        dropped = (held_states.keys() - sp.carry_states.keys()) | (regrad & held_states.keys())
        for i in sorted(dropped - {t}):
            steps.append(Step("free_state", names[i]))
            del held_states[i]
        for j in sorted((held_vals & recset) | (held_vals - sp.carry_vals - last_use.keys())):
            steps.append(Step("free_value", names[j]))
            held_vals.discard(j)
        for k, (i, m, g) in enumerate(sp.recompute):
            for j in an.step_inputs(i, m):
                if j not in held_vals:
                    raise PlanError(f"stage {s} ({names[t]}): recompute of {names[i]} needs {names[j]}")
            if an.is_restore(i, m):
                c, mc, _r = an.restores[i][m - an.nimp[i]]
                if held_states.get(c) != mc:
                    raise PlanError(
                        f"stage {s} ({names[t]}): restore of {names[i]} needs the state of {names[c]}"
                    )
                g = False
            if i == t and g and an.rb[t] and an.makes_state_only(t, m, plan.impl[t]):
                # (nothing else in the stage reads t, and no later stage: its state alone)
                steps.append(Step("make_state", names[t], an.step_name(t, m)))
                held_states[t] = m
                for j in an.uinputs[t]:
                    if last_use.get(j) == k and j not in sp.carry_vals and j in held_vals:
                        steps.append(Step("free_value", names[j]))
                        held_vals.discard(j)
                continue
            steps.append(Step("compute", names[i], an.step_name(i, m), bool(g and an.rb[i])))
            held_vals.add(i)
            if g and an.rb[i]:
                held_states[i] = m
            for j in an.uinputs[i]:
                if last_use.get(j) == k and j not in sp.carry_vals and j in held_vals:
                    steps.append(Step("free_value", names[j]))
                    held_vals.discard(j)
            if i not in sp.carry_vals and last_use.get(i, -1) <= k:
                steps.append(Step("free_value", names[i]))
                held_vals.discard(i)
        if t not in held_states:
            raise PlanError(f"stage {s}: no state for {names[t]}")
        steps.append(Step("backward", names[t]))
        del held_states[t]
        for j in sorted(held_vals - sp.carry_vals):
            steps.append(Step("free_value", names[j]))
            held_vals.discard(j)
        for i in sorted(held_states.keys() - sp.carry_states.keys()):
            steps.append(Step("free_state", names[i]))
            del held_states[i]
        missing = sp.carry_vals - held_vals
        if missing:
            raise PlanError(f"stage {s}: carries handles it does not hold: {[names[j] for j in missing]}")
        missing_st = sp.carry_states.keys() - held_states.keys()
        if missing_st:
            raise PlanError(f"stage {s}: carries states it does not hold: {[names[j] for j in missing_st]}")
        stages.append(Stage(f"backward:{names[t]}", tuple(steps)))
    return stages


def plan_time(an: Analysis, plan: Plan) -> float:
    """The time of a valid plan without emitting or simulating it (a search's filter: the
    simulator's time is what counts): every node's forward, each recompute's
    `recompute_time`, and each backward with the implementation of the state it uses (the
    latest made with grad, else the forward's)."""
    impls = an.impls
    total = sum(impls[i][m].fwd_time for i, m in enumerate(plan.impl))
    state = {i: plan.impl[i] for i in plan.F if an.rb[i]}
    for s, t in enumerate(an.bw):
        for i, m, g in plan.stages[s].recompute:
            total += an.entry_time(t, i, m, g, plan.impl[i])
            if g and an.rb[i] and not an.is_restore(i, m):
                state[i] = m
        total += impls[t][state[t]].bwd_time
    return total


def deferred_order(problem: Problem) -> list[str]:
    """The nodes whose weight gradients are deferred, in the order that makes the end of the step's
    peak least: most held plus workspace first (an exchange argument: each adds its gradient less
    what it held, and peaks at what it held plus its workspace above what came before)."""
    nodes = [n for n in problem.nodes if n.deferred_param_grad_bytes]
    nodes.sort(key=lambda n: -(n.param_grad_bytes + n.deferred_workspace_bytes))
    return [n.name for n in nodes]


def to_schedule(
    an: Analysis,
    plan: Plan,
    strategy: str,
    solver_info: SolverInfo,
    budget_bytes: int | None = None,
    meta: dict | None = None,
) -> Schedule:
    """Emit, replay with the simulator, and wrap as a Schedule with predictions filled in."""
    from solver.simulate import simulate

    stages = emit(an, plan)
    meta = dict(meta or {})
    deferred = deferred_order(an.problem)
    if deferred:  # (the runtime makes these weight gradients after the last stage: `simulate`)
        meta[DEFERRED_META] = deferred
    draft = Schedule(
        fingerprint=an.problem.fingerprint,
        budget_bytes=budget_bytes,
        predicted_peak_bytes=0,
        predicted_time_s=0.0,
        solver=solver_info,
        strategy=strategy,
        stages=tuple(stages),
        meta=meta,
    )
    sim = simulate(an.problem, draft)
    return Schedule(
        fingerprint=draft.fingerprint,
        budget_bytes=budget_bytes,
        predicted_peak_bytes=sim.peak_bytes,
        predicted_time_s=sim.time_s,
        solver=solver_info,
        strategy=strategy,
        stages=draft.stages,
        meta={**draft.meta, "recompute_time_s": sim.recompute_time_s},
    )
