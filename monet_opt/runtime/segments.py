"""A group's forward as one generated Python function (fx code generation).

The executor interprets a schedule step by step, which costs Python around every node
(argument lookup, value handles, group bookkeeping: ~12 µs per node on a small GPT, 2-4 % of
its step). A group (`runtime/groups.py`) is run the way plain PyTorch would run it, so once a
step of its input signature has made the in-place decisions (`ScheduleExecutor._reuse_at`),
the steps from its first member's compute to its last member's compute can run as one
function generated from the model's own fx nodes, with the same effect as the steps:

* every compute of the span, in schedule order: group members with autograd, connected to
  each other (a member's input from another member is its real output, as `run.linked`
  gives the interpreter), the others without autograd; the implementation the schedule
  chose, or, where the replayed decision says so, the ReLU / addition in place;
* a member's input from outside the group comes through a `_Leaf` of its own, exactly as
  the interpreter's `_args` makes it, and cat / stack members read `_Dense` views;
* a node that replays random numbers (dropout computed again) or a memo (batch norm's
  statistics) does so as the interpreter's `compute` does, through the step's run;
* values die where the schedule frees them or earlier: fx's code sets each local to None
  after its last use, and a value from outside the span that the span frees is taken out of
  the executor's handles before the call and handed over in a list the function empties.

It returns the values still held at the span's end (the executor keeps their detached
handles, as after each compute) and the group members' outputs that take a gradient from
outside the group (the group's root). A span with anything else in it (a backward step, a
dropped state, a value read from a container that needs a gradient) is interpreted as before.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from monet_opt.ops.activation import relu_inplace_grad_
from monet_opt.ops.base import DEFAULT
from monet_opt.storage import only_reference


@dataclass
class Segment:
    """Steps [start, end) of stage `stage` as one call."""

    stage: int
    start: int
    end: int
    # module(vals, leaves, run) -> [held values..., external members' outputs...]
    module: fx.GraphModule
    inputs: list[tuple[fx.Node, bool]]  # (value read from outside the span, taken out of the handles)
    held: list[str]  # values computed in the span and still held at its end
    external: list[str]  # group members whose outputs take a gradient from outside the group


def _clear(values: list) -> None:
    values.clear()


# the in-place decision (`ScheduleExecutor._reuse_at`) for a ReLU run with "inplace_grad"
RELU_INPLACE_GRAD = "relu_inplace_grad"


def _copy_if_shared(g: torch.Tensor) -> torch.Tensor:
    # (inside a tensor hook the engine's buffer and the argument are the two references of a
    # gradient nobody else holds; a third is another branch's: an addition's pass-through)
    return g if only_reference(g, references=2) else g.clone()


def guard_gradient(t: Any) -> Any:
    """t, whose gradient the engine hands to a backward that writes into it
    (`ScheduleExecutor.guarded`): copied first if anything else holds it (a branch whose
    gradient was expected is None, and an addition's pass-through is all that came)."""
    if isinstance(t, torch.Tensor) and t.requires_grad:
        t.register_hook(_copy_if_shared)
    return t


def _relu_(x: torch.Tensor) -> torch.Tensor:
    return torch.relu_(x)


def _add_(x: torch.Tensor, y: Any) -> torch.Tensor:
    return x.add_(y)


def _runner(impl, target, recompute: bool, grad: bool):
    """A call of `impl` on `target` (as `ScheduleExecutor._call`), with grad mode set."""
    run = impl.run
    if grad:

        def run_impl(*args, **kwargs):
            return run(target, args, kwargs, recompute)

        return run_impl

    def run_no_grad(*args, **kwargs):
        prev = torch.is_grad_enabled()
        torch._C._set_grad_enabled(False)
        try:
            return run(target, args, kwargs, recompute)
        finally:
            torch._C._set_grad_enabled(prev)

    return run_no_grad


def _replaying_runner(impl, plan, name: str, recompute: bool, grad: bool, rng):
    """A call that replays, as `ScheduleExecutor.compute` does: the random numbers a node drew
    in the forward (saved then, restored when computed again), an implementation's memo and
    the buffers a module started from (`_run_node`)."""
    save_rng, same_rng, restore_rng, run_node = rng
    memo = impl.replays and plan.again
    random = plan.random

    def run_replaying(step_run, *args, **kwargs):
        extra = {"memo": step_run.memos.setdefault(name, {})} if memo else {}
        before = ctx = None
        if random:
            if not recompute:
                before = save_rng()
            elif name in step_run.rng:
                ctx = restore_rng(step_run.rng[name])
        prev = torch.is_grad_enabled()
        torch._C._set_grad_enabled(grad)
        try:
            out = run_node(step_run, plan, name, impl, args, kwargs, recompute, extra, ctx)
        finally:
            torch._C._set_grad_enabled(prev)
        if before is not None and not same_rng(before, save_rng()):
            step_run.rng[name] = before
        return out

    return run_replaying


def build_segment(executor, run, si: int, start: int, group, attached: bool = False) -> Segment | None:
    """The generated function for the span of stage si from step `start` (the group's first
    member compute) to its last member's compute, or None if the span cannot be one call.
    attached (`ScheduleExecutor.run_forward`'s): the model's inputs are read as they are, in
    the caller's graph, not through leaves; a span needing any other leaf is not built."""
    from monet_opt.runtime.executor import (
        _ANCHOR,
        _SLICING_BACKWARD,
        _Dense,
        _GradBox,
        _Leaf,
        _RestoreRng,
        _run_node,
        _same_rng,
        _save_rng,
    )

    rng = (_save_rng, _same_rng, _RestoreRng, _run_node)

    stage = executor.schedule.stages[si]
    steps = stage.steps
    members = set(group.members)
    last = group.members[-1]
    end = None
    for k in range(start, len(steps)):
        step = steps[k]
        if step.op == "free_value":
            continue
        if step.op != "compute":
            return None  # a backward step or a dropped state inside the span
        if step.grad != (step.node in members):
            return None
        if step.node == last:
            end = k + 1
            break
    if end is None:
        return None
    recompute = si > 0
    dense = _dense_maker(_Dense)
    graph = fx.Graph()
    vals = graph.placeholder("vals")
    leaves = graph.placeholder("leaves")
    step_run = graph.placeholder("run")  # the executor's _StepRun: RNG states and memos
    local: dict[str, fx.Node] = {}  # value computed in the span -> its node in the new graph
    inputs: list[fx.Node] = []
    loaded: dict[str, fx.Node] = {}
    # every value read from outside the span, loaded first (then the list is emptied)
    computed: set[str] = set()
    for k in range(start, end):
        step = steps[k]
        if step.op != "compute":
            continue
        if step.impl in executor.restore_impls:
            return None  # (a restore reads a state, not its inputs: the interpreter runs it)
        if step.node in run.env:
            return None  # computed again while its handle is held: the interpreter replaces it
        for arg in executor.plans[step.node].node.all_input_nodes:
            if arg.name in loaded or arg.name in computed:
                continue
            if arg.op not in ("get_attr", "placeholder") and arg.name not in run.env:
                return None  # (not held: the interpreter says so)
            loaded[arg.name] = graph.call_function(operator.getitem, (vals, len(inputs)))
            inputs.append(arg)
        computed.add(step.node)
    graph.call_function(_clear, (vals,))
    freed_in_span = {steps[k].node for k in range(start, end) if steps[k].op == "free_value"}
    decisions = run.reuse
    for k in range(start, end):
        step = steps[k]
        if step.op != "compute":
            continue
        plan = executor.plans[step.node]
        node = plan.node
        grad = step.grad
        slicing = plan.target in _SLICING_BACKWARD

        def load(arg: fx.Node, grad=grad, slicing=slicing) -> Any:
            if arg.name in local:
                if grad and arg.name not in members and arg.name in executor.has_backward:
                    # computed here without autograd (a span's non-members are: checked above; its
                    # state made from inputs later, or recomputed later), read by a member: the
                    # interpreter's `_args` gives the reader a leaf whose gradient reaches it
                    raise _NotPlain
                value = local[arg.name]
                if grad and slicing:
                    return graph.call_function(dense, (value,))
                return value
            value = loaded[arg.name]
            if attached and arg.op == "placeholder":
                return value
            if grad and arg.op != "get_attr" and _needs_leaf(executor, run, arg):
                if attached:
                    raise _NotPlain
                return graph.call_function(_leaf_maker(arg.name, _GradBox, _Leaf, _ANCHOR), (leaves, value))
            return value

        try:
            args = fx.node.map_arg(node.args, load)
            kwargs = fx.node.map_arg(node.kwargs, load)
        except _NotPlain:
            return None
        reuse = decisions.get((si, k))
        impl = plan.impls[step.impl]
        # (in the interpreter's order, `ScheduleExecutor._call`: a decided in-place run first;
        # a recomputed ReLU checked for replay first ran out of place, 2 MiB over VGG's prediction)
        if reuse == "relu":
            new = graph.call_function(_relu_, (args[0],))
        elif reuse == RELU_INPLACE_GRAD:
            new = graph.call_function(relu_inplace_grad_, (args[0],))
        elif reuse == "add":
            new = graph.call_function(_add_, (args[0], args[1]))
        elif plan.random or (impl.replays and plan.again):
            runner = _replaying_runner(impl, plan, step.node, recompute, grad, rng)
            new = graph.call_function(runner, (step_run, *args), kwargs)
        elif impl is DEFAULT and grad:
            new = graph.create_node(node.op, node.target, args, kwargs)  # as the model wrote it
        else:
            new = graph.call_function(_runner(impl, plan.target, recompute, grad), args, kwargs)
        if grad and step.node in executor.guarded:
            new = graph.call_function(guard_gradient, (new,))
        local[step.node] = new
    held = [n for n in local if n not in freed_in_span]
    external = [m for m in group.members if m in group.external]
    graph.output([*(local[n] for n in held), *(local[m] for m in external)])
    module = fx.GraphModule(executor.gm, graph)  # (shares the model's modules it calls)
    taken = [(arg, arg.name in freed_in_span and arg.name in run.env) for arg in inputs]
    return Segment(si, start, end, module, taken, held, external)


def _needs_leaf(executor, run, arg: fx.Node) -> bool:
    """As the interpreter's `_args` (`ScheduleExecutor.needs_leaf`), for a value that is not a container."""
    value = executor._value_of(run, arg)
    if isinstance(value, (list, tuple, dict)):
        raise _NotPlain
    return executor.needs_leaf(run, arg, value)


class _NotPlain(Exception):
    """A container value read by a member from outside, or a value computed in the span without
    autograd that a member takes a gradient to: left to the interpreter."""


def _leaf_maker(source: str, box_type, leaf, anchor):
    """make_leaf(leaves, value): the executor's `_Leaf` of value, read from `source`, recorded in
    `leaves` as the interpreter's `_args` records it."""

    def make_leaf(leaves: list, value: torch.Tensor) -> torch.Tensor:
        box = box_type()
        leaves.append((source, 0, box))
        return leaf.apply(box, anchor, value)

    return make_leaf


def _dense_maker(dense):
    """dense_if_grad(value): the executor's `_Dense` view of each tensor in value that needs a
    gradient (a cat / stack member's input from another member)."""

    def dense_if_grad(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return dense.apply(value) if value.requires_grad else value
        if isinstance(value, (list, tuple)):
            return type(value)(dense_if_grad(v) for v in value)
        return value

    return dense_if_grad
