"""A recomputing schedule run inside the caller's one backward call (the engine's own).

The executor's backward (`ScheduleExecutor.run_backward`) runs each node's, or each group's,
local graph with a nested `autograd.grad` call of its own: on ResNet-50 b8 224 on CPU that
costs ~170 us per node in the backward and 50-100 us in the forward, ~3 % of the step,
against plain PyTorch's one engine call (`benchmarks/results/session73`), while a Python
pre-hook on every node's backward costs nothing measurable there
(`benchmarks/results/session74/hooks_floor.py`). So here:

* the forward builds one graph, attached to the model's inputs and parameters, as plain
  PyTorch does. A node whose backward state the schedule keeps from the forward (`compute ...
  grad=True` in the forward) runs in it as plain PyTorch runs it: its state is what the graph
  saves, freed by the engine after its backward. A node whose state the schedule makes in a
  backward stage (`compute ... grad=True` there, or `make_state`) runs without autograd and
  enters the graph through a `_Proxy` node holding nothing; its state is then made, when the
  schedule says, as the executor makes it (a local graph on `_Leaf` inputs, `_Root` output),
  and the proxy's backward runs that local graph (the only nested engine calls left);
* a pre-hook on each node's backward (its output's `grad_fn`, or its proxy) runs, just
  before the engine runs that backward, the schedule's steps up to the node's `backward` step:
  recomputations of values (without autograd), states made, frees. The engine's order is the
  reverse of the forward's, the order of the schedule's backward stages (an error names the
  node where they differ); what is left runs when the engine's call ends (`queue_callback`);
* gradients are the engine's: summed, handed on and accumulated into `.grad` as plain PyTorch
  does (DistributedDataParallel's hooks fire as usual).

`why_not` says which schedules can run so; the executor runs the others.

An experiment, off unless MONET_OPT_ONE_CALL=1. Gradients are plain PyTorch's on every model of
`tests/test_runtime.py` (the whole file passed with it on, peaks within 5 % of the prediction
there), but on ResNet-50 b8 224 it was no faster than the executor
(`benchmarks/results/session74`: at 1/3 of plain's peak +12.1 % against the executor's +11.8 %,
at 0.63 +3.8 % against +1.9 %: its forward 18 ms slower, no in-place ReLU / add and no generated
forward; its backward only 6 ms faster, the executor's groups already share graphs), and at 1/3
it measured 236.3 MiB against a 235 MiB budget (232.6 predicted; stages of layer2-3 3-20 MiB
over the model). What is left before it can be the default: the in-place steps, the generated
forward, the source of the excess (the engine's buffers of the residual additions' gradients?),
and proxies cheaper than a nested `autograd.grad` (call a one-node local graph's `grad_fn`).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import weakref
from typing import Any

import torch
import torch.fx as fx
from torch.autograd.function import BackwardCFunction
from torch.utils._pytree import tree_flatten, tree_unflatten

from monet_opt.ops import passes_gradient
from monet_opt.runtime import executor as executor_module
from monet_opt.runtime.executor import (
    _ANCHOR,
    _SLICING_BACKWARD,
    ScheduleExecutor,
    ScheduleRuntimeError,
    _Dense,
    _fetch_attr,
    _GradBox,
    _laid_out_as_param,
    _Leaf,
    _RestoreRng,
    _Root,
    _run_node,
    _same_rng,
    _save_rng,
    _StepRun,
)
from monet_opt.runtime.segments import guard_gradient
from monet_opt.storage import gradient_spans_storage, only_reference

# takes a deferred node's proxy into the graph where nothing else does (`_OneCallRun._proxy`)
_PROXY_ANCHOR = torch.empty(0, requires_grad=True)

# off unless MONET_OPT_ONE_CALL=1: measured no faster than the executor on ResNet-50 b8 224
# (module docstring), and over its prediction there
_ON = os.environ.get("MONET_OPT_ONE_CALL", "0") == "1"


def why_not(executor: ScheduleExecutor) -> str | None:
    """Why the executor's schedule cannot run in one backward call; None if it can."""
    if not _ON:
        return "off (MONET_OPT_ONE_CALL=1 turns it on)"
    if not executor_module._ATTACHED:
        return "MONET_OPT_ATTACHED=0 (nothing runs in the caller's graph)"
    if executor.restore_impls:
        return "values restored from packed states"
    if executor.param_step is not None:
        return "optimizer step in the backward"
    kept = set()  # nodes whose state the forward keeps
    for si, stage in enumerate(executor.schedule.stages):
        for step in stage.steps:
            made = step.op == "make_state" or (step.op == "compute" and step.grad)
            if not made:
                continue
            if si == 0:
                kept.add(step.node)
            elif step.node in kept:
                return f"{step.node!r} keeps its state from the forward and makes it again"
    return None


def _writers(executor: ScheduleExecutor) -> set[str]:
    """Nodes whose backward writes into the gradient it is fed, where, in the caller's graph,
    the engine may hand that gradient to another node too (`ScheduleExecutor._own_gradients`):
    they run through a proxy, which copies a fed gradient anything else holds."""
    own, _ = executor._own_gradients()
    out = set()
    for stage in executor.schedule.stages:
        for step in stage.steps:
            if step.op != "compute" or not step.grad:
                continue
            plan = executor.plans[step.node]
            if (
                plan.impls[step.impl].grad_in_place
                and step.node not in own
                and not passes_gradient(plan.node.op, plan.target)
            ):
                out.add(step.node)
    return out


class OneCall:
    """Runs `executor`'s schedule with the caller's backward call (see the module's docstring)."""

    def __init__(self, executor: ScheduleExecutor) -> None:
        self.ex = executor
        stages = executor.schedule.stages
        self.forward_steps = stages[0].steps
        # the backward stages' steps, one list; where each node's backward step is in it
        self.steps = [step for stage in stages[1:] for step in stage.steps]
        self.backward_at = {step.node: k for k, step in enumerate(self.steps) if step.op == "backward"}
        # nodes whose state a backward stage makes: run through a proxy in the forward
        self.proxied = {
            step.node
            for step in self.steps
            if step.op == "make_state" or (step.op == "compute" and step.grad)
        }
        # and those whose weight gradient is deferred (`runtime/deferred.py`), or that write into
        # a gradient they may share (`_writers`), their state kept from the forward: their local
        # graph made there (in the caller's graph, the engine would make the weight gradient with
        # the input's, or hand the writer a gradient another node reads)
        self.writers = _writers(executor)
        self.forward_local = (set(executor.deferred) | self.writers) - self.proxied
        self.proxied |= self.forward_local
        self.deferred_params = [p for name in executor.deferred for p in executor.plans[name].params]

    def usable(self) -> bool:
        """Whether this step can run so: with weight gradients deferred, not under
        torch.distributed (DistributedDataParallel waits for each parameter's gradient from the
        engine) and no hook on a deferred parameter (the engine would not run it)."""
        if not self.deferred_params:
            return True
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            return False
        return not any(p._backward_hooks or p._post_accumulate_grad_hooks for p in self.deferred_params)

    def run_forward(self, inputs: tuple) -> tuple[list, Any]:
        ex = self.ex
        if len(inputs) != len(ex.placeholders):
            raise ScheduleRuntimeError(f"the model takes {len(ex.placeholders)} inputs, got {len(inputs)}")
        step_run = _OneCallRun(self, inputs)
        step_run.forward()
        outputs = fx.node.map_arg(ex.output_node.args[0], step_run.value_of)
        return tree_flatten(outputs)


@dataclasses.dataclass
class _Local:
    """A proxied node's state, made in a backward stage: its local graph."""

    root: torch.Tensor
    box: _GradBox
    positions: list[int]  # flat output positions fed to the root
    leaves: list[tuple[str, int, _GradBox]]  # (source, flat position, box) of its _Leaf inputs


class _ProxyBox:
    def __init__(self, run: _OneCallRun, name: str, keys: list, n_params: int, outs: list) -> None:
        self.run = run
        self.name = name
        self.keys = keys  # (source, position) of each graph input
        self.n_params = n_params
        self.outs = outs  # the flat outputs (detached), handed over by forward
        self.positions: list[int] = []
        self.grads: list | None = None  # the outputs' gradients, between the two backwards
        self.anchored = False  # `_PROXY_ANCHOR` is its last input


class _ProxyIn(torch.autograd.Function):
    """A proxied node's inputs' side: its backward runs the node's local graph, made by the
    schedule in a backward stage, on the gradients `_Proxy`'s backward left in the box."""

    @staticmethod
    def forward(ctx, box: _ProxyBox, *inputs: torch.Tensor) -> torch.Tensor:
        ctx.box = box
        return box.outs[0].new_empty(0)

    @staticmethod
    def backward(ctx, _token):
        return (None, *ctx.box.run.proxy_backward(ctx.box))


class _Proxy(torch.autograd.Function):
    """A node computed without autograd, in the graph: its outputs (each floating one, given
    through the box). Its backward only leaves their gradients in the box, so that the engine
    lets go of them when it returns: `_ProxyIn`'s backward, next, feeds them to the local graph,
    which frees each as its first node has used it, as the node's own backward would (holding
    them to the end of a local graph of several nodes cost GPT's attention 0.4 MB)."""

    @staticmethod
    def forward(ctx, box: _ProxyBox, token: torch.Tensor):
        ctx.box = box
        ctx.set_materialize_grads(False)
        outs = box.outs
        box.outs = None
        return tuple(t.detach() for t in outs)

    @staticmethod
    def backward(ctx, *grads):
        ctx.box.grads = list(grads)
        return None, torch.empty(0, device=next((g.device for g in grads if g is not None), None))


class _OneCallRun:
    """One training step: the forward's values, the proxied nodes' local graphs, the cursor of
    the backward steps."""

    def __init__(self, plan: OneCall, inputs: tuple) -> None:
        self.plan = plan
        self.ex = plan.ex
        # (the executor's helpers read run.inputs / rng / memos / buffer_states; reuse={}: its
        # storage tracking off)
        self.run = _StepRun(inputs={p.name: x for p, x in zip(self.ex.placeholders, inputs)}, reuse={})
        self.env = self.run.env
        self.local: dict[str, _Local] = {}
        self.graph_inputs: dict[str, set] = {}  # per proxied node: (source, position) taking a gradient
        self.cursor = 0
        self.last: str | None = None  # the node whose backward the engine ran last
        self.queued = False
        self.finished = False

    # -- values --------------------------------------------------------------------
    def value_of(self, node: fx.Node) -> Any:
        if node.op == "placeholder":
            return self.run.inputs[node.name]
        if node.op == "get_attr":
            return _fetch_attr(self.ex.gm, node.target)
        try:
            return self.env[node.name]
        except KeyError:
            raise ScheduleRuntimeError(
                f"node {node.name!r} is needed but its value is not held (the schedule freed it)"
            ) from None

    def _args(self, node: fx.Node, load):
        args = fx.node.map_arg(node.args, load)
        kwargs = fx.node.map_arg(node.kwargs, load) if node.kwargs else {}
        return args, kwargs

    # -- forward -------------------------------------------------------------------
    def forward(self) -> None:
        self.ex._records = self.run.deferred  # (where deferred nodes record their backward's)
        for step in self.plan.forward_steps:
            if step.op == "compute":
                self._forward_compute(step.node, step.impl, step.grad)
            elif step.op == "free_value":
                self.env.pop(step.node, None)
            else:
                raise ScheduleRuntimeError(f"forward stage: step {step.op!r} cannot run in one backward call")

    def _forward_compute(self, name: str, impl_name: str, grad: bool) -> None:
        ex = self.ex
        plan = ex.plans[name]
        impl = plan.impls[impl_name]
        node = plan.node
        proxied = name in self.plan.proxied
        if name in self.plan.forward_local:
            self._forward_local(name, impl_name, node)
            return
        native = grad and not proxied
        slicing = native and plan.target in _SLICING_BACKWARD

        def load(arg: fx.Node) -> Any:
            value = self.value_of(arg)
            if slicing:
                return _map_tensors(value, lambda t: _Dense.apply(t) if t.requires_grad else t)
            return value

        args, kwargs = self._args(node, load)
        before = _save_rng() if plan.random else None
        extra = {"memo": self.run.memos.setdefault(name, {})} if impl.replays and plan.again else {}
        prev = torch.is_grad_enabled()
        torch._C._set_grad_enabled(native)
        try:
            out = _run_node(self.run, plan, name, impl, args, kwargs, False, extra, None)
        finally:
            torch._C._set_grad_enabled(prev)
        if before is not None and not _same_rng(before, _save_rng()):
            self.run.rng[name] = before
        if proxied:
            out = self._proxy(name, node, out)
        if native or proxied:
            self._hook(name, out)
        self.env[name] = out

    def _forward_local(self, name: str, impl_name: str, node: fx.Node) -> None:
        """A deferred node's forward, its state kept: its local graph made now, on the forward's
        values, and its outputs taken into the caller's graph through a proxy."""
        self.graph_inputs[name] = set(self._graph_inputs(name, node)[0])
        self._make_local(name, impl_name, state_only=False, recompute=False)
        out = self._proxy(name, node, self.env[name])
        self._hook(name, out)
        self.env[name] = out

    def _hook(self, name: str, out: Any) -> None:
        """The pre-hook on the node's backward (each grad_fn of its outputs)."""
        hooked = set()
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.grad_fn is not None and id(t.grad_fn) not in hooked:
                hooked.add(id(t.grad_fn))
                t.grad_fn.register_prehook(self._prehook(name))
                if isinstance(t.grad_fn, BackwardCFunction):
                    # a custom Function's ctx lives as long as the graph, here the whole
                    # model's: what it keeps as attributes (not saved tensors, which the
                    # engine frees) is let go of after its backward, as its own graph would be
                    t.grad_fn.register_hook(functools.partial(_clear_ctx, weakref.ref(t.grad_fn)))
                if name in self.ex.guarded:
                    guard_gradient(t)

    def _graph_inputs(self, name: str, node: fx.Node) -> tuple[list, list]:
        """(source, flat position) and tensor of each of the node's inputs that takes a gradient."""
        keys, tensors = [], []
        for arg in node.all_input_nodes:
            if arg.op == "get_attr":
                continue
            for pos, t in enumerate(tree_flatten(self.value_of(arg))[0]):
                if isinstance(t, torch.Tensor) and t.requires_grad and (arg.name, pos) not in keys:
                    keys.append((arg.name, pos))
                    tensors.append(t)
        return keys, tensors

    def _params(self, name: str) -> list[torch.Tensor]:
        """The node's parameters whose gradient its backward makes (not those deferred)."""
        deferred = self.ex.deferred_params
        return [p for p in self.ex.plans[name].params if p.requires_grad and id(p) not in deferred]

    def _proxy(self, name: str, node: fx.Node, out: Any) -> Any:
        """out (computed without autograd) with each floating output in the graph, through a
        `_Proxy` whose inputs are the node's inputs that take a gradient and its parameters."""
        keys, tensors = self._graph_inputs(name, node)
        params = self._params(name)
        flat, spec = tree_flatten(out)
        positions = [
            i
            for i, t in enumerate(flat)
            if isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex())
        ]
        deferred = name in self.ex.deferred
        if not positions or not (tensors or params or deferred):
            return out
        self.graph_inputs[name] = set(keys)
        box = _ProxyBox(self, name, keys, len(params), [flat[i] for i in positions])
        box.positions = positions
        # (a deferred node's backward runs, to record its output's gradient, though nothing
        # else of it takes one: the anchor takes it into the graph)
        anchor = [_PROXY_ANCHOR] if not (tensors or params) else []
        box.anchored = bool(anchor)
        outs = _Proxy.apply(box, _ProxyIn.apply(box, *tensors, *params, *anchor))
        for i, t in zip(positions, outs):
            flat[i] = t
        return tree_unflatten(flat, spec)

    # -- backward ------------------------------------------------------------------
    def _prehook(self, name: str):
        def hook(grad_outputs):
            if self.last != name:
                self._advance(name)
            return None

        return hook

    def _advance(self, name: str) -> None:
        """Run the schedule's steps up to `name`'s backward step (the engine is about to run it).
        Where the engine runs a backward later than the schedule's order has it (a node whose
        gradient the engine finishes after a later stage's), its steps ran already; a proxied
        node's local graph is held until its backward (or the step's end) all the same."""
        if self.finished:
            raise ScheduleRuntimeError(
                "monet-opt: a wrapped forward's backward runs once (the schedule frees what it used "
                "as it goes): retain_graph=True and a second backward through the same forward are "
                "not supported; run the forward again"
            )
        if torch.is_grad_enabled():
            raise ScheduleRuntimeError(
                "monet-opt: higher-order gradients (create_graph=True) through a wrapped model are "
                "not supported: its backward is not differentiable; use the plain model for them"
            )
        if not self.queued:
            self.queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finish)
        target = self.plan.backward_at.get(name)
        if target is not None and target >= self.cursor:
            self._run_steps(target)
            self.cursor = target + 1
        self.last = name

    def _finish(self) -> None:
        if self.finished:
            return
        self.finished = True
        self._run_steps(len(self.plan.steps))
        self.env.clear()
        self.local.clear()
        self._deferred_weight_gradients()
        self.run.clear()

    def _deferred_weight_gradients(self) -> None:
        """The deferred nodes' weight gradients, node by node in the schedule's order, each
        accumulated into `.grad` as the engine's AccumulateGrad would (laid out as its
        parameter), after the last stage: the memory model's end of the step."""
        ex, run = self.ex, self.run
        run.deferred.sort(key=lambda r: ex.deferred_rank[r.node])
        with torch.no_grad():
            while run.deferred:
                made = ex.weight_gradients(run)
                while made:
                    param, g = made.pop(0)
                    copy = _laid_out_as_param(g, param, set())
                    g = g if copy is None else copy
                    if param.grad is None:
                        param.grad = g
                    else:
                        param.grad.add_(g)
                    del g, copy

    def _run_steps(self, end: int) -> None:
        steps = self.plan.steps
        for k in range(self.cursor, end):
            step = steps[k]
            if step.op == "compute":
                if step.grad:
                    self._make_local(step.node, step.impl, state_only=False)
                else:
                    self._recompute(step.node, step.impl)
            elif step.op == "make_state":
                self._make_local(step.node, step.impl, state_only=True)
            elif step.op == "backward":
                pass  # (the engine's; a proxied node's backward lets go of its local graph)
            elif step.op == "free_value":
                self.env.pop(step.node, None)
            elif step.op == "free_state":
                self.local.pop(step.node, None)
            else:
                raise ScheduleRuntimeError(f"unknown step op {step.op!r}")
        self.cursor = max(self.cursor, end)

    def _recompute(self, name: str, impl_name: str) -> None:
        plan = self.ex.plans[name]
        impl = plan.impls[impl_name]
        args, kwargs = self._args(plan.node, self.value_of)
        rng = _RestoreRng(self.run.rng[name]) if name in self.run.rng else None
        extra = {"memo": self.run.memos.setdefault(name, {})} if impl.replays and plan.again else {}
        with torch.no_grad():
            self.env[name] = _run_node(self.run, plan, name, impl, args, kwargs, True, extra, rng)

    def _make_local(self, name: str, impl_name: str, state_only: bool, recompute: bool = True) -> None:
        """The node's state as the executor makes it in a backward stage: run (or, state_only,
        its `state_from_inputs`) on `_Leaf` inputs, a `_Root` for its outputs."""
        plan = self.ex.plans[name]
        impl = self.ex.state_impl(name, impl_name) if state_only else plan.impls[impl_name]
        wanted = self.graph_inputs.get(name, set())
        leaves: list[tuple[str, int, _GradBox]] = []

        def load(arg: fx.Node) -> Any:
            value = self.value_of(arg)
            if arg.op == "get_attr":
                return value
            flat, spec = tree_flatten(value)
            out = []
            for pos, t in enumerate(flat):
                if isinstance(t, torch.Tensor) and (arg.name, pos) in wanted:
                    box = _GradBox()
                    leaves.append((arg.name, pos, box))
                    out.append(_Leaf.apply(box, _ANCHOR, t))
                elif isinstance(t, torch.Tensor):
                    out.append(t.detach())
                else:
                    out.append(t)
            return tree_unflatten(out, spec)

        rng = _RestoreRng(self.run.rng[name]) if name in self.run.rng else None
        extra = {"memo": self.run.memos.setdefault(name, {})} if impl.replays and plan.again else {}
        with torch.enable_grad():
            args, kwargs = self._args(plan.node, load)
            out = _run_node(self.run, plan, name, impl, args, kwargs, recompute, extra, rng)
            flat, spec = tree_flatten(out)
            positions = [i for i, t in enumerate(flat) if isinstance(t, torch.Tensor) and t.requires_grad]
            box = _GradBox()
            root = _Root.apply(box, *[flat[i] for i in positions]) if positions else None
        if root is not None:
            self.local[name] = _Local(root, box, positions, leaves)
        if not state_only:
            self.env[name] = tree_unflatten(
                [t.detach() if isinstance(t, torch.Tensor) else t for t in flat], spec
            )

    def proxy_backward(self, pbox: _ProxyBox) -> list:
        """The gradients of a proxied node's graph inputs and parameters, from its local graph,
        fed the outputs' gradients `_Proxy` left in the box (taken out of it)."""
        name = pbox.name
        grads, pbox.grads = pbox.grads or [], None
        local = self.local.pop(name, None)
        n_inputs = len(pbox.keys) + pbox.n_params + pbox.anchored
        if local is None:
            if all(g is None for g in grads):
                return [None] * n_inputs
            raise ScheduleRuntimeError(f"backward of {name!r}: its backward state is not held")
        by_position = dict(zip(pbox.positions, grads))
        fed = [by_position.get(i) for i in local.positions]
        del by_position, grads
        if name in self.plan.writers:  # (a copy of a gradient anything else holds)
            fed = [g if g is None or _owned(g) else g.clone() for g in fed]
        local.box.grads = fed
        del fed
        got: dict[tuple[str, int], torch.Tensor] = {}

        def sink(key, g):
            prev = got.get(key)
            got[key] = g if prev is None else prev + g

        for source, pos, box in local.leaves:
            box.sink = lambda g, key=(source, pos): sink(key, g)
        params = self._params(name)
        root = local.root
        del local
        # the parameters' own hooks run once, on the gradient the engine accumulates: not in
        # this call too (a doubling hook quadrupled)
        hooked = [(p, p._backward_hooks) for p in params if p._backward_hooks]
        for p, _ in hooked:
            p._backward_hooks = None
        try:
            made = torch.autograd.grad(root, [_ANCHOR, *params], root.new_empty(0), allow_unused=True)
        finally:
            for p, hooks in hooked:
                p._backward_hooks = hooks
        return [got.get(key) for key in pbox.keys] + list(made[1:]) + [None] * pbox.anchored


def _owned(g: torch.Tensor) -> bool:
    """Nothing but the caller holds g's memory (no engine buffer, no user's `retain_grad`), and g
    spans it: a backward may write into it."""
    return gradient_spans_storage(g) and only_reference(g)


def _clear_ctx(ref: weakref.ref, _grad_inputs, _grad_outputs) -> None:
    ctx = ref()
    if ctx is not None:
        vars(ctx).clear()


def _map_tensors(value: Any, fn) -> Any:
    flat, spec = tree_flatten(value)
    return tree_unflatten([fn(t) if isinstance(t, torch.Tensor) else t for t in flat], spec)
