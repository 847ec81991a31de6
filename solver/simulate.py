"""Replay a schedule against a problem: peak memory, time, and validity.

This module is the judge. It shares no code with the formulation in `solver.formulation`
or with the baselines; every strategy's schedule is checked here.

The memory model (the formulation and `monet_opt.runtime` follow it)
--------------------------------------------------------------------
Memory is counted in bytes above what was live before the training step: the
model's parameters, their existing gradients, optimizer state and the input
batch are not counted. Live at any moment is the sum of:

* storages -- each node that owns its output (not a view) has one storage of
  `output_bytes`. A storage is live while anything holds it:
    - the schedule's value handle on the node or on any view of it
      (`alias_of` chains lead a view to the storage it shares);
    - the backward state of a node whose implementation keeps that input
      (`keeps_inputs`) or keeps its own output (`keeps_output`);
    - the user, for nodes marked `is_output`, from the end of the forward stage
      to the end of the step (to the start of the first backward stage if the output's
      `user_holds` is False: the user dropped it once the loss was computed).
* backward states -- `compute ... grad=True` creates the node's state; it holds
  `state_bytes` of private memory (plus the storages above) until the node's
  `backward` step or a `free_state` step.
* gradients -- the gradient of a node's output (`grad_bytes`) is a buffer made by
  the first backward that produces it and released by the node's own backward.
  Gradients of the model's outputs are made by the user's loss, at the start of the
  first backward stage, and held (as the buffer the loss made) until the output node's
  backward ends, so an output's gradient is shared until then (a consumer's gradient is
  summed into a new buffer); then freed as any other once nothing holds it (the runtime
  may free it sooner). An in-place backward (`grad_in_place`) fed a buffer the loss made
  (the output's own, or handed on by a view) gets a copy: the user may hold that buffer.
  An output whose `output_grad` is False (the loss does not read it) gets none. A buffer
  may be several nodes' gradient at once (an addition hands its gradient to both
  arguments): its bytes count once, while anything holds it.
* parameter gradients -- `param_grad_bytes` of a node are allocated by its
  backward and stay to the end of the step (zero_grad(set_to_none=True)), except
  `param_grad_freed_bytes` of a node (optimizer step inside the backward): freed right
  after that node's backward, once its input gradients are accumulated, after a
  transient peak of live + `param_step_bytes` (the optimizer's temporaries).
* deferred parameter gradients -- a node with `deferred_param_grad_bytes` holds its
  `param_grad_bytes` (what its weight gradient is computed from) from its backward on, as
  above; after the last stage, node by node in the order the schedule's meta lists them, its
  `deferred_param_grad_bytes` are allocated (a peak, with `deferred_workspace_bytes` beside) and
  then its `param_grad_bytes` released.
* `fixed_bytes` of the problem, always.

Transient peaks:
* compute: live + output_bytes (if not a view) + state_bytes + fwd_workspace (with grad), or
  + nograd_fwd_workspace (without grad; `Impl.forward_workspace`).
  If the node's value handle is already live, the new output is a second storage;
  the old one is released only when nothing else holds it.
  In-place forward: if the implementation names an input position in `fwd_in_place`
  (an in-place ReLU or addition), that input's storage, of the output's size, is held
  by nothing but the input's own handle (no backward state, no view or other handle,
  not a user output), no other input of the node lies in the same storage, and the schedule frees that
  input among the free steps that directly follow this compute (before the next
  compute or backward), then the output is written into that storage: no new bytes,
  and the storage stays live, as the node's output, once the input's handle is freed.
* backward of t: t's gradient buffer leaves t's slot and is fed to the backward; if
  the implementation names `grad_in_place` and the buffer is shared (another node's
  gradient too, or a model output's), the runtime feeds a copy (a new buffer); without
  `grad_in_place` the backward does not write into it and it is fed as it is. The
  inputs at `grad_in_place` and `grad_shared` receive the fed buffer itself as their
  new gradient (if their `grad_bytes` equal t's: a view's input gets a view of it);
  every other input that needs a
  gradient receives a new buffer of its `grad_bytes`. Peak: live (with the copy and the new buffers) + bwd_workspace +
  param_grad_bytes(t). Then t's state is dropped and each input's new gradient is
  accumulated, one at a time: it becomes the input's gradient if it has none; else it
  is added in place into the existing one if nothing else holds that, and else both
  are summed into a new buffer (a transient peak) that replaces the existing one.
  A buffer nothing holds any more is freed.

A restore (a compute step naming one of the node's `restores`, in a backward stage, without
grad) reads none of the node's inputs; the consumer's state it names, made with the named
implementation, must be held. Peak: live + output_bytes + the restore's workspace; the
output is a new storage.

A make_state step (in a backward stage, an implementation with `bwd_from_inputs`) makes the
node's backward state from its inputs, which must be held, without running the forward: the
state holds the storages of the inputs it keeps, no private bytes; no output, no handle, no
transient.

Time is the sum of `fwd_time` of a node's first compute step, `recompute_time`
(if given, else `fwd_time`) of each later one (a recomputation, which may reuse what
the first computation left, e.g. batch statistics), the `time` of each restore, and `bwd_time`
of every backward step, with the implementation named in the step; and the problem's
`recompute_overhead_s` for every compute step (recomputation or restore) and every make_state
step in a backward stage:
the runtime's own cost of running a node outside the forward (its dispatch, and the separate
autograd graph a recomputation with grad gets).

A schedule is invalid (ScheduleInvalid, naming stage, step and node) if its meta's
deferred weight gradients are not the problem's, if it uses a
value whose handle is not held, backs a node without its state or gradient, or before a
consumer's backward has added to that gradient,
frees what is not held, leaves a node that needs a backward without one, or
does not compute every output in the forward stage.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from solver.problem import Impl, Node, Problem, Restore
from solver.schedule import DEFERRED_META, Schedule


class ScheduleInvalid(ValueError):
    """The schedule cannot run: the message names the stage, step and node."""


@dataclass
class SimResult:
    peak_bytes: int
    time_s: float
    stage_peaks: list[int] = field(default_factory=list)
    timeline: list[tuple[str, int, int]] = field(default_factory=list)  # (stage, step index, live bytes)
    recompute_time_s: float = 0.0  # compute steps in the backward stages
    forward_time_s: float = 0.0  # compute steps in the forward stage (the rest of time_s: backward steps)


def simulate(problem: Problem, schedule: Schedule, check_fingerprint: bool = True) -> SimResult:
    if check_fingerprint:
        schedule.check_fingerprint(problem.fingerprint, what="problem")
    return _Replay(problem).run(schedule)


class _Replay:
    def __init__(self, problem: Problem) -> None:
        self.p = problem
        self.by_name: dict[str, Node] = {n.name: n for n in problem.nodes}
        self.base: dict[str, str] = {}
        for n in problem.nodes:
            self.base[n.name] = self.base[n.inputs[n.alias_of]] if n.alias_of is not None else n.name
        # storages: base name -> list of live copies; each copy is a set of holder tokens
        self.copies: dict[str, list[set]] = {}
        self.handle: dict[str, tuple[str, int]] = {}  # node -> (base, copy id) it holds
        self.copy_ids: dict[tuple[str, int], set] = {}
        self.next_copy = 0
        # node -> (implementation, private bytes, held storage copies)
        self.states: dict[str, tuple[Impl, int, list[tuple[str, int]]]] = {}
        # gradient buffers: node -> buffer id of its output's gradient; id -> (bytes, holders)
        self.grads: dict[str, int] = {}
        self.grad_bufs: dict[int, tuple[int, set]] = {}
        self.next_grad = 0
        self.loss_grads: dict[str, int] = {}  # output -> the gradient buffer the loss made, still held
        self.loss_made: set[int] = set()  # the buffers the loss made (an in-place backward copies them)
        self.backed: set[str] = set()
        self.live = problem.fixed_bytes
        self.peak = self.live
        self.backward_started = False
        # outputs the user drops once the loss is computed -> the storage copy held until then
        self.dropped_keys: dict[str, tuple[str, int]] = {}

    # -- storage bookkeeping ---------------------------------------------------
    def _new_copy(self, node: Node) -> tuple[str, int]:
        base = self.base[node.name]
        key = (base, self.next_copy)
        self.next_copy += 1
        self.copy_ids[key] = set()
        self.live += self.by_name[base].output_bytes if node.alias_of is None else 0
        return key

    def _hold(self, key: tuple[str, int], token) -> None:
        self.copy_ids[key].add(token)

    def _release(self, key: tuple[str, int], token) -> None:
        holders = self.copy_ids[key]
        holders.discard(token)
        if not holders:
            del self.copy_ids[key]
            self.live -= self.by_name[key[0]].output_bytes

    def _bump(self, extra: int = 0) -> None:
        self.peak = max(self.peak, self.live + extra)
        self.stage_peak = max(self.stage_peak, self.live + extra)

    # -- replay ----------------------------------------------------------------
    def run(self, schedule: Schedule) -> SimResult:
        if not schedule.stages or schedule.stages[0].name != "forward":
            raise ScheduleInvalid("the first stage must be 'forward'")
        deferred = [n.name for n in self.p.nodes if n.deferred_param_grad_bytes]
        if sorted(schedule.meta.get(DEFERRED_META, [])) != sorted(deferred):
            raise ScheduleInvalid(
                f"the schedule defers the weight gradients of {sorted(schedule.meta.get(DEFERRED_META, []))} "
                f"(meta {DEFERRED_META!r}), the problem those of {sorted(deferred)}: solved for another problem"
            )
        time = 0.0
        recompute = 0.0
        forward = 0.0
        stage_peaks: list[int] = []
        computed: set[str] = set()
        timeline: list[tuple[str, int, int]] = []
        for s_idx, stage in enumerate(schedule.stages):
            self.stage_peak = self.live
            if s_idx == 1:
                self._start_backward()
            for k, step in enumerate(stage.steps):
                where = f"stage {stage.name!r}, step {k} ({step.op} {step.node})"
                node = self.by_name.get(step.node)
                if node is None:
                    raise ScheduleInvalid(f"{where}: unknown node")
                if step.op == "compute":
                    t = self._compute(
                        node,
                        step.impl,
                        step.grad,
                        where,
                        again=node.name in computed,
                        freed_next=_frees_after(stage.steps, k),
                    )
                    computed.add(node.name)
                    if s_idx > 0:
                        t += self.p.recompute_overhead_s
                        recompute += t
                    else:
                        forward += t
                    time += t
                elif step.op == "make_state":
                    if s_idx == 0:
                        raise ScheduleInvalid(
                            f"{where}: a state is made from inputs only in a backward stage"
                        )
                    self._make_state(node, step.impl, where)
                    recompute += self.p.recompute_overhead_s
                    time += self.p.recompute_overhead_s
                elif step.op == "backward":
                    time += self._backward(node, where)
                elif step.op == "free_value":
                    if node.name not in self.handle:
                        raise ScheduleInvalid(f"{where}: the value is not held")
                    self._release(self.handle.pop(node.name), ("h", node.name))
                elif step.op == "free_state":
                    if node.name not in self.states:
                        raise ScheduleInvalid(f"{where}: no backward state to free")
                    self._drop_state(node.name)
                else:  # pragma: no cover - Schedule rejects unknown ops
                    raise ScheduleInvalid(f"{where}: unknown op")
                timeline.append((stage.name, k, self.live))
            if s_idx == 0:
                self._end_forward()
            stage_peaks.append(self.stage_peak)
        if len(schedule.stages) == 1:
            self._start_backward()
        missing = [n.name for n in self.p.nodes if n.requires_backward and n.name not in self.backed]
        if missing:
            raise ScheduleInvalid(f"nodes never run backward: {', '.join(missing[:8])}")
        for name in schedule.meta.get(DEFERRED_META, []):  # deferred weight gradients, in that order
            node = self.by_name[name]
            if node.deferred_param_grad_bytes:
                self.live += node.deferred_param_grad_bytes
                self.peak = max(self.peak, self.live + node.deferred_workspace_bytes)
                self.live -= node.param_grad_bytes
        return SimResult(self.peak, time, stage_peaks, timeline, recompute, forward)

    def _end_forward(self) -> None:
        for n in self.p.nodes:
            if n.is_output:
                if n.name not in self.handle:
                    raise ScheduleInvalid(f"stage 'forward': output {n.name!r} is not held at its end")
                self._hold(self.handle[n.name], ("user", n.name))
                if not n.user_holds:
                    self.dropped_keys[n.name] = self.handle[n.name]

    def _start_backward(self) -> None:
        self.backward_started = True
        for name, key in self.dropped_keys.items():
            self._release(key, ("user", name))
        self.dropped_keys.clear()
        for n in self.p.nodes:
            if n.is_output and n.output_grad and n.requires_backward and n.name not in self.grads:
                buf = self._new_grad(n.grad_bytes)
                self._grad_hold(buf, ("loss", n.name))  # to the end of n's backward
                self._grad_hold(buf, ("slot", n.name))
                self.grads[n.name] = buf
                self.loss_grads[n.name] = buf
                self.loss_made.add(buf)
        self._bump()

    def _compute(
        self,
        node: Node,
        impl_name: str | None,
        grad: bool,
        where: str,
        again: bool = False,
        freed_next: frozenset[str] = frozenset(),
    ) -> float:
        restore = next((r for r in node.restores if r.name == impl_name), None)
        if restore is not None:
            return self._restore(node, restore, grad, where)
        impl = next((i for i in node.impls if i.name == impl_name), None)
        if impl is None:
            raise ScheduleInvalid(f"{where}: no implementation {impl_name!r}")
        self._require_inputs(node, where)
        if node.alias_of is not None:
            key = self.handle[node.inputs[node.alias_of]]
        elif self._writes_in_place(node, impl, freed_next):
            key = self.handle[node.inputs[impl.fwd_in_place]]
        else:
            key = self._new_copy(node)
        state_bytes = impl.state_bytes if grad else 0
        self._bump(state_bytes + impl.forward_workspace(grad))
        self._take_handle(node.name, key)
        if grad:
            self._set_state(node, impl, state_bytes, [key] if impl.keeps_output else [])
        if again and impl.recompute_time is not None:
            return impl.recompute_time
        return impl.fwd_time

    def _make_state(self, node: Node, impl_name: str | None, where: str) -> None:
        impl = next((i for i in node.impls if i.name == impl_name), None)
        if impl is None or not impl.bwd_from_inputs:
            raise ScheduleInvalid(
                f"{where}: implementation {impl_name!r} cannot make its state from its inputs "
                "(no such implementation, or its bwd_from_inputs is False)"
            )
        self._require_inputs(node, where)
        self._set_state(node, impl, 0, [])

    def _require_inputs(self, node: Node, where: str) -> None:
        for inp in node.inputs:
            if inp not in self.handle:
                raise ScheduleInvalid(f"{where}: input {inp!r} is not available (not held)")

    def _set_state(self, node: Node, impl: Impl, state_bytes: int, own: list[tuple[str, int]]) -> None:
        """node's backward state, made with impl (replacing one it had): it holds the storages of
        the inputs impl keeps, `own` (its output's copy, if kept) and `state_bytes` private bytes."""
        if node.name in self.states:
            self._drop_state(node.name)
        held = [self.handle[node.inputs[p]] for p in impl.keeps_inputs] + own
        for h in held:
            self._hold(h, ("s", node.name))
        self.states[node.name] = (impl, state_bytes, held)
        self.live += state_bytes

    def _restore(self, node: Node, restore: Restore, grad: bool, where: str) -> float:
        if grad or not self.backward_started:
            raise ScheduleInvalid(f"{where}: a restore runs only in a backward stage, without grad")
        state = self.states.get(restore.consumer)
        if state is None or state[0].name != restore.consumer_impl:
            raise ScheduleInvalid(
                f"{where}: restores from the state of {restore.consumer!r} made with "
                f"{restore.consumer_impl!r}, which is not held"
            )
        key = self._new_copy(node)
        self._bump(restore.workspace)
        self._take_handle(node.name, key)
        return restore.time

    def _take_handle(self, name: str, key: tuple[str, int]) -> None:
        """name's handle now holds storage copy `key`; the copy it held before is released."""
        old = self.handle.get(name)
        self.handle[name] = key
        self._hold(key, ("h", name))
        if old is not None and old != key:  # recomputing a view of the same copy keeps its hold
            self._release(old, ("h", name))

    def _writes_in_place(self, node: Node, impl: Impl, freed_next: frozenset[str]) -> bool:
        if impl.fwd_in_place is None:
            return False
        source = node.inputs[impl.fwd_in_place]
        if source not in freed_next:
            return False
        key = self.handle[source]
        if self.copy_ids[key] != {("h", source)} or self.by_name[key[0]].output_bytes != node.output_bytes:
            return False
        others = [inp for pos, inp in enumerate(node.inputs) if pos != impl.fwd_in_place]
        return all(self.handle[inp] != key for inp in others)

    def _new_grad(self, nbytes: int) -> int:
        buf = self.next_grad
        self.next_grad += 1
        self.grad_bufs[buf] = (nbytes, set())
        self.live += nbytes
        return buf

    def _grad_hold(self, buf: int, token) -> None:
        self.grad_bufs[buf][1].add(token)

    def _grad_release(self, buf: int, token) -> None:
        nbytes, holders = self.grad_bufs[buf]
        holders.discard(token)
        if not holders:
            del self.grad_bufs[buf]
            self.live -= nbytes

    def _drop_state(self, name: str) -> None:
        _, state_bytes, held = self.states.pop(name)
        self.live -= state_bytes
        for h in held:
            if h in self.copy_ids:
                self._release(h, ("s", name))

    def _backward(self, node: Node, where: str) -> float:
        if not node.requires_backward:
            raise ScheduleInvalid(f"{where}: node has no backward")
        if node.name in self.backed:
            raise ScheduleInvalid(f"{where}: backward already ran")
        if node.name not in self.states:
            raise ScheduleInvalid(f"{where}: no backward state (compute it with grad=True first)")
        if node.name not in self.grads:
            raise ScheduleInvalid(
                f"{where}: its gradient does not exist yet (a consumer's backward must run first)"
            )
        impl = self.states[node.name][0]
        own = self.grads.pop(node.name)
        fed = own
        if impl.grad_in_place is not None and (len(self.grad_bufs[own][1]) > 1 or own in self.loss_made):
            fed = self._new_grad(node.grad_bytes)  # shared: the runtime copies it first
            self._bump()  # (beside the original, which may go with its slot below)
        self._grad_hold(fed, ("fed", node.name))
        self._grad_release(own, ("slot", node.name))  # out of its slot before the backward runs
        receive = set(impl.grad_shared) | ({impl.grad_in_place} - {None})
        made = []  # (input, gradient buffer) as the backward returns them
        for pos, name in enumerate(node.inputs):
            inp = self.by_name[name]
            if inp.requires_backward:
                if name in self.backed:
                    raise ScheduleInvalid(
                        f"{where}: makes a gradient for {name!r}, whose backward already ran "
                        "(a node's backward must come after every consumer's)"
                    )
                takes_fed = pos in receive and inp.grad_bytes == node.grad_bytes
                made.append((name, fed if takes_fed else self._new_grad(inp.grad_bytes)))
        self._bump(impl.bwd_workspace + node.param_grad_bytes)
        self.live += node.param_grad_bytes
        self._drop_state(node.name)
        for name, buf in made:  # accumulated one by one, as the engine hands them over
            self._grad_hold(buf, ("new", name))
            prev = self.grads.get(name)
            if prev is None:
                self.grads[name] = buf
                self._grad_hold(buf, ("slot", name))
            elif prev == buf or self.grad_bufs[prev][1] != {("slot", name)}:
                # prev + new into a new buffer: prev is shared (or is the new gradient itself)
                total = self._new_grad(self.by_name[name].grad_bytes)
                self._bump()
                self.grads[name] = total
                self._grad_hold(total, ("slot", name))
                self._grad_release(prev, ("slot", name))
            self._grad_release(buf, ("new", name))  # (added into prev in place, or now prev)
        self._grad_release(fed, ("fed", node.name))
        if node.name in self.loss_grads:  # (an output's: the buffer the loss made, let go)
            self._grad_release(self.loss_grads.pop(node.name), ("loss", node.name))
        if node.param_grad_freed_bytes or node.param_step_bytes:  # optimizer step, then free
            self._bump(node.param_step_bytes)
            self.live -= node.param_grad_freed_bytes
        self.backed.add(node.name)
        return impl.bwd_time


def _frees_after(steps, k: int) -> frozenset[str]:
    """The values freed by the free_value steps that directly follow step k."""
    freed = set()
    for step in steps[k + 1 :]:
        if step.op != "free_value":
            if step.op in ("compute", "make_state", "backward"):
                break
            continue
        freed.add(step.node)
    return frozenset(freed)
