"""Which nodes of a schedule can share one autograd graph (one backward call).

The executor gives every node its own small autograd graph, so that a node's backward
state can be kept, dropped and rebuilt on its own. That costs a few autograd objects and
one `torch.autograd.grad` call per node: ~0.1 ms, which is 10-15 % of a step for small
models on CPU (and would be more on a GPU, where the kernels are short).

Nodes that the schedule runs the way plain PyTorch or `torch.utils.checkpoint` would can
share one graph instead: a *group* is a run of consecutive computes with autograd in one
stage (computes without autograd, such as shape arithmetic or a recompute of a value
whose state is not needed, do not interrupt it), whose nodes each

* are computed with autograd once (here), or have their state made from their inputs here (a
  `make_state` step: its input from a member is the member's real output, so the convolution's
  backward feeds the member's directly), and have one backward step, after it, and no
  `free_state` before that backward step;
* have no implementation that writes into the gradient it is fed (in a shared graph the
  engine may hand that buffer to another branch too; add's pass-through is fine), unless
  the engine always hands that node a buffer nobody else holds
  (`ScheduleExecutor._own_gradients`: a ReLU read by a convolution, a block output read twice);

and whose backward steps follow each other with nothing in between but frees (no compute,
no backward of another node), after the backward of every node outside the group that
consumes a member's output. In a schedule without recomputation that is typically the
whole model; in a checkpointed one, each recomputed segment.

The executor then runs the members' forwards connected (a member's input from another
member is the real output, not a detached copy), and at the first member backward step
runs one `autograd.grad` over the whole group, after doing the frees up to its last
member backward (freeing earlier only lowers the peak). Inside that call the autograd
engine frees each member's saved tensors and gradients as it goes, as in plain PyTorch.
Two places where the engine would hold more than the memory model says are handled by the
executor: the gradient of a value read from outside the group is added to that value's
accumulated gradient inside the engine call, the moment the reader's backward makes it (held
until the call ends, it sat beside the accumulated one through the later members' backward:
GoogLeNet measured 128 KiB over its prediction where a big convolution's workspace came
next), and the inputs of a cat or stack get dense copies of their gradient slices (the engine
would keep the whole output gradient until the last slice is consumed).
"""

from __future__ import annotations

from dataclasses import dataclass

from solver.schedule import Schedule


@dataclass(frozen=True)
class Group:
    members: tuple[str, ...]  # forward order
    external: frozenset[str]  # members whose output gets a gradient from outside the group
    first_backward: tuple[int, int]  # (stage, step) of the first member backward step
    frees: tuple[
        tuple[str, str], ...
    ]  # (op, node) of the free steps after it, up to the last member backward's stage
    # (stage, step) of the last member backward step: the steps after the first one, up to
    # this one, are its frees and member backwards, all done at the first
    last_backward: tuple[int, int]


def find_groups(
    schedule: Schedule, users: dict[str, set[str]], grad_writers: set[tuple[str, str]]
) -> list[Group]:
    """Groups of two or more nodes (see the module docstring).

    users: node -> names of the nodes (or "output") that take its value as an input.
    grad_writers: (node, implementation) pairs whose backward writes into its gradient.
    """
    steps = [(si, k, step) for si, stage in enumerate(schedule.stages) for k, step in enumerate(stage.steps)]
    grad_computes: dict[str, int] = {}
    computed_at: dict[str, int] = {}  # (index in steps) a candidate's one compute with autograd
    backward_at: dict[str, list[tuple[int, int]]] = {}
    free_state_at: dict[str, list[tuple[int, int]]] = {}
    freed_at: dict[str, list[int]] = {}  # (indices in steps) free_value steps
    for n, (si, k, step) in enumerate(steps):
        if (step.op == "compute" and step.grad) or step.op == "make_state":
            grad_computes[step.node] = grad_computes.get(step.node, 0) + 1
            computed_at[step.node] = n
        elif step.op == "backward":
            backward_at.setdefault(step.node, []).append((si, k))
        elif step.op == "free_state":
            free_state_at.setdefault(step.node, []).append((si, k))
        elif step.op == "free_value":
            freed_at.setdefault(step.node, []).append(n)
    index = {(si, k): n for n, (si, k, _) in enumerate(steps)}

    def candidate(si: int, k: int, step) -> bool:
        if grad_computes.get(step.node) != 1 or (step.node, step.impl) in grad_writers:
            return False
        backs = backward_at.get(step.node, [])
        if len(backs) != 1 or backs[0] < (si, k):
            return False
        return all(pos > backs[0] for pos in free_state_at.get(step.node, []))

    def valid(members: list[str]) -> bool:
        first = min(backward_at[m][0] for m in members)
        last = max(backward_at[m][0] for m in members)
        inside = set(members)
        for _, _, step in steps[index[first] : index[last] + 1]:
            if step.op in ("compute", "make_state") or (step.op == "backward" and step.node not in inside):
                return False
        closed = computed_at[members[-1]]
        for m in members:
            for u in users.get(m, ()):
                if u not in inside and any(pos > first for pos in backward_at.get(u, [])):
                    return False  # its gradient would reach m after the group's backward
            if _external(m, inside, users, backward_at) and any(
                computed_at[m] < pos < closed for pos in freed_at.get(m, ())
            ):
                # the group holds an output that takes a gradient from outside until its graph
                # closes (the root is made then): freed before, it would outlive its handle
                return False
        return True

    groups: list[Group] = []
    run: list[str] = []
    run_stage = -1

    def close() -> None:
        if len(run) >= 2:
            groups.append(_group(steps, index, run, users, backward_at))

    for si, k, step in steps:
        if not ((step.op == "compute" and step.grad) or step.op == "make_state"):
            continue  # (a compute without autograd does not touch the graph)
        ok = candidate(si, k, step)
        if ok and run and si == run_stage and valid([*run, step.node]):
            run.append(step.node)
            continue
        close()
        run, run_stage = ([step.node], si) if ok else ([], -1)
    close()
    return groups


def _group(steps, index, members: list[str], users, backward_at) -> Group:
    inside = set(members)
    first = min(backward_at[m][0] for m in members)
    last = max(backward_at[m][0] for m in members)
    frees = tuple(
        (step.op, step.node)
        for _, _, step in steps[index[first] + 1 : index[last] + 1]
        if step.op in ("free_value", "free_state")
    )
    external = frozenset(m for m in members if _external(m, inside, users, backward_at))
    return Group(tuple(members), external, first, frees, last)


def _external(m: str, inside: set[str], users, backward_at) -> bool:
    """m's output takes a gradient from outside the group: a model output, or read by a node
    outside with a backward step (not, say, a shape query: holding a member's output for it
    would hold its storage)."""
    return any(u not in inside and (u == "output" or u in backward_at) for u in users.get(m, ()))
