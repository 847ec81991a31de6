"""Trace a model into an operator graph with measured per-node facts.

`trace(model, example_inputs)` symbolically traces the model with torch.fx (a
custom tracer: `torch.nn` modules stay single ``call_module`` nodes, functional
calls become ``call_function`` / ``call_method`` nodes), then runs the traced
graph once on the example inputs through an `fx.Interpreter` to measure, per
node, what the memory model needs: output shapes and dtypes, the bytes of the
storage the output owns (0 for a view), which input a view aliases, the
gradient bytes, and the bytes its backward keeps in plain PyTorch (measured with
``torch.autograd.graph.saved_tensors_hooks``, deduplicated by storage,
parameters and buffers excluded).

Modules fx cannot trace (data-dependent control flow, fast paths such as
``nn.MultiheadAttention``'s) become single leaf nodes: when tracing fails
inside a submodule, that submodule is made a leaf and tracing is retried. If the
failure is in the root module's own ``forward``, `TraceError` names the module
and the source line and suggests a fix.

The measuring run leaves the model as it found it: buffers (batch-norm running
statistics) are restored and the RNG state is forked.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import operator
import os
import traceback
import warnings
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import networkx as nx
import torch
import torch.fx as fx
from torch import nn
from torch.fx.node import _get_qualified_name

from monet_opt import (
    assigned_state,
    autocast_regions,
    autograd_functions,
    module_state,
    no_grad,
    random_sources,
    root_hooks,
)
from monet_opt.concrete_trace import (
    ConcreteTracerMixin,
    DataDependentSize,
    is_compiled,
    may_size_by_data,
    sized_by_data,
)
from monet_opt.functionalize import functionalize
from monet_opt.keyword_inputs import as_traceable, user_model
from monet_opt.no_grad import NO_GRAD, detach_no_grad_values, made_without_grad
from monet_opt.ops.common import mutable

__all__ = [
    "trace",
    "check_graph",
    "graph_difference",
    "OpGraph",
    "OpNode",
    "SavedStorage",
    "TraceError",
    "KNOWN_LEAF_TYPES",
]


class TraceError(RuntimeError):
    """The model cannot be traced; the message names the module (and node) and a fix.

    module_path: dotted path of the module whose code failed ('' for the root).
    node: name of the fx node involved, when the failure happened in a graph run.
    """

    def __init__(self, message: str, module_path: str | None = None, node: str | None = None) -> None:
        super().__init__(message)
        self.module_path = module_path
        self.node = node


# Modules fx cannot trace through (fast paths, data-dependent checks) or that are
# best kept whole. Instances (including user subclasses) are always leaves.
KNOWN_LEAF_TYPES: tuple[type[nn.Module], ...] = (
    nn.MultiheadAttention,
    nn.RNNBase,
    torch.jit.ScriptModule,  # (traced through, it became a call on its C++ object: parameters unseen)
)

# torch.nn modules (fx keeps every one whole) traced through in training mode: torch's
# transformer stacks. As one node, a whole nn.TransformerEncoder left the solver nothing to
# recompute. In eval mode their forward may take a fused fast path chosen by data-dependent
# checks, so they stay whole there (the wrapper runs eval steps plainly anyway).
TRACED_IN_TRAINING: tuple[type[nn.Module], ...] = (
    nn.Transformer,
    nn.TransformerEncoder,
    nn.TransformerDecoder,
    nn.TransformerEncoderLayer,
    nn.TransformerDecoderLayer,
)


@dataclass(frozen=True)
class SavedStorage:
    """One storage a node's backward keeps (plain PyTorch, measured).

    kind: 'input' (the storage of inputs[position]), 'output' (the node's own
        output storage), 'private' (allocated by the node, not part of its
        output: batch-norm statistics, pooling indices, a dropout mask, ...),
        'model_input' (a model input), or 'other' (an earlier node's storage that
        is not a direct input; `owner` names it).
    position: the input position for kind 'input', else None.
    nbytes: storage bytes.
    storage_id: id of the storage, unique within the trace (to deduplicate
        storages saved by several nodes).
    owner: name of the OpNode whose output owns the storage (None for model
        inputs; this node for 'private').
    """

    kind: str
    position: int | None
    nbytes: int
    storage_id: int
    owner: str | None = None


@dataclass
class OpNode:
    name: str
    kind: str
    op: str
    target: str
    inputs: list[str]
    uses_model_input: bool = False
    shapes: list[tuple[int, ...]] = field(default_factory=list)
    dtypes: list[str] = field(default_factory=list)
    is_tensor: bool = False
    output_bytes: int = 0
    alias_of: int | None = None
    grad_bytes: int = 0
    requires_grad: bool = False
    param_bytes: int = 0
    param_names: list[str] = field(default_factory=list)
    param_grad_bytes: int = 0
    saved_bytes: int = 0
    saved_storages: list[SavedStorage] = field(default_factory=list)
    is_output: bool = False
    mutated_inputs: list[int] = field(default_factory=list)
    output_storage_ids: list[int] = field(default_factory=list)
    aliases_model_input: bool = False
    state_bytes: int = 0  # buffers a leaf module changes as it runs (`monet_opt.module_state`)

    @property
    def requires_backward(self) -> bool:
        """Gradient flows through this node (its output requires grad)."""
        return self.is_tensor and self.requires_grad

    @property
    def saved_private_bytes(self) -> int:
        return sum(s.nbytes for s in self.saved_storages if s.kind == "private")

    @property
    def keeps_inputs(self) -> tuple[int, ...]:
        return tuple(sorted({s.position for s in self.saved_storages if s.kind == "input"}))

    @property
    def keeps_output(self) -> bool:
        return any(s.kind == "output" for s in self.saved_storages)


@dataclass
class OpGraph:
    gm: fx.GraphModule
    nodes: list[OpNode]
    graph: nx.DiGraph
    fingerprint: str
    input_shapes: list[tuple[int, ...]]
    output_names: list[str]
    input_dtypes: list[str] = field(default_factory=list)
    leaf_paths: list[str] = field(default_factory=list)
    model_input_bytes: int = 0
    # nodes whose output's size the input's values decide (nonzero, a boolean mask): the memory
    # of what follows them is the example batch's
    data_sized: list[str] = field(default_factory=list)
    # the fingerprint without the constants the nodes hold (`_fingerprint`)
    structure: str = ""

    def __post_init__(self) -> None:
        self._index = {n.name: i for i, n in enumerate(self.nodes)}

    def node(self, name: str) -> OpNode:
        try:
            return self.nodes[self._index[name]]
        except KeyError:
            raise KeyError(f"no OpNode named {name!r}") from None

    def index(self, name: str) -> int:
        return self._index[name]

    def __len__(self) -> int:
        return len(self.nodes)

    def __iter__(self) -> Iterator[OpNode]:
        return iter(self.nodes)

    @property
    def total_saved_bytes(self) -> int:
        """Bytes of the union of saved storages (each storage counted once)."""
        seen: dict[int, int] = {}
        for n in self.nodes:
            for s in n.saved_storages:
                seen.setdefault(s.storage_id, s.nbytes)
        return sum(seen.values())

    def summary(self) -> str:
        kinds: dict[str, int] = {}
        for n in self.nodes:
            kinds[n.kind] = kinds.get(n.kind, 0) + 1
        top = ", ".join(f"{k}={v}" for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])[:8])
        return (
            f"OpGraph({len(self.nodes)} nodes, inputs {self.input_shapes}, "
            f"saved {self.total_saved_bytes / 2**20:.1f} MiB; {top})"
        )

    def __repr__(self) -> str:
        return self.summary()


# --------------------------------------------------------------------------- tracing


class _Tracer(fx.Tracer):
    """torch.nn modules stay leaves; listed paths and known-bad types too."""

    def __init__(self, leaf_paths: set[str], leaf_types: tuple[type, ...]) -> None:
        super().__init__()
        self.leaf_paths = leaf_paths
        self.leaf_types = leaf_types
        self._path_stack: list[str] = []
        self.fail_path: str | None = None
        self.hooked: list[str] = []  # submodules kept whole because they have hooks
        self.user_hooks: set[int] = set()  # the hook handles modules had before tracing began

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        if module_qualified_name in self.leaf_paths:
            return True
        if isinstance(m, TRACED_IN_TRAINING) and m.training and not isinstance(m, self.leaf_types):
            return False
        if isinstance(m, self.leaf_types) or super().is_leaf_module(m, module_qualified_name):
            return True
        if is_compiled(m):  # (a submodule the user compiled: runs compiled, as one node)
            return True
        if module_qualified_name and hook_ids(m) & self.user_hooks:
            # traced through, its hooks would run once, on fx's proxies, and never in training
            # (a forward hook collecting features would hold a Proxy): as a leaf the runtime
            # calls the module itself, hooks and all. Not hooks the model's own forward registers
            # as it runs (Hugging Face's output_hidden_states): those are traced with it
            if module_qualified_name not in self.hooked:
                self.hooked.append(module_qualified_name)
            return True
        return False

    def create_node(self, kind, target, args, kwargs, name=None, type_expr=None) -> fx.Node:
        node = super().create_node(kind, target, args, kwargs, name, type_expr)
        if kind in ("call_function", "call_method", "call_module"):
            if made_without_grad(self):
                # (the model's code runs it under torch.no_grad(): monet_opt.no_grad)
                node.meta[NO_GRAD] = True
            # (inside the model's own autocast blocks: monet_opt.autocast_regions)
            spec = autocast_regions.spec_now(getattr(self, "autocast_devices", []))
            if spec:
                node.meta[autocast_regions.AUTOCAST] = spec
        return node

    def call_module(self, m: nn.Module, forward: Any, args: tuple, kwargs: dict) -> Any:
        try:
            path = self.path_of_module(m)
        except NameError:
            # a module made inside a forward (BERT's `CrossEntropyLoss()`): no path to call it by,
            # so its own code is traced inline (its functional calls become the nodes)
            return forward(*args, **kwargs)
        self._path_stack.append(path)
        try:
            return super().call_module(m, forward, args, kwargs)
        except Exception:
            if self.fail_path is None:
                self.fail_path = path
            raise
        finally:
            self._path_stack.pop()


# packages whose hooks are part of the model's own forward, traced with it: Hugging Face installs
# output-capturing hooks on a model's layers on its first call with output_hidden_states=True,
# and its forward reads what they capture (kept as leaves, the hidden states came out wrong)
MODEL_HOOK_PACKAGES = ("transformers",)


def hook_ids(m: nn.Module) -> set[int]:
    """The handle ids of `m`'s own forward, forward-pre and backward hooks, but for hooks from
    `MODEL_HOOK_PACKAGES`."""
    hooks = {**m._forward_hooks, **m._forward_pre_hooks, **m._backward_hooks, **m._backward_pre_hooks}
    return {k for k, h in hooks.items() if _package_of(h) not in MODEL_HOOK_PACKAGES}


def _package_of(fn: Any) -> str:
    fn = getattr(fn, "func", fn)  # (functools.partial)
    module = getattr(fn, "__module__", None) or type(fn).__module__
    return str(module).split(".")[0]


def _leaf_root(model: nn.Module, n_inputs: int) -> fx.GraphModule:
    """A root that must stay whole (a torch.nn module) becomes one call_module node."""
    holder = nn.Module()
    holder.add_module("inner", model)
    graph = fx.Graph()
    args = tuple(graph.placeholder(f"x{i}") for i in range(n_inputs))
    graph.output(graph.call_module("inner", args))
    return fx.GraphModule(holder, graph, type(model).__name__)


_TORCH_DIR = os.path.dirname(torch.__file__)
_OWN_FILES = (os.path.join("monet_opt", "graph.py"), os.path.join("monet_opt", "concrete_trace.py"))


def _user_frame(exc: BaseException) -> str:
    """'file:line: code' of the innermost frame outside torch, if any."""
    best = None
    for fs in traceback.extract_tb(exc.__traceback__):
        if not fs.filename.startswith(_TORCH_DIR) and not fs.filename.endswith(_OWN_FILES):
            best = fs
    if best is None:
        return ""
    return f" at {best.filename}:{best.lineno}: {(best.line or '').strip()}"


def _concrete_args(model: nn.Module, n_inputs: int) -> dict[str, Any] | None:
    """Bind forward parameters beyond the example inputs to their defaults.

    Without this fx makes them placeholders, and `if mask is not None:` would
    take the wrong branch silently.
    """
    try:
        sig = inspect.signature(model.forward)
    except (TypeError, ValueError):
        return None
    params = [
        p
        for p in sig.parameters.values()
        if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    ]
    if any(p.kind == inspect.Parameter.VAR_POSITIONAL for p in sig.parameters.values()):
        return None
    extra = params[n_inputs:]
    if any(p.default is inspect.Parameter.empty for p in extra):
        raise TraceError(
            f"{type(model).__name__}.forward needs {len(params)} positional inputs "
            f"({', '.join(p.name for p in params)}), got {n_inputs} example inputs"
        )
    concrete = {p.name: p.default for p in extra}
    for p in sig.parameters.values():
        if p.kind == inspect.Parameter.KEYWORD_ONLY:
            if p.default is inspect.Parameter.empty:
                raise TraceError(f"{type(model).__name__}.forward has a required keyword {p.name!r}")
            concrete[p.name] = p.default
    return concrete or None


def _symbolic_trace(
    model: nn.Module,
    inputs: tuple,
    leaf_paths: set[str],
    leaf_types: tuple[type, ...],
    leaf_fallback: bool,
) -> tuple[fx.GraphModule, list[str]]:
    """Trace with leaf fallback. Returns the GraphModule and the auto-leafed paths.

    Plain fx first; if any module's code cannot be traced that way, again with proxies that
    carry the example inputs' values (`monet_opt.concrete_trace`: shape-dependent Python code,
    as in Hugging Face and timm models, then runs), and only what still fails becomes a leaf."""
    try:
        return _trace_with_leaves(model, inputs, leaf_paths, leaf_types, False, concrete=False)
    except TraceError:
        pass
    saved = module_state.saved_buffers(model)  # the concrete trace runs the model (BatchNorm statistics)
    try:
        with torch.random.fork_rng(devices=_rng_devices(inputs)):
            return _trace_with_leaves(model, inputs, leaf_paths, leaf_types, leaf_fallback, concrete=True)
    finally:
        module_state.restore_buffers(model, saved)


class _ConcreteTracer(ConcreteTracerMixin, _Tracer):
    """`_Tracer` whose proxies carry values (`monet_opt.concrete_trace`)."""

    def __init__(self, leaf_paths: set[str], leaf_types: tuple[type, ...], inputs: tuple) -> None:
        super().__init__(leaf_paths, leaf_types)
        self.example_inputs = inputs


def _rng_devices(inputs: tuple) -> list[int]:
    device = next((t.device for t in inputs if isinstance(t, torch.Tensor)), torch.device("cpu"))
    if device.type != "cuda":
        return []
    return [device.index if device.index is not None else torch.cuda.current_device()]


def _trace_with_leaves(
    model: nn.Module,
    inputs: tuple,
    leaf_paths: set[str],
    leaf_types: tuple[type, ...],
    leaf_fallback: bool,
    concrete: bool,
) -> tuple[fx.GraphModule, list[str]]:
    n_inputs = len(inputs)
    auto: list[str] = []
    concrete_args = _concrete_args(model, n_inputs)
    n_modules = sum(1 for _ in model.modules())
    for _ in range(n_modules + 1):
        if concrete:
            tracer: _Tracer = _ConcreteTracer(leaf_paths | set(auto), leaf_types, inputs)
        else:
            tracer = _Tracer(leaf_paths | set(auto), leaf_types)
        # fx keeps tensor constants (a mask made from shapes) as attributes of the root: the
        # GraphModule takes its own copies, and the user's model is left as it was (so the next
        # trace names them the same)
        own_attrs = set(vars(model))
        tracer.user_hooks = set().union(*(hook_ids(m) for m in model.modules()))
        state = assigned_state.snapshot(model)
        try:
            # (nodes made with gradients off are the model's no_grad code; its autocast blocks
            # are followed; its custom autograd Functions stay whole; random draws from shapes
            # alone are nodes)
            with (
                torch.enable_grad(),
                no_grad.track(tracer),
                autocast_regions.track(tracer),
                autograd_functions.track(tracer),
                random_sources.track(tracer),
            ):
                graph = tracer.trace(model, concrete_args=concrete_args)
            gm = fx.GraphModule(tracer.root, graph, type(model).__name__)
        except TraceError:
            _drop_attrs(model, own_attrs)
            _assigning_leaves(assigned_state.undo_proxies(state), model, auto, leaf_paths, leaf_fallback)
            raise
        except Exception as exc:
            _drop_attrs(model, own_attrs)
            if _assigning_leaves(assigned_state.undo_proxies(state), model, auto, leaf_paths, leaf_fallback):
                continue
            path = tracer.fail_path
            where = f"module {path!r} ({type(model.get_submodule(path)).__name__})" if path else None
            if path and leaf_fallback and path not in auto and path not in leaf_paths:
                warnings.warn(
                    f"monet_opt.trace: {where} cannot be traced by torch.fx "
                    f"({type(exc).__name__}: {_first_line(exc)}); it becomes one leaf node",
                    stacklevel=5,
                )
                auto.append(path)
                continue
            what = where or f"the root module ({type(model).__name__}.forward)"
            raise TraceError(
                f"torch.fx cannot trace {what}{_user_frame(exc)}: {type(exc).__name__}: "
                f"{_first_line(exc)}. {_fix_hint(exc, path)}",
                module_path=path or "",
            ) from exc
        _drop_attrs(model, own_attrs)
        if _assigning_leaves(assigned_state.undo_proxies(state), model, auto, leaf_paths, leaf_fallback):
            continue
        if tracer.hooked:
            warnings.warn(
                f"monet_opt.trace: {len(tracer.hooked)} submodules with hooks are kept as one node "
                f"each, so that their hooks run in training ({', '.join(tracer.hooked[:6])}); they "
                "also run while monet-opt traces and profiles the model, and again where a schedule "
                "recomputes the module",
                stacklevel=5,
            )
        _drop_default_guards(gm.graph, n_inputs)
        gm.recompile()
        return gm, auto
    raise TraceError("tracing did not converge while marking untraceable submodules as leaves")


def _assigning_leaves(
    assigned: dict[str, list[str]],
    model: nn.Module,
    auto: list[str],
    leaf_paths: set[str],
    leaf_fallback: bool,
) -> bool:
    """Modules whose forward assigned attributes from what it computed (`assigned_state`) become
    leaves (added to `auto`, with a warning): True if any did. TraceError where one cannot (the
    root, or with leaf_fallback off)."""
    if not assigned:
        return False
    for path, names in assigned.items():
        owner = f"{path!r} ({type(model.get_submodule(path)).__name__})" if path else "its"
        if not path or not leaf_fallback or path in leaf_paths or path in auto:
            raise TraceError(
                f"torch.fx cannot trace an assignment to {', '.join(names)} in {owner} forward "
                "(fx records operations, not attribute assignments: the traced graph would never "
                "make it). Move that code into a submodule of its own, which then runs eagerly as "
                "one node (monet_opt.trace: leaf_modules=[...])",
                module_path=path,
            )
        warnings.warn(
            f"monet_opt.trace: module {owner} assigns {', '.join(names)} in its forward from what "
            "it computes; fx cannot record that: it becomes one leaf node, which runs eagerly",
            stacklevel=6,
        )
        auto.append(path)
    return True


def _drop_attrs(model: nn.Module, keep: set[str]) -> None:
    for k in [k for k in vars(model) if k not in keep]:
        delattr(model, k)


def _drop_default_guards(graph: fx.Graph, n_inputs: int) -> None:
    """Forward arguments bound to their defaults (`_concrete_args`) are no inputs: fx guards a
    None with an `_assert_is_none` node, and any other value with a placeholder (the default)
    checked by `_assert(eq(placeholder, value))`. Drop the guards, and put the value itself
    where the placeholder was used (a timm ViT's `is_causal=False`)."""
    for n in list(graph.nodes):
        if n.op == "call_function" and getattr(n.target, "__name__", "") == "_assert_is_none":
            graph.erase_node(n)
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    for ph in placeholders[n_inputs:]:
        if ph.name.startswith("*"):
            continue
        default = ph.args[0] if ph.args else None
        for user in list(ph.users):
            guards = list(user.users)
            if (
                user.op == "call_function"
                and user.target is operator.eq
                and guards
                and all(g.op == "call_function" and g.target is torch._assert and not g.users for g in guards)
            ):
                for g in guards:
                    graph.erase_node(g)
                graph.erase_node(user)

        def bound(a: fx.Node, ph: fx.Node = ph, default: Any = default) -> Any:
            return default if a is ph else a

        for user in list(ph.users):
            user.args = fx.node.map_arg(user.args, bound)
            user.kwargs = fx.node.map_arg(user.kwargs, bound)
        graph.erase_node(ph)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else repr(exc)


def _fix_hint(exc: BaseException, path: str | None) -> str:
    msg = str(exc)
    hint = ""
    if "register_hook" in _user_frame(exc):
        # (fx cannot record the hook function as a graph argument: 'argument of type: function')
        return (
            "A gradient hook registered inside the forward (`t.register_hook(fn)`) cannot be "
            "traced. Fix: write the gradient change as a torch.autograd.Function (as a "
            "gradient-reversal layer is written), or move that code into its own submodule "
            "(a submodule fx cannot trace runs eagerly, as one node)."
        )
    if path is None and ("co_varnames" in msg or "argument of type" in msg):
        # a forward taking **kwargs, or returning a cache object (Hugging Face models)
        return (
            "The root forward takes **kwargs or returns objects that are not tensors (a Hugging Face "
            "model returns a ModelOutput with a cache). Fix: give the example inputs by keyword, "
            "`{'input_ids': ids, 'labels': ids, 'use_cache': False}` (the model is then trained on "
            "the loss it returns), or wrap the model in a module whose forward takes the input "
            "tensors and returns tensors, e.g. `return self.model(input_ids=ids, use_cache=False).logits` "
            "(or the loss)."
        )
    if isinstance(exc, DataDependentSize):
        pass  # (its message says what)
    elif "cannot be used as inputs to control flow" in msg:
        hint = (
            "This is data-dependent Python control flow (an `if`/`while` on a tensor value), "
            "which a static graph cannot capture. "
        )
    elif "cannot be iterated" in msg or "len(" in msg or "'len'" in msg:
        hint = (
            "Iterating over, unpacking (*args) or taking len() of a traced tensor is not "
            "supported by torch.fx. "
        )
    elif ".item()" in msg or "tolist" in msg or "not supported" in msg:
        hint = "Reading tensor values into Python (.item(), .tolist(), int()) is not supported. "
    where = f"module {path!r}" if path else "the root forward"
    return (
        hint + f"Fix: move the offending code of {where} into its own submodule (a submodule fx "
        "cannot trace runs eagerly, as one node), or express the condition with tensor ops "
        "(torch.where)."
    )


# --------------------------------------------------------------------------- measuring run


def _flatten(obj: Any) -> list[Any]:
    out: list[Any] = []

    def rec(o: Any) -> None:
        if isinstance(o, (list, tuple)):
            for x in o:
                rec(x)
        elif isinstance(o, dict):
            for x in o.values():
                rec(x)
        elif isinstance(o, slice):
            rec(o.start)
            rec(o.stop)
            rec(o.step)
        else:
            out.append(o)

    rec(obj)
    return out


def _tensors(obj: Any) -> list[torch.Tensor]:
    return [t for t in _flatten(obj) if isinstance(t, torch.Tensor)]


def _skey(t: torch.Tensor) -> tuple[str, int] | None:
    try:
        st = t.untyped_storage()
    except Exception:  # sparse / nested / meta tensors
        return None
    if st.nbytes() == 0 or st.data_ptr() == 0:
        return None
    return (str(t.device), st.data_ptr())


def _snbytes(t: torch.Tensor) -> int:
    try:
        return int(t.untyped_storage().nbytes())
    except Exception:
        return 0


def _set_tensor_meta(n: fx.Node, result: Any) -> None:
    """Fill node.meta['tensor_meta'] / ['type'] the way ShapeProp does (best effort)."""
    try:
        from torch.fx.node import map_aggregate
        from torch.fx.passes.shape_prop import _extract_tensor_metadata
    except ImportError:  # pragma: no cover - private helpers moved
        return
    found = False

    def extract(obj: Any) -> Any:
        nonlocal found
        if isinstance(obj, torch.Tensor):
            found = True
            return _extract_tensor_metadata(obj)
        return obj

    try:
        meta = map_aggregate(result, extract)
    except Exception:  # pragma: no cover
        return
    if found:
        n.meta["tensor_meta"] = meta
    n.meta["type"] = type(result)


class _GraphRun(fx.Interpreter):
    """Runs the traced graph as the runtime's default implementations do: plain lists for a
    function's list arguments, each node under its autocast block's state."""

    current_node: fx.Node | None = None  # (the node running: named when it fails)

    def call_function(self, target: Any, args: tuple, kwargs: dict) -> Any:
        return super().call_function(target, mutable(args), kwargs)

    def run_node(self, n: fx.Node) -> Any:
        self.current_node = n
        with autocast_regions.under(n.meta.get(autocast_regions.AUTOCAST)):
            return super().run_node(n)


class _Measure(_GraphRun):
    """Runs the graph once, recording per-node facts (values are all kept alive,
    so storage addresses are never reused during the run)."""

    def __init__(self, gm: fx.GraphModule, op_names: set[str]) -> None:
        super().__init__(gm, garbage_collect_values=False)
        self.op_names = op_names
        self.excluded: set[tuple[str, int]] = set()
        for t in list(gm.parameters()) + list(gm.buffers()):
            k = _skey(t)
            if k is not None:
                self.excluded.add(k)
        self.storage_ids: dict[tuple[str, int], int] = {}
        self.storage_owner: dict[tuple[str, int], str | None] = {}
        self.model_input_keys: set[tuple[str, int]] = set()
        self.keep: list[Any] = []
        self.facts: dict[str, dict[str, Any]] = {}
        # stale reads (`monet_opt.functionalize`): where each node stands, the storages of its
        # value, and, per storage, the latest node that mutated it in place
        self.order = {n: i for i, n in enumerate(gm.graph.nodes)}
        self.value_keys: dict[fx.Node, set[tuple[str, int]]] = {}
        self.mutated_by: dict[tuple[str, int], fx.Node] = {}
        self.data_sized: list[str] = []  # nodes whose output's size their input's values decide

    def _sid(self, key: tuple[str, int]) -> int:
        if key not in self.storage_ids:
            self.storage_ids[key] = len(self.storage_ids)
        return self.storage_ids[key]

    def placeholder(self, target: Any, args: tuple, kwargs: dict) -> Any:
        value = super().placeholder(target, args, kwargs)
        for t in _tensors(value):
            k = _skey(t)
            if k is not None and k not in self.excluded:
                self.model_input_keys.add(k)
                self._sid(k)
                self.storage_owner.setdefault(k, None)
        return value

    def get_attr(self, target: Any, args: tuple, kwargs: dict) -> Any:
        value = super().get_attr(target, args, kwargs)
        for t in _tensors(value):  # constants held by the module: exist before the step
            k = _skey(t)
            if k is not None:
                self.excluded.add(k)
        return value

    def _check_no_stale_read(self, n: fx.Node, input_nodes: list[fx.Node]) -> None:
        """`n` must not read a value made before an in-place change of its storage by another
        node: the runtime runs that change out of place, so `n` would read the old value."""
        for a in input_nodes:
            for k in self.value_keys.get(a, ()):
                m = self.mutated_by.get(k)
                if m is not None and m is not a and self.order[a] < self.order[m]:
                    raise TraceError(
                        f"node {n.name!r} reads {a.name!r} after node {m.name!r} ({m.op} "
                        f"{_target_str(m)}) changed its storage in place (through another view "
                        "of it). monet-opt runs operations out of place and cannot follow that "
                        "change: write the update out of place (y = x.op(...)) and use y, or make "
                        "the module doing it a leaf (monet_opt.trace: leaf_modules=[...]).",
                        node=n.name,
                    )

    def run_node(self, n: fx.Node) -> Any:
        if n.op not in ("call_module", "call_function", "call_method"):
            result = super().run_node(n)
            _set_tensor_meta(n, result)
            self.value_keys[n] = {k for k in map(_skey, _tensors(result)) if k is not None}
            return result
        input_nodes = [a for a in _flatten((n.args, n.kwargs)) if isinstance(a, fx.Node)]
        self._check_no_stale_read(n, input_nodes)
        # every input's tensor versions before the call (in-place detection)
        versions = {a: [t._version for t in _tensors(self.env[a])] for a in input_nodes}
        op_inputs = [a for a in input_nodes if a.name in self.op_names]
        # storages of each OpNode input position
        in_keys = [{k for k in map(_skey, _tensors(self.env[a])) if k is not None} for a in op_inputs]

        saved: list[torch.Tensor] = []

        def pack(t: torch.Tensor) -> torch.Tensor:
            # detached: the graph holds this hook, and a saved output would hold its own
            # grad_fn (a cycle no collector frees: the wrapper kept 9.4 MB of narrow_resnet's)
            t = t.detach()
            saved.append(t)
            return t

        module = self.module.get_submodule(n.target) if n.op == "call_module" else None
        buffers_before = module_state.buffer_values(module) if module is not None else {}
        if may_size_by_data(n.op, n.target) and sized_by_data(
            n.op, n.target, *self.fetch_args_kwargs_from_env(n)
        ):
            self.data_sized.append(n.name)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            result = super().run_node(n)
        # a leaf that changes its own buffers (spectral norm): recomputed from its starting state
        state_bytes = module_state.record(n, module, buffers_before) if module is not None else 0
        self.keep.append(result)
        self.keep.extend(saved)
        _set_tensor_meta(n, result)

        out_ts = _tensors(result)
        all_in_keys = set().union(*in_keys) if in_keys else set()
        # output storages: owned (new) vs shared with inputs / model inputs / params
        owned: dict[tuple[str, int], int] = {}
        alias_positions: list[int | None] = []
        aliases_model_input = False
        for t in out_ts:
            k = _skey(t)
            if k is None:
                continue
            pos = next((i for i, ks in enumerate(in_keys) if k in ks), None)
            if pos is not None:
                alias_positions.append(pos)
            elif k in self.model_input_keys or k in self.excluded:
                aliases_model_input = aliases_model_input or k in self.model_input_keys
                alias_positions.append(None)
            elif k in self.storage_owner and self.storage_owner[k] is not None:
                # an earlier node's storage that is not a direct input (rare)
                alias_positions.append(None)
            else:
                owned[k] = _snbytes(t)
                alias_positions.append(None)
        for k in owned:
            self._sid(k)
            self.storage_owner.setdefault(k, n.name)
        alias_of = None
        if not owned and alias_positions and all(p is not None for p in alias_positions):
            # a view (or in-place result) of input storage; with several aliased
            # inputs (rare: a tuple of views) the first one is named
            alias_of = alias_positions[0]

        # saved tensors, deduplicated by storage
        saved_storages: list[SavedStorage] = []
        seen: set[tuple[str, int]] = set()
        for t in saved:
            if not isinstance(t, torch.Tensor):
                continue
            k = _skey(t)
            if k is None or k in seen or k in self.excluded:
                continue
            seen.add(k)
            nb = _snbytes(t)
            sid = self._sid(k)
            if k in owned:
                kind, pos, owner = "output", None, n.name
            elif k in all_in_keys:
                pos = next(i for i, ks in enumerate(in_keys) if k in ks)
                kind, owner = "input", self.storage_owner.get(k)
            elif k in self.model_input_keys:
                kind, pos, owner = "model_input", None, None
            elif self.storage_owner.get(k) is not None:
                kind, pos, owner = "other", None, self.storage_owner[k]
            else:
                kind, pos, owner = "private", None, n.name
                self.storage_owner.setdefault(k, n.name)
            saved_storages.append(SavedStorage(kind, pos, nb, sid, owner))

        changed = {
            a: [t for t, v in zip(_tensors(self.env[a]), before) if t._version != v]
            for a, before in versions.items()
        }
        mutated = [i for i, a in enumerate(op_inputs) if changed[a]]
        self.value_keys[n] = {k for k in map(_skey, out_ts) if k is not None}
        for tensors in changed.values():
            for k in {k for k in map(_skey, tensors) if k is not None}:
                if k in self.excluded:
                    raise TraceError(
                        f"node {n.name!r} ({n.op} {_target_str(n)}) changes a parameter or buffer in "
                        "place; monet-opt runs traced operations out of place, so that change would "
                        "be lost. Make the module doing it a leaf (monet_opt.trace: "
                        "leaf_modules=[...]): a leaf runs as the model wrote it.",
                        node=n.name,
                    )
                self.mutated_by[k] = n

        self.facts[n.name] = {
            "inputs": [a.name for a in op_inputs],
            "uses_model_input": any(a.op == "placeholder" for a in input_nodes),
            "shapes": [tuple(int(s) for s in t.shape) for t in out_ts],
            "dtypes": [str(t.dtype) for t in out_ts],
            "is_tensor": bool(out_ts),
            "output_bytes": int(sum(owned.values())),
            "alias_of": alias_of,
            "aliases_model_input": aliases_model_input,
            "grad_bytes": int(sum(t.numel() * t.element_size() for t in out_ts if t.requires_grad)),
            "requires_grad": any(t.requires_grad for t in out_ts),
            "saved_bytes": int(sum(s.nbytes for s in saved_storages)),
            "saved_storages": saved_storages,
            "mutated_inputs": mutated,
            "output_storage_ids": [self.storage_ids[k] for k in owned],
            "state_bytes": state_bytes,
        }
        return result


# --------------------------------------------------------------------------- public API


def _as_tuple(example_inputs: Any) -> tuple:
    if isinstance(example_inputs, torch.Tensor):
        return (example_inputs,)
    if isinstance(example_inputs, (list, tuple)) and all(isinstance(t, torch.Tensor) for t in example_inputs):
        return tuple(example_inputs)
    raise TypeError(
        f"example_inputs must be a tensor or a tuple of tensors, not {type(example_inputs).__name__}"
    )


def _kind(n: fx.Node, gm: fx.GraphModule) -> str:
    if n.op == "call_module":
        return type(gm.get_submodule(n.target)).__name__.lower()
    if n.op == "call_method":
        return str(n.target).lower()
    name = getattr(n.target, "__name__", None) or str(n.target)
    return name.lower()


def _target_str(n: fx.Node) -> str:
    if n.op == "call_function":
        try:
            return _get_qualified_name(n.target)
        except Exception:
            return getattr(n.target, "__qualname__", str(n.target))
    return str(n.target)


def _params_of(n: fx.Node, gm: fx.GraphModule) -> list[tuple[str, torch.Tensor]]:
    out: list[tuple[str, torch.Tensor]] = []
    if n.op == "call_module":
        mod = gm.get_submodule(n.target)
        for pname, p in mod.named_parameters():
            out.append((f"{n.target}.{pname}" if n.target else pname, p))
    for a in _flatten((n.args, n.kwargs)):
        if isinstance(a, fx.Node) and a.op == "get_attr":
            try:
                v = gm.get_parameter(a.target)
            except AttributeError:
                continue
            out.append((str(a.target), v))
    seen: set[int] = set()
    uniq = []
    for name, p in out:
        if id(p) not in seen:
            seen.add(id(p))
            uniq.append((name, p))
    return uniq


def _jsonable(x: Any) -> Any:
    if isinstance(x, (str, int, float, bool)) or x is None:
        return x
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in sorted(x.items(), key=lambda kv: str(kv[0]))}
    if isinstance(x, fx.Node):
        return f"%{x.name}"
    if isinstance(x, (torch.dtype, torch.device, torch.memory_format, torch.layout)):
        return str(x)
    if isinstance(x, slice):
        return ["slice", _jsonable(x.start), _jsonable(x.stop), _jsonable(x.step)]
    if isinstance(x, torch.Size):
        return list(x)
    if isinstance(x, torch.Tensor):
        return ["tensor", list(x.shape), str(x.dtype)]
    return type(x).__name__


def _module_config(mod: nn.Module) -> Any:
    """Hyper-parameters that change what a leaf computes (extra_repr is stable)."""
    try:
        return f"{type(mod).__name__}({mod.extra_repr()})"
    except Exception:
        return type(mod).__name__


def _fingerprint(
    gm: fx.GraphModule, nodes: list[OpNode], inputs: tuple, training: bool, constants: bool = True
) -> str:
    """A hash of the graph: its nodes, their arguments, the sizes and dtypes of their outputs,
    the model's inputs, which parameters are frozen. Without `constants`, a node's arguments are
    the nodes it reads only, a called module's configuration and the frozen parameters are left
    out, but the sizes of the tensors the graph fetches are in: the graph's structure, on which a
    schedule's memory and time do not depend on the constants (a temperature, a dropout rate)."""
    items: list[Any] = [
        "monet-opt graph v1" if constants else "monet-opt graph structure v1",
        {"training": training},
        [[list(t.shape), str(t.dtype)] if isinstance(t, torch.Tensor) else _jsonable(t) for t in inputs],
    ]
    by_name = {n.name: n for n in nodes}
    for fn in gm.graph.nodes:
        if constants:
            entry: list[Any] = [fn.op, fn.name, _target_str(fn), _jsonable(fn.args), _jsonable(fn.kwargs)]
        else:
            entry = [fn.op, fn.name, _target_str(fn), [a.name for a in fn.all_input_nodes]]
        if fn.op == "get_attr" and not constants:
            value = operator.attrgetter(str(fn.target))(gm)
            if isinstance(value, torch.Tensor):
                entry.append([list(value.shape), str(value.dtype)])
        if fn.op == "call_module":
            if constants:
                entry.append(_module_config(gm.get_submodule(fn.target)))
            entry.append(
                [[k, list(p.shape), str(p.dtype)] for k, p in gm.get_submodule(fn.target).named_parameters()]
            )
        if fn.name in by_name:
            on = by_name[fn.name]
            entry.append([list(s) for s in on.shapes])
            entry.append(on.dtypes)
        items.append(entry)
    # which parameters are frozen decides which nodes need a backward and which gradients the
    # step makes (said only when some are: fingerprints of fully trainable models stay as they
    # were); the structure leaves it to the wrapper, which follows it by parameter name
    frozen = [name for name, p in gm.named_parameters() if not p.requires_grad]
    if frozen and constants:
        items.append({"frozen": frozen})
    blob = json.dumps(items, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(blob.encode()).hexdigest()


def trace(
    model: nn.Module,
    example_inputs: torch.Tensor | Sequence[torch.Tensor],
    *,
    leaf_modules: Iterable[str | type[nn.Module]] = (),
    leaf_fallback: bool = True,
    check: bool = True,
    rtol: float = 1e-4,
    atol: float = 1e-5,
) -> OpGraph:
    """Trace `model` on `example_inputs` (a tensor, a tuple of them, or a dict by keyword) into
    an `OpGraph`.

    leaf_modules: extra module paths ('encoder.layers.0') or classes kept as one node.
    leaf_fallback: when a submodule cannot be traced, keep it as a leaf (with a
        warning) instead of raising TraceError.
    check: run the eager model too and raise TraceError if the traced graph's
        output differs (same RNG state for both; buffers restored afterwards).

    The model is run once (twice with `check`) in its current mode (train/eval);
    its buffers and the global RNG state are left as they were. Hooks on the model itself are
    not part of the graph, and are off while it runs here (`monet_opt.root_hooks`).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"trace() needs an nn.Module, not {type(model).__name__}")
    with root_hooks.off(user_model(model)):
        return _trace(model, example_inputs, leaf_modules, leaf_fallback, check, rtol, atol)


def _trace(
    model: nn.Module,
    example_inputs: Any,
    leaf_modules: Iterable[str | type[nn.Module]],
    leaf_fallback: bool,
    check: bool,
    rtol: float,
    atol: float,
) -> OpGraph:
    # inputs by keyword ({'input_ids': ids, 'use_cache': False}): traced through a root taking
    # them positionally, under their names (`monet_opt.keyword_inputs`)
    model, inputs = as_traceable(model, example_inputs)
    inputs = _as_tuple(inputs)
    leaf_paths = {m for m in leaf_modules if isinstance(m, str)}
    leaf_types = KNOWN_LEAF_TYPES + tuple(m for m in leaf_modules if isinstance(m, type))

    if _Tracer(set(), leaf_types).is_leaf_module(model, ""):
        gm, auto_leaves = _leaf_root(model, len(inputs)), []
    else:
        gm, auto_leaves = _symbolic_trace(model, inputs, leaf_paths, leaf_types, leaf_fallback)
    # (not gm.train(): that would set every submodule, which gm shares with the model, to one mode)
    gm.training = model.training
    # later readers of an in-place change read the changing node (the runtime runs out of place)
    functionalize(gm)
    # what the model computes under torch.no_grad() reaches the rest detached (monet_opt.no_grad)
    try:
        detach_no_grad_values(gm)
    except ValueError as exc:
        raise TraceError(str(exc)) from None

    call_nodes = [n for n in gm.graph.nodes if n.op in ("call_module", "call_function", "call_method")]
    op_names = {n.name for n in call_nodes}

    buffers = module_state.saved_buffers(model)
    meter = _Measure(gm, op_names)
    try:
        with torch.random.fork_rng(devices=_rng_devices(inputs)):
            seed = int(torch.randint(0, 2**31 - 1, ()).item())
            torch.manual_seed(seed)
            try:
                traced_out = meter.run(*inputs)
            except Exception as exc:
                node = meter.current_node
                raise _run_error(exc, gm, node) from exc
            if check:
                module_state.restore_buffers(model, buffers)
                torch.manual_seed(seed)
                with torch.no_grad():
                    eager_out = model(*inputs)
                try:
                    _check_same(traced_out, eager_out, rtol, atol, type(model).__name__)
                except TraceError as exc:
                    raise TraceError(str(exc) + _generator_hint(model)) from None
    finally:
        module_state.restore_buffers(model, buffers)

    facts = meter.facts
    out_node = next(n for n in gm.graph.nodes if n.op == "output")
    output_names = []
    for a in _flatten(out_node.args):
        if isinstance(a, fx.Node) and a.name in op_names and a.name not in output_names:
            output_names.append(a.name)

    nodes: list[OpNode] = []
    for n in call_nodes:
        f = facts[n.name]
        params = _params_of(n, gm)
        nodes.append(
            OpNode(
                name=n.name,
                kind=_kind(n, gm),
                op=n.op,
                target=_target_str(n),
                param_bytes=int(sum(p.numel() * p.element_size() for _, p in params)),
                param_names=[k for k, _ in params],
                param_grad_bytes=int(sum(p.numel() * p.element_size() for _, p in params if p.requires_grad)),
                is_output=n.name in output_names,
                **f,
            )
        )

    g = nx.DiGraph()
    for on in nodes:
        g.add_node(on.name, kind=on.kind)
    for on in nodes:
        for pos, src in enumerate(on.inputs):
            if g.has_edge(src, on.name):
                g.edges[src, on.name]["positions"].append(pos)
            else:
                g.add_edge(src, on.name, positions=[pos])

    model_input_bytes = 0
    seen_inp: set[tuple[str, int]] = set()
    for t in inputs:
        if isinstance(t, torch.Tensor):
            k = _skey(t)
            if k is not None and k not in seen_inp:
                seen_inp.add(k)
                model_input_bytes += _snbytes(t)

    return OpGraph(
        gm=gm,
        nodes=nodes,
        graph=g,
        fingerprint=_fingerprint(gm, nodes, inputs, model.training),
        structure=_fingerprint(gm, nodes, inputs, model.training, constants=False),
        input_shapes=[tuple(t.shape) if isinstance(t, torch.Tensor) else () for t in inputs],
        output_names=output_names,
        input_dtypes=[str(t.dtype) if isinstance(t, torch.Tensor) else type(t).__name__ for t in inputs],
        leaf_paths=sorted(leaf_paths | set(auto_leaves)),
        model_input_bytes=model_input_bytes,
        data_sized=meter.data_sized,
    )


def check_graph(
    gm: fx.GraphModule, model: nn.Module, inputs: tuple, rtol: float = 1e-4, atol: float = 1e-5
) -> None:
    """Run a traced graph and the model itself on `inputs` under no_grad, from one RNG seed;
    TraceError if the graph fails or its outputs differ (traced at one shape, it may have fixed
    that shape: `x.view(8, -1)`). No-grad runs free their values as they go; the model's
    buffers and the RNG are left as they were."""
    buffers = module_state.saved_buffers(model)
    graph_run = _GraphRun(gm)
    try:
        with (
            torch.random.fork_rng(devices=_rng_devices(inputs)),
            torch.no_grad(),
            root_hooks.off(user_model(model)),
        ):
            seed = int(torch.randint(0, 2**31 - 1, ()).item())
            torch.manual_seed(seed)
            try:
                traced_out = graph_run.run(*inputs)
            except Exception as exc:
                raise _run_error(exc, gm, graph_run.current_node) from exc
            module_state.restore_buffers(model, buffers)
            torch.manual_seed(seed)
            _check_same(traced_out, model(*inputs), rtol, atol, type(model).__name__)
    finally:
        module_state.restore_buffers(model, buffers)


def graph_difference(solved: fx.GraphModule, other: fx.GraphModule) -> str | None:
    """Where `other` (the model traced again, at another input shape) differs from `solved` in
    its nodes, their targets or the data flow between them, said in a sentence; None if nowhere.
    The constants the nodes hold (the sizes a view was traced with) may differ: a schedule names
    nodes, so it runs on either graph."""

    def entries(gm: fx.GraphModule) -> list[tuple]:
        return [(n.op, n.name, _target_str(n), [a.name for a in n.all_input_nodes]) for n in gm.graph.nodes]

    a, b = entries(solved), entries(other)
    for x, y in zip(a, b):
        if x != y:
            return f"node {x[1]!r} ({x[0]} {x[2]} of {x[3]}) is {y[1]!r} ({y[0]} {y[2]} of {y[3]}) there"
    if len(a) != len(b):
        return f"it has {len(b)} nodes, the solved graph {len(a)}"
    return None


def _run_error(exc: BaseException, gm: fx.GraphModule, node: fx.Node | None) -> TraceError:
    if isinstance(exc, TraceError):
        return exc
    where = ""
    path = None
    if node is not None:
        where = f" at node {node.name!r} ({node.op} {_target_str(node)})"
        if node.op == "call_module":
            path = str(node.target)
    return TraceError(
        f"running the traced graph on the example inputs failed{where}: {type(exc).__name__}: "
        f"{_first_line(exc)}. The model's forward may depend on values torch.fx fixed at trace "
        "time; move that code into its own submodule, which then runs eagerly as one node "
        "(monet_opt.trace: leaf_modules=[...]).",
        module_path=path,
        node=node.name if node is not None else None,
    )


def _generator_hint(model: nn.Module) -> str:
    """A sentence naming the submodules that draw random numbers from a torch.Generator of their
    own, if any: its state moves on at every call, so the traced run and the eager one differ, and
    a recomputation would draw other numbers (the runtime replays the global RNG only)."""
    owners = [
        name or type(model).__name__
        for name, m in model.named_modules()
        if any(isinstance(v, torch.Generator) for v in vars(m).values())
    ]
    if not owners:
        return ""
    return (
        f" The model keeps a torch.Generator of its own ({', '.join(owners[:4])}): monet-opt replays "
        "only the global random number generator on recomputation; draw from it instead "
        "(torch.manual_seed makes it reproducible)."
    )


def _check_same(a: Any, b: Any, rtol: float, atol: float, model_name: str) -> None:
    ta, tb = _tensors(a), _tensors(b)
    if len(ta) != len(tb):
        raise TraceError(
            f"the traced {model_name} returns {len(ta)} tensors but the eager model returns {len(tb)}"
        )
    for i, (x, y) in enumerate(zip(ta, tb)):
        if x.shape != y.shape or not torch.allclose(x.detach(), y.detach(), rtol=rtol, atol=atol):
            diff = (
                (x.detach().float() - y.detach().float()).abs().max().item() if x.shape == y.shape else None
            )
            raise TraceError(
                f"the traced {model_name} differs from the eager model on output {i} "
                f"(shapes {tuple(x.shape)} vs {tuple(y.shape)}, max abs diff {diff}). "
                "Python control flow or state that fx fixed at trace time is the usual cause; "
                "make the responsible module a leaf (leaf_modules=[...]) or pass check=False."
            )
