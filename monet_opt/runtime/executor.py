"""Execute a schedule's steps on an fx graph: forward, recompute, backward, free.

The executor follows `solver.simulate`'s memory model step by step:

* a value handle is the detached output of a node (`env[name]`); dropping it
  (`free_value`) releases the storage unless a backward state still holds it;
* `compute ... grad=True` runs the node on detached copies of its inputs, so its
  autograd graph is local: the graph's saved tensors are the node's backward
  state. A small `_Root` function stands in for the output, so holding the state
  does not hold the output's storage (only what the op itself saved);
* `backward t` feeds t's gradient into its local graph: input gradients come back
  on the detached leaves and are added into the producers' gradients; parameter
  gradients accumulate into `.grad` as in plain PyTorch. An implementation with an
  in-place gradient (`grad_in_place`) overwrites the gradient it is fed, so it gets
  a buffer nobody else holds: a model output's gradient (the loss made it, and the user
  may hold it) or a gradient shared with another slot is copied first, as the memory
  model says. Inside a shared graph (below) such a node runs only where the engine always
  hands it a buffer of its own (`_own_gradients`);
* runs of nodes the schedule treats as plain PyTorch would (computed once with
  autograd, backward steps back to back; `runtime/groups.py`) share one connected graph
  and one `autograd.grad` call instead: the per-node objects and calls cost ~0.1 ms each;
* ReLU and tensor additions with the default implementation run in place on their
  first input when the schedule frees that input right after the step and nothing
  else holds its storage (no live backward state saved it, no other handle shares
  it), as plain PyTorch models do with `inplace=True` and `out += identity`. The
  memory model counts a new output there, so this only lowers the measured peak; it
  saves the page faults of a fresh buffer (ResNet-50 b8 224 on CPU: 65 such steps).
  Whether a step may do so depends only on the schedule and the step's input signature
  (shapes, dtypes, gradient needs, autocast): the first step of a signature decides, with
  saved-tensor hooks and counted storage handles; later steps replay its decisions and
  track nothing (`_reuse_at`);
* in those later steps each group's forward span runs as one generated function
  (`runtime/segments.py`), the interpreter's Python per node gone (small GPT: ~12 -> ~3 µs);
* a schedule that runs the whole model as plain PyTorch would (nothing recomputed, every
  node with a backward in one group: `ScheduleExecutor.attachable`) can run *attached*
  (`run_forward(..., attached=True)`): the group's graph reads the model's inputs and
  parameters directly and its outputs are returned as they are, so the user's backward is
  the engine's own, plain PyTorch's, with no executor backward at all. The wrapper does so
  when nothing else needs its autograd node (`MonetWrapper._attaches`): the wrapper's
  Function and its nested engine call cost 1-3 % of a small GPT's step.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import operator
import os
import warnings
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from torch._prims_common import is_non_overlapping_and_dense_or_false
from torch.utils._pytree import SUPPORTED_NODES, tree_flatten, tree_unflatten

from monet_opt import autocast_regions, input_layout, module_state
from monet_opt.ops import implementations_for, makes_gradients, passes_gradient
from monet_opt.ops.activation import relu_inplace_grad_
from monet_opt.ops.base import Implementation
from monet_opt.restore import consumer_of, holds_packed_input, restored_value
from monet_opt.runtime.deferred import deferrable, deferring, make_weight_gradients
from monet_opt.runtime.groups import Group, find_groups
from monet_opt.runtime.segments import RELU_INPLACE_GRAD, Segment, build_segment, guard_gradient
from monet_opt.storage import gradient_spans_storage, only_reference, spans_storage, storage_key
from solver.schedule import DEFERRED_META, Schedule

# shared autograd graphs (runtime/groups.py) are on unless MONET_OPT_GROUPS=0
_GROUPS = os.environ.get("MONET_OPT_GROUPS", "1") == "1"
# their forwards run as generated functions (runtime/segments.py) unless MONET_OPT_SEGMENTS=0
_SEGMENTS = os.environ.get("MONET_OPT_SEGMENTS", "1") == "1"
# a schedule without recomputation runs attached to the caller's graph unless MONET_OPT_ATTACHED=0
_ATTACHED = os.environ.get("MONET_OPT_ATTACHED", "1") == "1"


class ScheduleRuntimeError(RuntimeError):
    """The schedule does not fit the model it is run on."""


class _GradBox:
    def __init__(self) -> None:
        self.grads: list[torch.Tensor | None] | None = None
        # a leaf's: set while the engine runs, takes the gradient the moment the leaf's backward runs
        self.sink: Callable[[torch.Tensor], None] | None = None


class _Root(torch.autograd.Function):
    """Stand-in output of a node's local graph: holds no storage of the outputs."""

    @staticmethod
    def forward(ctx, box: _GradBox, *outs: torch.Tensor) -> torch.Tensor:
        ctx.box = box
        return outs[0].new_empty(0)

    @staticmethod
    def backward(ctx, _unused: torch.Tensor):
        grads = ctx.box.grads
        ctx.box.grads = None
        return (None, *grads)


class _Leaf(torch.autograd.Function):
    """An input of a node's local graph. Unlike `x.detach().requires_grad_()`, it does
    not keep x's storage alive (a leaf's AccumulateGrad would): the graph holds only
    what the op itself saved. Its gradient goes to `box.sink` as soon as it is computed
    (into the source's accumulated gradient, as the memory model adds it right after the
    reader's backward)."""

    @staticmethod
    def forward(ctx, box: _GradBox, _anchor: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        ctx.box = box
        return x.detach()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        if not gradient_spans_storage(grad):
            # a slice of a larger gradient (cat, split) or an expanded one: keep a dense copy,
            # as a leaf's AccumulateGrad would, so the larger storage is not pinned by it
            grad = grad.clone()
        ctx.box.sink(grad)
        return None, None, None


_ANCHOR = torch.empty(0, requires_grad=True)  # makes _Leaf outputs require grad


class _Dense(torch.autograd.Function):
    """Identity whose backward makes a slice of a larger gradient a dense copy, as `_Leaf`
    does. Inside a group, a member's input from another member is the real output; the
    backward of cat or stack hands each input a slice of the output's gradient, and the
    engine would keep that whole gradient alive until the last slice is consumed (the memory
    model, and separate graphs, free each input's share as its backward finishes)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad if gradient_spans_storage(grad) else grad.clone()


# ops whose backward returns slices of the gradient it is fed
_SLICING_BACKWARD = {torch.cat, torch.concat, torch.concatenate, torch.stack, torch.hstack, torch.vstack}


_CONTAINERS = (list, tuple, dict, collections.deque)  # what torch's pytree may open


def _flatten(value: Any) -> tuple[list, Any]:
    """tree_flatten with a fast path for a bare tensor (most nodes' value) or any other value
    that is not a container (a number, a dtype): spec None."""
    if type(value) is torch.Tensor or (
        not isinstance(value, _CONTAINERS) and type(value) not in SUPPORTED_NODES
    ):
        return [value], None
    return tree_flatten(value)


def _unflatten(flat: list, spec: Any) -> Any:
    return flat[0] if spec is None else tree_unflatten(flat, spec)


@dataclass
class _State:
    root: torch.Tensor | None  # None while a group's forward is still running
    box: _GradBox
    outputs: list[tuple[str, int]]  # (node, flat output position) fed to the root, needing grad
    leaves: list[tuple[str, int, _GradBox]]  # (source node, flat position in source, its gradient box)
    # nodes whose backward overwrites (or passes on) the gradient it is fed
    in_place: set[str] = field(default_factory=set)
    saved: set[int] = field(default_factory=set)  # storages (data_ptr) its local graph saved
    packed_by: Any = None  # a restore source's: the autograd node that keeps its input packed


@dataclass
class _Plan:
    node: fx.Node
    target: Any
    impls: dict[str, Implementation]
    random: bool  # replay the forward's RNG state when computed again
    params: list[torch.Tensor]  # parameters the node uses that need gradients
    reuse: str | None = None  # "relu" / "add": the default may run in place on its first input
    again: bool = False  # the schedule computes it again: implementations that replay get a memo
    state: list[str] = field(default_factory=list)  # buffers it changes, recomputed from (module_state)


@dataclass
class _StepRun:
    env: dict[str, Any] = field(default_factory=dict)
    states: dict[str, _State] = field(default_factory=dict)
    grads: dict[str, list[torch.Tensor | None]] = field(default_factory=dict)
    rng: dict[str, tuple] = field(default_factory=dict)
    memos: dict[str, dict] = field(default_factory=dict)  # per node, for implementations that replay
    buffer_states: dict[str, dict] = field(default_factory=dict)  # per node, its buffers before it ran
    inputs: dict[str, Any] = field(default_factory=dict)
    input_grads: dict[str, torch.Tensor] = field(default_factory=dict)
    param_grads: dict[int, torch.Tensor] = field(default_factory=dict)  # id(param) -> gradient
    param_left: dict[int, int] = field(default_factory=dict)  # id(param) -> backwards still to run
    flat_len: dict[str, int] = field(default_factory=dict)
    output_map: list[tuple[str, int]] = field(default_factory=list)
    output_grad_keys: set[int] = field(default_factory=set)  # storages of the model outputs' gradients
    # storages (data_ptr) held by the value handles in env, and saved by the live states:
    # counted as they come and go, so the in-place reuse check is O(1), not O(live values)
    value_refs: Counter = field(default_factory=Counter)
    value_keys: dict[str, list[int]] = field(default_factory=dict)
    saved_refs: Counter = field(default_factory=Counter)
    linked: dict[str, Any] = field(default_factory=dict)  # a running group's outputs, graph attached
    # in-place decisions: None while they are being made (the first step of an input signature:
    # storages tracked, `decided` filled in); then the recorded ones, replayed without tracking
    reuse: dict[tuple[int, int], str] | None = None
    decided: dict[tuple[int, int], str] = field(default_factory=dict)
    signature: tuple = ()
    # parameters (id) whose gradient came laid out unlike them (`_laid_out_as_param`): learnt
    # in the first step of an input signature, where every parameter's gradient is checked as
    # the engine makes it; later steps hook those only
    relaid: set[int] = field(default_factory=set)
    pending: list[torch.Tensor] = field(default_factory=list)  # a running group's root inputs
    # (stage, step): the steps up to it are done (a group's backward ran its range's frees and
    # member backwards at its first member backward step)
    done_to: tuple[int, int] = (-1, -1)
    # nodes computed for a backward whose outputs need no gradient (their parameters frozen since
    # the schedule was solved): the gradients their readers make for them are dropped
    without_graph: set[str] = field(default_factory=set)
    # the model outputs' gradients as the loss made them, held until their node's backward is
    # fed (an output's gradient is shared until then: a consumer's is summed into a new buffer)
    loss_grads: dict[str, list[torch.Tensor]] = field(default_factory=dict)
    # run attached (`ScheduleExecutor.run_forward`): the group's inputs read directly, its
    # members' outputs kept in `linked` (graph attached) to the forward's end
    attached: bool = False
    # what deferred weight gradients are made from, as their nodes' backwards leave it
    # (`runtime/deferred.py`): consumed after the last stage
    deferred: list = field(default_factory=list)

    def put_value(self, name: str, value: Any, flat: list | None = None) -> None:
        """flat: value's flattened leaves, if the caller has them."""
        if self.reuse is not None:  # (decisions replayed: no storage tracking)
            self.env[name] = value
            return
        if name in self.env:
            self._unref(self.value_keys.pop(name))
        self.env[name] = value
        if flat is None:
            flat = _flatten(value)[0]
        keys = [storage_key(t) for t in flat if isinstance(t, torch.Tensor)]
        self.value_keys[name] = keys
        refs = self.value_refs
        for k in keys:
            refs[k] += 1

    def _unref(self, keys: list[int]) -> None:
        refs = self.value_refs
        for k in keys:
            refs[k] -= 1

    def put_detached(self, name: str, flat: list, spec: Any) -> None:
        """The handle of a computed value (flattened): its tensors detached."""
        detached = [t.detach() if isinstance(t, torch.Tensor) else t for t in flat]
        self.put_value(name, _unflatten(detached, spec), detached)

    def pop_value(self, name: str) -> None:
        self.linked.pop(name, None)
        if name in self.env:
            del self.env[name]
            if self.reuse is None:
                self._unref(self.value_keys.pop(name))

    def clear(self) -> None:
        for held in (
            self.env,
            self.states,
            self.grads,
            self.value_refs,
            self.value_keys,
            self.saved_refs,
            self.linked,
            self.pending,
            self.memos,
            self.param_left,
            self.loss_grads,
            self.deferred,
        ):
            held.clear()

    def put_state(self, name: str, state: _State) -> None:
        self.pop_state(name)
        self.states[name] = state
        if self.reuse is None:
            self.saved_refs.update(state.saved)

    def pop_state(self, name: str) -> _State | None:
        state = self.states.pop(name, None)
        if state is not None and self.reuse is None:
            self.saved_refs.subtract(state.saved)
        return state


def _resolve_target(gm: fx.GraphModule, node: fx.Node) -> Any:
    if node.op == "call_module":
        return gm.get_submodule(node.target)
    return node.target


def _node_params(gm: fx.GraphModule, node: fx.Node, target: Any) -> list[torch.Tensor]:
    params: dict[int, torch.Tensor] = {}
    if isinstance(target, torch.nn.Module):
        params.update((id(p), p) for p in target.parameters() if p.requires_grad)
    for arg in node.all_input_nodes:
        if arg.op == "get_attr":
            value = _fetch_attr(gm, arg.target)
            if isinstance(value, torch.Tensor) and value.requires_grad:
                params[id(value)] = value
    return list(params.values())


_RELU_FUNCTIONS = (torch.relu, torch.relu_, torch.nn.functional.relu, torch.nn.functional.relu_)
_ADD_FUNCTIONS = (operator.add, operator.iadd, torch.add)


def _reuse_kind(node: fx.Node, target: Any) -> str | None:
    """'relu' or 'add' if the node's default is a ReLU or an addition that may run in place."""
    if node.op == "call_module" and type(target) is torch.nn.ReLU:
        return "relu"
    if node.op == "call_function":
        if any(target is f for f in _RELU_FUNCTIONS) and set(node.kwargs) <= {"inplace"}:
            return "relu"
        if any(target is f for f in _ADD_FUNCTIONS) and len(node.args) == 2 and not node.kwargs:
            return "add"
    if node.op == "call_method":
        if target in ("relu", "relu_") and len(node.args) == 1 and not node.kwargs:
            return "relu"
        if target in ("add", "add_") and len(node.args) == 2 and not node.kwargs:
            return "add"
    return None


def reuse_arguments_allow(kind: str, x: Any, y: Any = None) -> bool:
    """The arguments let a ReLU ('relu') or an addition x + y ('add') write into x: x is a
    dense, non-empty floating tensor, contiguous or channels_last, not a view, and y a number or
    a tensor of x's dtype in another storage that broadcasts to x's shape (to a channels_last x:
    one laid out as x, so that the sum is laid out as out of place). (The rest of the condition
    depends on the schedule: see `ScheduleExecutor._may_reuse`; the profiler records this half as
    `Impl.fwd_in_place`, which `solver.simulate` counts.) Channels_last ones since session 45:
    out-of-place ReLUs and additions made a channels_last ResNet-50's step 9 % slower than plain
    (its in-place ReLU 9 ms a step, out of place 68 ms)."""
    if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x._is_view():
        # (a view in autograd's sense: see `ScheduleExecutor._may_reuse`; the runtime's detached
        # values are none, so there this only keeps the profile from counting on it)
        return False
    layout = input_layout.layout_of(x)
    if layout == "strided":
        return False
    contiguous = layout == input_layout.CONTIGUOUS
    if kind == "add":
        if isinstance(y, torch.Tensor):
            if y.dtype != x.dtype or storage_key(y) == storage_key(x):
                return False
            if torch.broadcast_shapes(x.shape, y.shape) != x.shape:
                return False
            if not contiguous and (y.shape != x.shape or y.stride() != x.stride()):
                return False
        elif not isinstance(y, (int, float)) or isinstance(y, bool):
            return False
    return x.numel() > 0 and spans_storage(x)


def _fetch_attr(gm: fx.GraphModule, target: str) -> Any:
    obj: Any = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


class ScheduleExecutor:
    """Runs one training step of `gm` as `schedule` says."""

    def __init__(self, gm: fx.GraphModule, schedule: Schedule) -> None:
        self.gm = gm
        self.schedule = schedule
        self.param_step: Callable[[torch.Tensor, torch.Tensor], None] | None = None
        self.param_readers: dict[int, int] = {}
        self.placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        self.output_node = next(n for n in gm.graph.nodes if n.op == "output")
        self.plans: dict[str, _Plan] = {}
        for node in gm.graph.nodes:
            if node.op in ("call_module", "call_function", "call_method"):
                target = _resolve_target(gm, node)
                # (a node inside the model's own autocast block runs under it: autocast_regions)
                spec = node.meta.get(autocast_regions.AUTOCAST)
                impls = {
                    i.name: i for i in autocast_regions.with_spec(implementations_for(node.op, target), spec)
                }
                self.plans[node.name] = _Plan(
                    node, target, impls, False, _node_params(gm, node, target), _reuse_kind(node, target)
                )
        self._check_schedule()
        # nodes whose weight gradients are made after the last stage (`runtime/deferred.py`)
        self.deferred = tuple(schedule.meta.get(DEFERRED_META, ()))
        self._records: list = []  # the running step's `_StepRun.deferred`
        for name in self.deferred:
            plan = self.plans.get(name)
            why = "the model has no such node" if plan is None else deferrable(plan.target)
            if why:
                raise ScheduleRuntimeError(f"the schedule defers the weight gradient of {name!r}: {why}")
            plan.impls = {k: deferring(v, name, lambda: self._records) for k, v in plan.impls.items()}
        self.deferred_params = {id(p) for name in self.deferred for p in self.plans[name].params}
        self.deferred_rank = {name: k for k, name in enumerate(self.deferred)}  # (their order)
        self.deferred_targets = {name: self.plans[name].target for name in self.deferred}
        # (node, implementation) -> the implementation whose run makes its state from its inputs
        self.state_impls: dict[tuple[str, str], Implementation] = {}
        # restores (`monet_opt.restore`): the nodes whose state they read, and their step names
        self.restore_impls = {
            s.impl for st in schedule.stages for s in st.steps if s.op == "compute" and consumer_of(s.impl)
        }
        self.restore_sources = {consumer_of(i) for i in self.restore_impls}
        # every node the schedule runs again and that drew random numbers in the forward
        # (dropout, dropout inside attention, user randomness) replays them: same masks
        for name in schedule.recomputed():
            self.plans[name].random = True
            self.plans[name].again = True
            # (a leaf changing its own buffers recomputes from their state before its first run)
            self.plans[name].state = self.plans[name].node.meta.get(module_state.CHANGED_BUFFERS, [])
        # freed_after[stage][k]: the values the schedule frees after step k, before its next
        # compute or backward
        self.freed_after: list[list[frozenset[str]]] = []
        for stage in schedule.stages:
            after: list[frozenset[str]] = []
            freed: set[str] = set()
            for step in reversed(stage.steps):
                after.append(frozenset(freed))
                if step.op in ("compute", "make_state", "backward"):
                    freed = set()
                elif step.op == "free_value":
                    freed.add(step.node)
            self.freed_after.append(after[::-1])
        # runs of nodes that share one autograd graph and one backward call (runtime/groups.py)
        users = {
            n.name: {u.name if u.op != "output" else "output" for u in n.users}
            for n in gm.graph.nodes
            if n.name in self.plans
        }
        # nodes with a backward stage: their outputs need gradients
        self.has_backward = {
            step.node for stage in schedule.stages[1:] for step in stage.steps if step.op == "backward"
        }
        # implementations that write into the gradient they are fed stay alone, unless that
        # gradient is the node's own inside any graph (`_own_gradients`): in a shared graph the
        # engine may hand the buffer to another branch too (add's pass-through does)
        own, self.guarded = self._own_gradients()
        writes = {
            (n, i)
            for n, plan in self.plans.items()
            if not passes_gradient(plan.node.op, plan.target) and n not in own
            for i, impl in plan.impls.items()
            if impl.grad_in_place
        }
        # a restore source stays alone too: its state is looked up by its name
        writes |= {(c, i) for c in self.restore_sources for i in self.plans[c].impls}
        # per input signature, the in-place decisions of a whole step (`_reuse_at`)
        self.reuse_decisions: dict[tuple, dict[tuple[int, int], str]] = {}
        self.relaid: dict[tuple, set[int]] = {}  # per input signature, `_StepRun.relaid`
        self.set_groups(find_groups(schedule, users, writes) if _GROUPS else [])
        # called with a stage's index after its last step (`monet_opt.bench.measure_stage_peaks`)
        self.after_stage: Callable[[int], None] | None = None
        # what watches each step's stages or nodes (a `NodeTimer`, the stage peaks' `after_stage`):
        # while any is here, steps run through the wrapper's own backward, whose stages they see
        # (`MonetWrapper._attaches`), not attached
        self.observers: set[object] = set()

    def _own_gradients(self) -> tuple[set[str], set[str]]:
        """Nodes whose output's gradient, as the autograd engine hands it to their backward in
        a shared graph, is a buffer nobody else holds, so an implementation may write into it.

        Counted are the reads by nodes with a backward step. A gradient summed from two or more
        is one: the engine adds in place only into a buffer it alone holds, else into a new
        one. So is a gradient with none (fed at the group's edge, from the model's output or
        nodes outside the group, and copied there unless owned: `_owned`). One read alone by a
        node whose backward makes new input gradients (`makes_gradients`) is one too, and so,
        handed on, is the gradient such a node writes into, if its own output's gradient is
        one. Anything else (an addition's pass-through, a view's gradient, an unknown op) is
        not.

        Also returns the writers owning a sum that has a read of the second kind: if the others
        bring no gradient (an output the loss does not read after all), the addition's shared
        buffer is all that comes; a hook copies it then (`segments.guard_gradient`)."""
        writers = {
            s.node
            for st in self.schedule.stages
            for s in st.steps
            if s.op == "compute" and s.grad and self.plans[s.node].impls[s.impl].grad_in_place
        }
        memo: dict[str, bool] = {}

        def owns(name: str) -> bool:
            if name not in memo:
                memo[name] = False  # (a DAG has no cycles; a guard all the same)
                node = self.plans[name].node
                reads = [
                    u
                    for u in node.users
                    if u.name in self.has_backward
                    for a in tree_flatten((u.args, u.kwargs))[0]
                    if a is node
                ]
                fresh = [
                    makes_gradients(u.op, self.plans[u.name].target)
                    and (u.name not in writers or owns(u.name))
                    for u in reads
                ]
                memo[name] = len(reads) != 1 or fresh[0]
                if len(reads) > 1 and not all(fresh):
                    summed.add(name)
            return memo[name]

        summed: set[str] = set()
        own = {n for n in self.plans if owns(n)}
        return own, summed & writers

    def set_groups(self, groups: list[Group]) -> None:
        """Run these groups' members with shared graphs (`find_groups`), every other node alone."""
        self.reuse_decisions.clear()  # (made with the previous groups' linked values)
        self.relaid.clear()
        self.flat_lens: dict[tuple, dict[str, int]] = {}
        self.segments: dict[tuple, Segment | None] = {}
        self.groups = groups
        self.group_of: dict[str, Group] = {m: g for g in groups for m in g.members}
        self.group_key = {m: _group_key(g) for g in groups for m in g.members}
        # a group's parameters, each once, in the members' order (what its backward call asks for)
        self.group_params: dict[str, list[torch.Tensor]] = {}
        for g in groups:
            params = {id(p): p for m in g.members for p in self.plans[m].params}
            self.group_params[_group_key(g)] = list(params.values())
        # (stage, step) of each group's first member compute; members whose backward passes the
        # gradient it is fed on (add's)
        self.group_starts: dict[tuple[int, int], Group] = {}
        self.group_in_place: dict[str, frozenset[str]] = {_group_key(g): frozenset() for g in groups}
        for si, stage in enumerate(self.schedule.stages):
            for k, step in enumerate(stage.steps):
                group = self.group_of.get(step.node)
                if step.op == "compute" and step.grad and group is not None:
                    if step.node == group.members[0]:
                        self.group_starts[(si, k)] = group
                    if self.plans[step.node].impls[step.impl].grad_in_place:
                        self.group_in_place[_group_key(group)] |= {step.node}
        self.stage_group_starts = [
            {k for (s, k) in self.group_starts if s == si} for si in range(len(self.schedule.stages))
        ]
        if self.param_step is not None:
            self._count_param_readers()
        self.attachable = _ATTACHED and not self.deferred and self._one_plain_graph()
        # the schedule's run inside the caller's backward call (`runtime/one_call.py`): False
        # until the wrapper asks, then a `OneCall` or None
        self.one_call: Any = False

    def _one_plain_graph(self) -> bool:
        """The schedule runs the model as plain PyTorch would: nothing computed in a backward
        stage, and every node computed with autograd, or with a backward step, a member of
        one group. Its graph can then be the caller's (`run_forward`'s attached)."""
        if len(self.groups) != 1 or self.restore_impls:
            return False
        members = set(self.groups[0].members)
        for si, stage in enumerate(self.schedule.stages):
            for step in stage.steps:
                if step.op == "compute" and (si > 0 or (step.grad and step.node not in members)):
                    return False
                if step.op == "backward" and step.node not in members:
                    return False
        return True

    def separate_graphs(self) -> None:
        """Give every node its own graph and backward call again (no groups): per-node timing
        (`monet_opt.calibrate`) needs each backward step to do its own node's work."""
        self.set_groups([])

    def _check_schedule(self) -> None:
        for si, stage in enumerate(self.schedule.stages):
            for step in stage.steps:
                plan = self.plans.get(step.node)
                if plan is None:
                    raise ScheduleRuntimeError(
                        f"schedule stage {stage.name!r} names node {step.node!r}, which this model does not have"
                    )
                consumer = consumer_of(step.impl) if step.op == "compute" else None
                if consumer is not None:
                    reader = self.plans.get(consumer)
                    if reader is None or step.node not in {a.name for a in reader.node.all_input_nodes}:
                        raise ScheduleRuntimeError(
                            f"schedule restores {step.node!r} from {consumer!r}, which does not read it"
                        )
                    if si == 0 or step.grad:
                        raise ScheduleRuntimeError(
                            f"schedule restores {step.node!r} in stage {stage.name!r}: restores run in "
                            "backward stages, without grad"
                        )
                elif step.op in ("compute", "make_state") and step.impl not in plan.impls:
                    raise ScheduleRuntimeError(
                        f"schedule asks node {step.node!r} to run implementation {step.impl!r}, "
                        f"not available here (available: {', '.join(plan.impls)})"
                    )
                elif step.op == "make_state" and (si == 0 or plan.impls[step.impl].state_from_inputs is None):
                    raise ScheduleRuntimeError(
                        f"schedule makes the state of {step.node!r} ({step.impl!r}) from its inputs in "
                        f"stage {stage.name!r}: only in a backward stage, with an implementation that can"
                    )

    # -- argument resolution -----------------------------------------------------
    def _value_of(self, run: _StepRun, node: fx.Node) -> Any:
        if node.op == "placeholder":
            return run.inputs[node.name]
        if node.op == "get_attr":
            return _fetch_attr(self.gm, node.target)
        try:
            return run.env[node.name]
        except KeyError:
            raise ScheduleRuntimeError(
                f"node {node.name!r} is needed but its value is not held (the schedule freed it)"
            ) from None

    def _args(self, run: _StepRun, node: fx.Node, grad: bool):
        """The node's arguments. With grad, each floating-point input that needs a gradient comes
        through a `_Leaf` of its own, whose gradient is added to the source's accumulated one as
        soon as this node's backward has made it (see `backward`). Group members do not share
        leaves: a shared leaf's gradient is held by the engine until its last reader's backward,
        beside the source's accumulated gradient (one activation gradient more than the memory
        model, measured on GoogLeNet: 128 KiB over the prediction)."""
        leaves: list[tuple[str, int, _GradBox]] = []
        if not grad:

            def load_value(arg: fx.Node) -> Any:
                return self._value_of(run, arg)

            kwargs = fx.node.map_arg(node.kwargs, load_value) if node.kwargs else {}
            return fx.node.map_arg(node.args, load_value), kwargs, leaves
        slicing = self.plans[node.name].target in _SLICING_BACKWARD

        def load(arg: fx.Node) -> Any:
            if arg.name in run.linked:
                value = run.linked[arg.name]  # from a member of the running group: graph attached
                if not slicing:
                    return value
                flat, spec = _flatten(value)
                dense = [
                    _Dense.apply(t) if isinstance(t, torch.Tensor) and t.requires_grad else t for t in flat
                ]
                return _unflatten(dense, spec)
            value = self._value_of(run, arg)
            if arg.op == "get_attr" or (run.attached and arg.op == "placeholder"):
                return value  # (attached: the model's input itself, in the caller's graph)
            flat, spec = _flatten(value)
            if run.attached and any(self.needs_leaf(run, arg, t) for t in flat):
                raise ScheduleRuntimeError(
                    f"node {node.name!r} reads {arg.name!r}, which needs a gradient and is not a "
                    "member of the schedule's one group: it cannot run attached"
                )
            out = []
            for pos, t in enumerate(flat):
                if self.needs_leaf(run, arg, t):
                    box = _GradBox()
                    leaves.append((arg.name, pos, box))
                    out.append(_Leaf.apply(box, _ANCHOR, t))
                else:
                    out.append(t)
            return _unflatten(out, spec)

        args = fx.node.map_arg(node.args, load)
        kwargs = fx.node.map_arg(node.kwargs, load) if node.kwargs else {}
        return args, kwargs, leaves

    def needs_leaf(self, run: _StepRun, arg: fx.Node, t: Any) -> bool:
        """A reader with autograd takes t (a flat part of arg's value) through a `_Leaf`: a
        floating tensor that needs a gradient."""
        return (
            isinstance(t, torch.Tensor)
            and (t.is_floating_point() or t.is_complex())
            and (t.requires_grad or self._wants_grad(run, arg))
        )

    def _wants_grad(self, run: _StepRun, arg: fx.Node) -> bool:
        if arg.op == "placeholder":
            return bool(getattr(run.inputs[arg.name], "requires_grad", False))
        return arg.name in self.has_backward

    # -- steps ---------------------------------------------------------------------
    def compute(
        self,
        run: _StepRun,
        name: str,
        impl_name: str,
        grad: bool,
        recompute: bool,
        reuse: str | None = None,
    ) -> None:
        """reuse: 'relu' / 'add' to run the default in place on the first input, RELU_INPLACE_GRAD
        the ReLU's 'inplace_grad' (`_reuse_at`)."""
        self._compute(run, name, impl_name, grad, recompute, reuse)

    def make_state(self, run: _StepRun, name: str, impl_name: str) -> None:
        """A `make_state` step: the node's backward state made from its held inputs
        (`Implementation.state_from_inputs`), without its forward; no value handle. (Not
        `compute`: a `NodeTimer` times recomputations, and this is none.)"""
        self._compute(run, name, impl_name, True, True, None, state_only=True)

    def state_impl(self, name: str, impl_name: str) -> Implementation:
        """The implementation whose run makes the node's state from its inputs (`make_state`)."""
        key = (name, impl_name)
        if key not in self.state_impls:
            impl = self.plans[name].impls[impl_name]
            self.state_impls[key] = dataclasses.replace(impl, run=impl.state_from_inputs, replays=False)
        return self.state_impls[key]

    def _compute(
        self, run: _StepRun, name: str, impl_name: str, grad, recompute, reuse, state_only=False
    ) -> None:
        """`compute`, or with state_only `make_state`."""
        if impl_name in self.restore_impls:
            self._restore(run, name, consumer_of(impl_name))
            return
        plan = self.plans[name]
        impl = self.state_impl(name, impl_name) if state_only else plan.impls[impl_name]
        rng_ctx = None
        before = None
        saved: set[int] = set()
        # grad mode and the saved-tensor hooks are set through torch._C directly: the context
        # manager objects cost a few microseconds per node, every step (session 15)
        prev_grad = torch.is_grad_enabled()
        torch._C._set_grad_enabled(grad)
        try:
            args, kwargs, leaves = self._args(run, plan.node, grad)
            if plan.random:
                if recompute:
                    if name in run.rng:
                        rng_ctx = _RestoreRng(run.rng[name])
                else:
                    before = _save_rng()
            if not grad or run.reuse is not None:  # (hooks track saved storages while deciding)
                out = self._call(run, plan, impl, name, args, kwargs, recompute, reuse, rng_ctx)
            else:

                def pack(t: torch.Tensor) -> torch.Tensor:
                    saved.add(storage_key(t))
                    # not t itself: a saved output packed as itself holds its own grad_fn, a cycle
                    # that no collector frees when the state is dropped without its backward
                    return t.detach()

                _push_saved_hooks(pack, _unpack)
                try:
                    out = self._call(run, plan, impl, name, args, kwargs, recompute, reuse, rng_ctx)
                finally:
                    _pop_saved_hooks()
        finally:
            torch._C._set_grad_enabled(prev_grad)
        if before is not None and not _same_rng(before, _save_rng()):
            run.rng[name] = before  # the node drew random numbers: replay them when recomputed
        flat, spec = _flatten(out)
        if grad:
            positions = [i for i, t in enumerate(flat) if isinstance(t, torch.Tensor) and t.requires_grad]
            group = self.group_of.get(name)  # (a member's one compute with autograd)
            if group is not None:
                self._join_group(
                    run, group, name, impl_name, out, [(i, flat[i]) for i in positions], leaves, saved
                )
            elif not positions:
                run.without_graph.add(name)
            else:
                box = _GradBox()
                with torch.enable_grad():
                    root = _Root.apply(box, *[flat[i] for i in positions])
                outputs = [(name, i) for i in positions]
                run.put_state(
                    name,
                    _State(
                        root,
                        box,
                        outputs,
                        leaves,
                        {name} if impl.grad_in_place else set(),
                        saved,
                        flat[positions[0]].grad_fn if name in self.restore_sources else None,
                    ),
                )
        if state_only:
            return  # (the stand-in output is no value: nothing reads it, the schedule frees none)
        run.flat_len[name] = len(flat)
        run.put_detached(name, flat, spec)

    def _restore(self, run: _StepRun, name: str, consumer: str) -> None:
        """name's value, unpacked from the copy `consumer`'s backward state keeps."""
        state = run.states.get(consumer)
        source = None if state is None else state.packed_by
        if source is None or not holds_packed_input(source):
            raise ScheduleRuntimeError(
                f"schedule restores {name!r} from {consumer!r}'s backward state, which is not held "
                "or does not keep its input packed (computed with grad and 'zero_packed_input'?)"
            )
        run.flat_len[name] = 1
        run.put_value(name, restored_value(source))

    @staticmethod
    def _call(
        run: _StepRun, plan: _Plan, impl: Implementation, name, args, kwargs, recompute, reuse, rng_ctx
    ):
        if reuse == "relu":
            return torch.relu_(args[0])
        if reuse == RELU_INPLACE_GRAD:
            return relu_inplace_grad_(args[0])
        if reuse == "add":
            return args[0].add_(args[1])
        extra = {"memo": run.memos.setdefault(name, {})} if impl.replays and plan.again else {}
        return _run_node(run, plan, name, impl, args, kwargs, recompute, extra, rng_ctx)

    def _join_group(
        self, run: _StepRun, group: Group, name: str, impl_name: str, out: Any, outs, leaves, saved
    ) -> None:
        """Add a member's forward to its group's state; the last member closes the graph."""
        key = self.group_key[name]
        state = run.states.get(key)
        if state is None:
            state = _State(None, _GradBox(), [], [])
            run.put_state(key, state)
        state.leaves += leaves
        if self.plans[name].impls[impl_name].grad_in_place:  # (a pass-through: add, sub)
            state.in_place.add(name)
        if run.reuse is None:
            new = saved - state.saved
            state.saved |= new
            run.saved_refs.update(new)
        if name in self.guarded:
            for _, t in outs:
                guard_gradient(t)
        if run.attached:  # (the caller's graph: no root; outputs read from `linked`)
            run.linked[name] = out
            return
        if name in group.external:
            state.outputs += [(name, i) for i, _ in outs]
            run.pending += [t for _, t in outs]
        if name != group.members[-1]:
            run.linked[name] = out
            return
        if run.pending:
            with torch.enable_grad():
                state.root = _Root.apply(state.box, *run.pending)
        run.pending = []
        run.linked.clear()

    def _may_reuse(self, run: _StepRun, plan: _Plan, freed: frozenset[str]) -> bool:
        """The node's first input may be overwritten: the schedule frees it right after this
        step, no live backward state saved its storage, no other handle shares it."""
        if plan.reuse is None:
            return False
        node = plan.node
        first = node.args[0] if node.args else None
        if not isinstance(first, fx.Node) or first.name not in freed or first.name not in run.env:
            return False
        x = run.env[first.name]
        y = None
        if plan.reuse == "add":  # (_reuse_kind: exactly two positional arguments)
            other = node.args[1]
            y = self._value_of(run, other) if isinstance(other, fx.Node) else other
        if not reuse_arguments_allow(plan.reuse, x, y):
            return False
        linked = run.linked.get(first.name)
        if isinstance(linked, torch.Tensor) and linked._is_view():
            # in a shared graph, writing into a view (a Linear on a 3-d input returns one of its
            # 2-d product) makes autograd rebuild the base's gradient: CopySlices allocated two
            # copies per add in GPT-NeoX's blocks, 64 KiB over the prediction
            return False
        key = storage_key(x)
        return run.saved_refs[key] == 0 and run.value_refs[key] == 1  # x's own handle only

    def step_in_backward(self, step: Callable[[torch.Tensor, torch.Tensor], None]) -> None:
        """Call `step(param, grad)` as soon as a parameter's gradient is complete and drop the
        gradient: it never reaches `.grad`. A parameter read by one backward call (a node's, or
        a group's shared one) steps inside that call, from a post-accumulate-grad hook, the
        moment the engine has made its gradient (right after its node's backward, as the memory
        model frees it); one read by several calls steps after the last of them."""
        if self.deferred:
            raise ScheduleRuntimeError(
                "this schedule defers weight gradients to the end of the backward; with the optimizer "
                "step inside the backward, solve without deferred weight gradients"
            )
        self.param_step = step
        self._count_param_readers()

    def _count_param_readers(self) -> None:
        """Per parameter, how many backward calls (a group's counts once) make its gradient."""
        calls: dict[int, set[str]] = {}
        for stage in self.schedule.stages:
            for s in stage.steps:
                if s.op == "backward":
                    call = self.group_key.get(s.node, s.node)
                    for p in self.plans[s.node].params:
                        calls.setdefault(id(p), set()).add(call)
        self.param_readers = {k: len(v) for k, v in calls.items()}

    def _param_read(self, run: _StepRun, param: torch.Tensor, g: torch.Tensor | None) -> None:
        """One backward call reading `param` is done (g: the gradient it made, if any); the
        last one steps the parameter with the sum."""
        key = id(param)
        if g is not None:
            prev = run.param_grads.get(key)
            run.param_grads[key] = g if prev is None else prev.add_(g)
        left = run.param_left[key] = run.param_left.get(key, self.param_readers[key]) - 1
        if left == 0:
            total = run.param_grads.pop(key, None)
            if total is not None:
                self.param_step(param, total)

    def weight_gradients(self, run: _StepRun) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(parameter, gradient) of the next deferred node (`run.deferred[0]`), made after the
        last stage; its record let go (`runtime/deferred.py`). A method, so that
        `monet_opt.node_timer` times it as that node's."""
        return make_weight_gradients(run.deferred, self.deferred_targets)

    def backward(self, run: _StepRun, name: str) -> None:
        group = self.group_of.get(name)
        if group is not None:
            key = self.group_key[name]
            if key not in run.states:
                return  # the group's backward already ran, at its first member's step
            for op, node in group.frees:  # the frees of its stage range, before the engine runs
                if op == "free_value":
                    run.pop_value(node)
                else:
                    run.pop_state(node)
            state = run.pop_state(key)
            run.done_to = group.last_backward
            members = group.members
            params = self.group_params[key]
        else:
            state = run.pop_state(name)
            members = (name,)
            params = self.plans[name].params
        if self.deferred_params:  # (made after the last stage: `runtime/deferred.py`)
            params = [p for p in params if id(p) not in self.deferred_params]
        # (a parameter frozen since the wrapper was built gets no gradient, as in plain PyTorch;
        # one unfrozen since is refused by the wrapper)
        trainable = params if all(p.requires_grad for p in params) else [p for p in params if p.requires_grad]
        if self.param_step is None:
            self._engine_call(run, state, members, trainable)
            return
        stepped: set[int] = set()
        try:
            self._engine_call(run, state, members, trainable, stepped)
        finally:
            for param in params:  # (those the call made no gradient for)
                if id(param) not in stepped:
                    self._param_read(run, param, None)

    def _engine_call(
        self,
        run: _StepRun,
        state: _State | None,
        members: tuple[str, ...],
        params: list[torch.Tensor],
        stepped: set[int] | None = None,
    ) -> None:
        """Run the backward of a node's (or a group's) local graph. stepped: given with the
        optimizer step in the backward, gets the parameters read (and maybe stepped) inside."""
        for m in members:  # (fed now: the loss's own buffers are let go)
            run.loss_grads.pop(m, None)
        if state is None:
            grads = [run.grads.pop(m, None) for m in members if m not in run.without_graph]
            if any(g is not None and any(x is not None for x in g) for g in grads):
                raise ScheduleRuntimeError(f"backward of {members[0]!r}: its backward state is not held")
            return
        slots = {m: run.grads.pop(m, None) for m in members}
        fed = [None if slots[m] is None else slots[m][pos] for m, pos in state.outputs]
        del slots
        if state.root is None or all(g is None for g in fed):
            return
        if state.in_place:
            fed = [
                g if g is None or m not in state.in_place or self._owned(run, m, g) else g.clone()
                for (m, _), g in zip(state.outputs, fed)
            ]
        state.box.grads = fed
        del fed
        for source, pos, box in state.leaves:
            box.sink = functools.partial(self.accumulate, run, source, pos)
        seed = state.root.new_empty(0)  # (the root's dtype: complex for a complex first output)
        if stepped is None:
            # autograd.grad, not backward: parameter gradients come back to us and leave through
            # the wrapper's own autograd node, so hooks (DDP's all-reduce) fire in the user's
            # backward. Asking for _ANCHOR's gradient makes every _Leaf of the local graph run.
            # the parameters' own hooks (`p.register_hook`) run once, on the gradient the
            # wrapper hands the engine, as in plain PyTorch: not here too (a doubling hook
            # quadrupled)
            hooked = [(p, p._backward_hooks) for p in params if p._backward_hooks]
            for p, _ in hooked:
                p._backward_hooks = None
            # a gradient laid out unlike its parameter is copied as the engine makes it, where
            # plain PyTorch's AccumulateGrad (and the profile) copies it (`_laid_out_as_param`):
            # a hook on each parameter in a signature's first step, later on those that needed
            # it then (a hook costs ~50 us in the engine: 0.6 ms of a small GPT's backward)
            learning = run.reuse is None
            relaid = [p for p in params if p.dim() > 1 and (learning or id(p) in run.relaid)]
            for p in relaid:
                p.register_hook(functools.partial(_laid_out_as_param, param=p, copied=run.relaid))
            try:
                with autocast_regions.no_autocast(state.root.device.type):
                    got = torch.autograd.grad(state.root, [_ANCHOR, *params], seed, allow_unused=True)
            finally:
                for p in relaid:
                    p._backward_hooks = None
                for p, hooks in hooked:
                    p._backward_hooks = hooks
            for param, g in zip(params, got[1:]):
                if g is None:
                    continue
                if not learning and param.dim() > 1 and id(param) not in run.relaid:
                    # (a layout the first step did not see: copied now, hooked from now on)
                    copy = _laid_out_as_param(g, param, run.relaid)
                    g = g if copy is None else copy
                prev = run.param_grads.get(id(param))
                run.param_grads[id(param)] = g if prev is None else prev.add_(g)
        else:
            # backward with inputs: each parameter's gradient is accumulated into `.grad` when
            # the engine has made it, and the hook takes it from there at once (autograd.grad
            # would hold every gradient until the call returns); `.grad`s the user left are put
            # back afterwards
            left = {id(p): p.grad for p in params if p.grad is not None}
            for p in params:
                p.grad = None

            def take(param: torch.Tensor) -> None:
                g, param.grad = param.grad, None
                stepped.add(id(param))
                self._param_read(run, param, g)

            hooks = [p.register_post_accumulate_grad_hook(take) for p in params]
            try:
                with autocast_regions.no_autocast(state.root.device.type):
                    torch.autograd.backward(state.root, seed, inputs=[_ANCHOR, *params])
            finally:
                for h in hooks:
                    h.remove()
                for p in params:
                    p.grad = left.get(id(p))
                _ANCHOR.grad = None
        for _, _, box in state.leaves:
            box.sink = None

    def accumulate(self, run: _StepRun, source: str, pos: int, g: torch.Tensor) -> None:
        """Add g, a gradient the engine has just made, to `source`'s accumulated gradient.

        Runs inside the engine, which may still hold tensors: the accumulated gradient is
        overwritten only if nothing but its slot refers to its memory (`_add`)."""
        if source in run.inputs:
            prev = run.input_grads.get(source)
            run.input_grads[source] = g if prev is None else self._add(run, prev, g)
            return
        slots = run.grads.get(source)
        if slots is None:
            slots = [None] * run.flat_len[source]
            run.grads[source] = slots
        slots[pos] = g if slots[pos] is None else self._add(run, slots[pos], g)

    @staticmethod
    def _holders(run: _StepRun, t: torch.Tensor) -> int:
        """How many gradient slots of this step hold t's storage."""
        key = storage_key(t)
        held = [*(g for slots in run.grads.values() for g in slots), *run.input_grads.values()]
        held += list(run.param_grads.values())
        return sum(1 for g in held if g is not None and storage_key(g) == key)

    def _owned(self, run: _StepRun, name: str, g: torch.Tensor) -> bool:
        """g (name's gradient, already taken out of its slot) may be overwritten: no other slot
        holds its storage, it is dense, and it is not a model output's or a view of one (the
        loss made those, and the user may hold them: `out.retain_grad()`; a view or identity
        node hands its input the output's gradient)."""
        if any(src == name for src, _ in run.output_map) or storage_key(g) in run.output_grad_keys:
            return False
        if not gradient_spans_storage(g):
            return False
        return self._holders(run, g) == 0

    def _add(self, run: _StepRun, prev: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        """prev + g, in place unless prev's memory is shared: with another slot (autograd may
        hand the same gradient tensor to several leaves), with g, or with anything else holding a
        reference (the engine's buffers, while a gradient fed to the running graph is still on its
        way). Use counts alone decide: a fed gradient that only its slot holds any more is added
        to in place, as with one graph per node and as the memory model has it."""
        key = storage_key(prev)
        shared = storage_key(g) == key or not only_reference(prev) or self._holders(run, prev) > 1
        return prev + g if shared else prev.add_(g)

    # -- whole step ----------------------------------------------------------------
    def run_forward(self, inputs: tuple, attached: bool = False) -> tuple[_StepRun, list[torch.Tensor], Any]:
        """attached (an `attachable` schedule, called with grad enabled): the forward builds
        the caller's graph, connected to the inputs and parameters, and returns the outputs
        in it; the step is then done (nothing held: the returned run is empty), the backward
        is the engine's own."""
        if len(inputs) != len(self.placeholders):
            raise ScheduleRuntimeError(f"the model takes {len(self.placeholders)} inputs, got {len(inputs)}")
        if attached and not self.attachable:
            raise ScheduleRuntimeError("this schedule recomputes or runs nodes alone: it cannot run attached")
        signature = _signature(inputs)
        run = _StepRun(
            inputs={p.name: x for p, x in zip(self.placeholders, inputs)},
            reuse=self.reuse_decisions.get(signature),
            signature=signature,
            relaid=self.relaid.get(signature, set()),
            attached=attached,
        )
        if run.reuse is not None:
            run.flat_len = dict(self.flat_lens[signature])
        self._records = run.deferred
        self._run_stage(run, 0, recompute=False)
        if attached:
            linked = run.linked
            outputs = fx.node.map_arg(
                self.output_node.args[0],
                lambda n: linked[n.name] if n.name in linked else self._value_of(run, n),
            )
            if run.reuse is None:  # (every decision is the forward's: nothing is recomputed)
                self.reuse_decisions[signature] = run.decided
                self.flat_lens[signature] = dict(run.flat_len)
            run.clear()
            flat, spec = tree_flatten(outputs)
            return run, flat, spec
        outputs = fx.node.map_arg(self.output_node.args[0], lambda n: self._value_of(run, n))
        flat, spec = tree_flatten(outputs)
        node_leaves, _ = tree_flatten(self.output_node.args[0])
        for leaf in node_leaves:
            if isinstance(leaf, fx.Node):
                n = len(tree_flatten(self._value_of(run, leaf))[0])
                run.output_map.extend((leaf.name, pos) for pos in range(n))
            else:
                run.output_map.append(("", 0))
        return run, flat, spec

    def run_backward(self, run: _StepRun, output_grads: list[torch.Tensor | None]) -> dict[str, torch.Tensor]:
        """output_grads: the gradients of the model's outputs, taken over (the list is emptied):
        each is held until its node's backward is fed, then goes as the memory model says."""
        run.output_grad_keys = {storage_key(g) for g in output_grads if g is not None}
        for (src, pos), g in zip(run.output_map, output_grads):
            if g is None or src not in self.plans:
                continue
            slots = run.grads.setdefault(src, [None] * run.flat_len[src])
            slots[pos] = g if slots[pos] is None else slots[pos] + g
            run.loss_grads.setdefault(src, []).append(g)
        output_grads.clear()
        g = slots = None  # (no handle of an output's gradient left here through the backward)
        for si in range(1, len(self.schedule.stages)):
            self._run_stage(run, si, recompute=True)
        if run.deferred:  # (in the schedule's order: the memory model's end of the step)
            run.deferred.sort(key=lambda r: self.deferred_rank[r.node])
        while run.deferred:
            made = self.weight_gradients(run)
            while made:
                param, g = made.pop(0)
                copy = _laid_out_as_param(g, param, run.relaid)
                g = g if copy is None else copy
                prev = run.param_grads.get(id(param))
                run.param_grads[id(param)] = g if prev is None else prev.add_(g)
                del g, copy
        input_grads = run.input_grads
        input_grads.update({("param", k): v for k, v in run.param_grads.items()})
        if run.reuse is None:  # a whole step decided: replay its decisions from now on
            self.reuse_decisions[run.signature] = run.decided
            self.relaid[run.signature] = run.relaid
            self.flat_lens[run.signature] = dict(run.flat_len)
        run.clear()
        return input_grads

    def _segment(self, run: _StepRun, si: int, k: int) -> Segment | None:
        """The generated function for the group whose first member stage si's step k computes
        (`runtime/segments.py`), built on the first replayed step of this input signature."""
        key = (run.signature, si, k, run.attached)
        if key not in self.segments:
            segment = None
            if _SEGMENTS:
                try:
                    segment = build_segment(self, run, si, k, self.group_starts[(si, k)], run.attached)
                except Exception as err:  # (fx could not generate it: the interpreter runs the span)
                    warnings.warn(
                        f"monet-opt: the forward of the group starting at {self.group_starts[(si, k)].members[0]!r} "
                        f"is interpreted step by step (no generated function: {err})",
                        stacklevel=2,
                    )
            self.segments[key] = segment
        return self.segments[key]

    def _run_segment(self, run: _StepRun, segment: Segment, group: Group) -> None:
        values = [
            run.env.pop(arg.name) if taken else self._value_of(run, arg) for arg, taken in segment.inputs
        ]
        leaves: list[tuple[str, int, _GradBox]] = []
        prev_grad = torch.is_grad_enabled()
        torch._C._set_grad_enabled(True)
        try:
            out = segment.module(values, leaves, run)
        finally:
            torch._C._set_grad_enabled(prev_grad)
        n_held = len(segment.held)
        for name, value in zip(segment.held, out[:n_held]):
            run.put_detached(name, *_flatten(value))
        if run.attached:  # (the caller's graph: the outputs as they are, no root)
            run.linked.update(zip(segment.external, out[n_held:]))
            return
        key = self.group_key[group.members[0]]
        state = _State(None, _GradBox(), [], leaves, set(self.group_in_place[key]))
        pending = []
        for name, value in zip(segment.external, out[n_held:]):
            flat, _ = _flatten(value)
            for i, t in enumerate(flat):
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    state.outputs.append((name, i))
                    pending.append(t)
        del out, values
        if pending:
            with torch.enable_grad():
                state.root = _Root.apply(state.box, *pending)
        run.put_state(key, state)

    def _reuse_at(self, run: _StepRun, si: int, k: int, name: str, impl_name: str) -> str | None:
        """Whether stage si's step k runs its default in place: replayed, or decided now."""
        if run.reuse is not None:
            return run.reuse.get((si, k))
        plan = self.plans[name]
        kind = plan.reuse if impl_name == "default" else None
        if impl_name == "inplace_grad" and plan.reuse == "relu":
            kind = RELU_INPLACE_GRAD  # (that ReLU's own form, in place: its backward is the same)
        if kind is not None and self._may_reuse(run, plan, self.freed_after[si][k]):
            run.decided[(si, k)] = kind
            return kind
        return None

    def _run_stage(self, run: _StepRun, si: int, recompute: bool) -> None:
        stage = self.schedule.stages[si]
        steps = stage.steps
        starts = self.stage_group_starts[si] if run.reuse is not None else ()
        done_stage, done_step = run.done_to
        # (a group's backward done: the steps of its range are skipped, most of the backward
        # stages of a schedule without recomputation)
        k = -1 if done_stage < si else done_step if done_stage == si else len(steps)
        while k + 1 < len(steps):
            k += 1
            step = steps[k]
            if starts and k in starts:
                segment = self._segment(run, si, k)
                if segment is not None:
                    self._run_segment(run, segment, self.group_starts[(si, k)])
                    k = segment.end - 1
                    continue
            if step.op == "compute":
                reuse = self._reuse_at(run, si, k, step.node, step.impl)
                self.compute(run, step.node, step.impl, step.grad, recompute, reuse)
            elif step.op == "make_state":
                self.make_state(run, step.node, step.impl)
            elif step.op == "backward":
                self.backward(run, step.node)
            elif step.op == "free_value":
                run.pop_value(step.node)
            elif step.op == "free_state":
                run.pop_state(step.node)
            else:
                raise ScheduleRuntimeError(f"stage {stage.name!r}: unknown step op {step.op!r}")
        if self.after_stage is not None:
            self.after_stage(si)


_push_saved_hooks = torch._C._autograd._push_saved_tensors_default_hooks
_pop_saved_hooks = torch._C._autograd._pop_saved_tensors_default_hooks


def _unpack(t: torch.Tensor) -> torch.Tensor:
    return t


def _laid_out_as_param(g: torch.Tensor | None, param: torch.Tensor, copied: set[int]) -> torch.Tensor | None:
    """A hook on `param` while the executor's backward call makes its gradient: a copy of g laid
    out as `param`, as the engine's AccumulateGrad makes one for `.grad` (torch's layout
    contract), where g's strides differ on a dimension of more than one element (a contiguous
    convolution fed a channels_last input makes a channels_last weight gradient); None (g as it
    is) otherwise. The engine then frees g at once, as plain PyTorch does at that node's
    backward and as the profile measured it. Copied when the call returned, a group's
    gradients were held in both layouts (resnet18 b4 32x32, contiguous weights, channels_last
    input: 3.0 MB over the prediction); handed over at the end of the backward, each was copied
    there (3.6 MB over). A copy adds id(param) to `copied`."""
    if g is None or g.layout != torch.strided or param.layout != torch.strided:
        return None  # (None: the engine reached the parameter without a gradient)
    # (torch's own test, as AccumulateGrad's; 15-30 us in Python: contiguous params skip it)
    if not (param.is_contiguous() or is_non_overlapping_and_dense_or_false(param)):
        if g.is_contiguous():
            return None
        copied.add(id(param))
        return g.contiguous()
    if all(a == b if n != 1 else a != 0 for a, b, n in zip(g.stride(), param.stride(), g.shape)):
        return None  # (torch's obeys_layout_contract)
    copied.add(id(param))
    return torch.empty_strided(param.shape, param.stride(), dtype=g.dtype, device=g.device).copy_(g)


def _signature(inputs: tuple) -> tuple:
    """What the in-place decisions of a step depend on besides the schedule: the inputs'
    shapes, dtypes, devices and whether they need gradients, and the autocast state."""
    parts: list = [
        (tuple(x.shape), x.dtype, x.device, x.requires_grad) if isinstance(x, torch.Tensor) else type(x)
        for x in inputs
    ]
    for device in ("cpu", "cuda"):
        if torch.is_autocast_enabled(device):
            parts.append((device, torch.get_autocast_dtype(device)))
    return tuple(parts)


def _group_key(group: Group) -> str:
    return "#" + group.members[0]  # (fx node names never start with '#')


def _run_node(
    run: _StepRun, plan: _Plan, name: str, impl: Implementation, args, kwargs, recompute, extra, rng_ctx
):
    """`impl.run` with what a recomputation replays of the node's first run: its RNG state
    (`rng_ctx`, given when recomputing) and the buffers its module started from (`plan.state`:
    `monet_opt.module_state`). The interpreter and the generated segments both call it."""
    if plan.state:
        if not recompute:
            run.buffer_states[name] = module_state.snapshot(plan.target, plan.state)
        elif name in run.buffer_states:
            with module_state.replayed(plan.target, run.buffer_states[name]):
                return _run_impl(impl, plan.target, args, kwargs, recompute, extra, rng_ctx)
    return _run_impl(impl, plan.target, args, kwargs, recompute, extra, rng_ctx)


def _run_impl(impl: Implementation, target, args, kwargs, recompute: bool, extra: dict, rng_ctx) -> Any:
    if rng_ctx is None:
        return impl.run(target, args, kwargs, recompute, **extra)
    with rng_ctx:
        return impl.run(target, args, kwargs, recompute, **extra)


def _save_rng() -> tuple:
    cuda = (
        torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    )
    return torch.get_rng_state(), cuda


def _same_rng(a: tuple, b: tuple) -> bool:
    if not torch.equal(a[0], b[0]):
        return False
    if a[1] is None or b[1] is None:
        return a[1] is None and b[1] is None
    return all(torch.equal(x, y) for x, y in zip(a[1], b[1]))


class _RestoreRng:
    """Replays the RNG state a random node saw in the forward, then restores the current one."""

    def __init__(self, saved: tuple) -> None:
        self.saved = saved

    def __enter__(self) -> None:
        self.prev = _save_rng()
        cpu, cuda = self.saved
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)

    def __exit__(self, *exc) -> None:
        cpu, cuda = self.prev
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)
