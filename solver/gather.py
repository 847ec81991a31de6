"""Gather backward steps into blocks the runtime can run as one autograd call.

The runtime (`monet_opt.runtime.groups`) runs a run of nodes computed with autograd in one
stage as one shared graph with one backward call when their backward steps follow each other
with nothing else between (no compute, no other node's backward). In a schedule that
recomputes, the emitter places each node's backward in its own stage, after that stage's
recomputations, so most nodes end up in graphs of their own: ~0.1-0.2 ms of the runtime's own
work per node (measured on ResNet-50 b8 224: its 1/3 schedule ran 92 of 175 backward steps
in shared graphs).

`gather_backwards` moves backward steps earlier, next to the first of their run's backward
steps, where that changes nothing the schedule computes and does not raise its peak:

* a *run* is a stretch of compute steps of one stage whose nodes each have one backward step,
  after this compute, and no `free_state`; a node with a backward state (`keeps_inputs`,
  `keeps_output`, private bytes, or one made from inputs) joins only with its one compute with
  grad, or its one `make_state` step; a stateless node (an addition, a flatten: its backward
  needs nothing) joins with its last compute before its backward, which then gets grad=True
  (and its other computes grad=False: the same memory and time, its backward reads no state
  either way). A compute with grad (or a make_state) of any other node ends the run;
* a *block* is a part of a run, in backward order, whose members' outside consumers all have
  their backward before the block's first backward step (each member's gradient is complete
  there), and whose members' backward steps pass no backward step of another node that reads
  one of their inputs (that gradient's parts would be added in another order: plain PyTorch's
  sum, bit for bit, is the runtime's only if its parts come in the same order; in bf16 the
  rounding differed visibly, on GPT-2's GELU input); its members' backward steps move to just
  after the first one, in their order;
* each block is accepted only if the whole schedule, replayed by `solver.simulate`, stays valid
  with a peak no higher than before (moving a backward earlier drops its state earlier but makes
  its input gradients earlier); a block that does not is cut to its longest prefix that does.

The time the simulator predicts does not change (the same steps run); the runtime's does
(fewer backward calls). `solver.plan.plan_of_schedule` reads a gathered schedule as the plan
it came from.
"""

from __future__ import annotations

import dataclasses

from solver.problem import Impl, Problem
from solver.schedule import Schedule, Stage
from solver.simulate import ScheduleInvalid, simulate


def gather_backwards(problem: Problem, schedule: Schedule) -> Schedule:
    """The schedule with its backward steps gathered into blocks (see the module docstring);
    `meta["gathered_backwards"]` says how many blocks and moved steps. Returned unchanged if
    nothing can be gathered."""
    flat = [step for stage in schedule.stages for step in stage.steps]
    impls = {nd.name: {im.name: im for im in nd.impls} for nd in problem.nodes}
    users: dict[str, set[str]] = {}
    for nd in problem.nodes:
        for x in nd.inputs:
            users.setdefault(x, set()).add(nd.name)

    backs: dict[str, list[int]] = {}
    state_steps: dict[str, int] = {}  # computes with grad and make_states
    freed: set[str] = set()
    for p, step in enumerate(flat):
        if step.op == "backward":
            backs.setdefault(step.node, []).append(p)
        elif (step.op == "compute" and step.grad) or step.op == "make_state":
            state_steps[step.node] = state_steps.get(step.node, 0) + 1
        elif step.op == "free_state":
            freed.add(step.node)
    back = {n: ps[0] for n, ps in backs.items() if len(ps) == 1 and n not in freed}
    inputs = {nd.name: nd.inputs for nd in problem.nodes}
    last_compute: dict[str, int] = {}
    for p, step in enumerate(flat):
        if step.op == "compute" and step.node in back and p < back[step.node]:
            last_compute[step.node] = p

    runs: list[list[tuple[str, int]]] = []
    p = 0
    for stage in schedule.stages:
        run: list[tuple[str, int]] = []
        for step in stage.steps:
            if step.op == "compute":
                impl = impls[step.node].get(step.impl)
                if step.node in back and impl is not None and back[step.node] > p:
                    if _stateless(impl):
                        joins = last_compute[step.node] == p
                    else:
                        joins = step.grad and state_steps.get(step.node) == 1
                else:
                    joins = False
                if joins:
                    run.append((step.node, p))
                elif step.grad:
                    runs.append(run)
                    run = []
            elif step.op == "make_state":  # (a state made from inputs joins as a compute with grad)
                if step.node in back and back[step.node] > p and state_steps.get(step.node) == 1:
                    run.append((step.node, p))
                else:
                    runs.append(run)
                    run = []
            p += 1
        runs.append(run)

    base_peak = simulate(problem, schedule, check_fingerprint=False).peak_bytes

    def fits(blocks: list[list[tuple[str, int]]]) -> bool:
        try:
            result = simulate(problem, _apply(schedule, flat, blocks, back), check_fingerprint=False)
        except ScheduleInvalid:
            return False
        return result.peak_bytes <= base_peak

    blocks: list[list[tuple[str, int]]] = []
    for run in runs:
        members = sorted(run, key=lambda m: back[m[0]])
        while len(members) >= 2:
            block = _dependent_prefix(members, back, backs, users, inputs)
            if len(block) >= 2 and not fits([*blocks, block]):
                lo, hi = 1, len(block) - 1  # the longest prefix that fits (lo fits: one member moves nothing)
                while lo < hi:
                    mid = (lo + hi + 1) // 2
                    if fits([*blocks, block[:mid]]):
                        lo = mid
                    else:
                        hi = mid - 1
                block = block[:lo]
            # (a block already adjacent that changes no grad flag would change nothing)
            if len(block) >= 2 and (_flips(flat, block) or not _adjacent(flat, block, back)):
                blocks.append(block)
            members = members[len(block) :]
    if not blocks:
        return schedule
    gathered = _apply(schedule, flat, blocks, back)
    result = simulate(problem, gathered, check_fingerprint=False)
    meta = {"blocks": len(blocks), "moved_steps": sum(len(b) - 1 for b in blocks)}
    return dataclasses.replace(
        gathered,
        predicted_peak_bytes=result.peak_bytes,
        meta={**schedule.meta, "gathered_backwards": meta},
    )


def _stateless(impl: Impl) -> bool:
    """Its backward reads no state: computing it with grad or without makes no difference."""
    return not (impl.keeps_inputs or impl.keeps_output or impl.state_bytes or impl.bwd_from_inputs)


def _adjacent(flat, block: list[tuple[str, int]], back: dict[str, int]) -> bool:
    """The block's backward steps follow each other already (nothing but frees between)."""
    inside = {m for m, _ in block}
    first, last = back[block[0][0]], back[block[-1][0]]
    return all(
        step.op in ("free_value", "free_state") or (step.op == "backward" and step.node in inside)
        for step in flat[first : last + 1]
    )


def _flips(flat, block: list[tuple[str, int]]) -> bool:
    """Gathering the block changes a compute's grad flag (a stateless member's)."""
    at = dict(block)
    return any(s.op == "compute" and s.node in at and s.grad != (p == at[s.node]) for p, s in enumerate(flat))


def _dependent_prefix(
    members: list[tuple[str, int]],
    back: dict[str, int],
    backs: dict[str, list[int]],
    users: dict[str, set[str]],
    inputs: dict[str, tuple[str, ...]],
) -> list[tuple[str, int]]:
    """The longest prefix (backward order) whose members' consumers outside it either have no
    backward step or have it before the prefix's first backward step, and whose members'
    backward steps, moved up to the first, pass no other node's backward step that makes a
    gradient for one of their inputs too (at least one member)."""
    first = back[members[0][0]]
    block = [members[0]]
    for m in members[1:]:
        inside = {x for x, _ in block} | {m[0]}
        outside_after = any(
            u not in inside and backs.get(u, [-1])[-1] > first for x in inside for u in users.get(x, ())
        )
        co_readers = {u for x in inputs[m[0]] for u in users[x]} - inside
        passes = any(first < p < back[m[0]] for u in co_readers for p in backs.get(u, ()))
        if outside_after or passes:
            break
        block.append(m)
    return block


def _apply(schedule: Schedule, flat, blocks: list[list[tuple[str, int]]], back: dict[str, int]) -> Schedule:
    """The schedule with each block's backward steps moved after its first one, its members'
    computes in the run with grad, and their other computes without."""
    moved: set[int] = set()
    after: dict[int, list] = {}
    with_grad: set[int] = set()
    members: dict[str, int] = {}
    for block in blocks:
        after[back[block[0][0]]] = [flat[back[m]] for m, _ in block[1:]]
        moved |= {back[m] for m, _ in block[1:]}
        with_grad |= {p for _, p in block}
        members.update(block)
    stages = []
    p = 0
    for stage in schedule.stages:
        steps = []
        for step in stage.steps:
            if p not in moved:
                if step.op == "compute" and step.node in members and step.grad != (p in with_grad):
                    step = dataclasses.replace(step, grad=p in with_grad)
                steps.append(step)
                steps.extend(after.get(p, ()))
            p += 1
        stages.append(Stage(stage.name, tuple(steps)))
    return dataclasses.replace(schedule, stages=tuple(stages))
