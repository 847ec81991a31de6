"""An fx tracer whose proxies carry the values their nodes take on the example inputs.

`torch.fx.symbolic_trace` stops at Python code that reads a tensor's shape to decide
something (`if seq_len > n:`, `for h in hidden.split(...)`, `torch.arange(x.shape[1])`):
Hugging Face transformers and timm models are full of it. Here every proxy also holds its
node's value, computed as the trace goes (no gradients; the model's buffers and the RNG state
are left as they were), and shape queries (`.shape`, `.size()`, `.dim()`, `.dtype`,
`.device`, `len()`, iteration) answer with concrete values. The graph is then specialised to
the example inputs' shapes, as a schedule is anyway (its fingerprint holds the shapes, and
`MonetWrapper` refuses other shapes). Values computed from shapes alone (a causal mask from
`torch.arange`) become constants of the graph.

Control flow on tensor values (`if h.sum() > 0:`) still fails, as in plain fx: a trace must
not depend on the data.
"""

from __future__ import annotations

import operator
import sys
from typing import Any

import torch
import torch.fx as fx
from torch import nn
from torch.fx.node import map_aggregate

# tensor attributes and methods that describe a tensor rather than compute from its data
_META_ATTRS = frozenset(
    {
        "shape",
        "dtype",
        "device",
        "ndim",
        "is_cuda",
        "is_sparse",
        "is_quantized",
        "is_meta",
        "layout",
        "is_nested",
    }
)
_META_METHODS = frozenset(
    {
        "size",
        "dim",
        "numel",
        "nelement",
        "stride",
        "is_floating_point",
        "is_complex",
        "is_contiguous",
        "element_size",
        "get_device",
        "ndimension",
    }
)
_NO_VALUE = object()


class ConcreteProxy(fx.Proxy):
    """A proxy with the value its node has on the example inputs (`value`)."""

    def __init__(self, node: fx.Node, tracer: fx.Tracer | None = None) -> None:
        super().__init__(node, tracer)
        self.__dict__["value"] = _NO_VALUE

    def __getattr__(self, k: str) -> Any:
        value = self.__dict__.get("value", _NO_VALUE)
        if k in _META_ATTRS and isinstance(value, torch.Tensor):
            return getattr(value, k)
        return super().__getattr__(k)

    def __len__(self) -> int:
        value = self.__dict__.get("value", _NO_VALUE)
        if value is _NO_VALUE:
            return super().__len__()
        return len(value)

    def __iter__(self):
        value = self.__dict__.get("value", _NO_VALUE)
        if value is _NO_VALUE or (isinstance(value, torch.Tensor) and value.dim() == 0):
            return super().__iter__()
        return iter([self[i] for i in range(len(value))])

    def __setitem__(self, key: Any, value: Any) -> None:
        # `x[i] = v`: recorded as operator.setitem (its concrete value changes as the model's
        # would); `monet_opt.functionalize` makes it an out-of-place update later reads read
        self.tracer.create_proxy("call_function", operator.setitem, (self, key, value), {})

    def __bool__(self) -> bool:
        value = self.__dict__.get("value", _NO_VALUE)
        if isinstance(value, (tuple, list, dict)) or value is None:
            return bool(value)  # structure (a module's tuple output), not data
        # a tensor or a number (`.item()`): data-dependent, fx's error
        return super().__bool__()


def value_of(a: Any) -> Any:
    """The concrete value behind a proxy (or an attribute of one); anything else as it is."""
    if isinstance(a, fx.proxy.Attribute):
        return getattr(value_of(a.root), a.attr)
    if isinstance(a, ConcreteProxy):
        value = a.__dict__.get("value", _NO_VALUE)
        if value is _NO_VALUE:
            raise RuntimeError(f"no value for fx node {a.node.name}")
        return value
    return a


def _values(obj: Any) -> Any:
    return map_aggregate(obj, value_of) if not isinstance(obj, fx.Proxy) else value_of(obj)


class ConcreteTracerMixin:
    """Mixed into an fx.Tracer: proxies are `ConcreteProxy`s whose values are computed from
    `self.example_inputs` as nodes are created."""

    example_inputs: tuple = ()
    _computing = False  # True while a node's value is computed: modules and attributes run as they are
    _placeholders_seen = 0  # placeholders are made in signature order: the first ones are the inputs

    def proxy(self, node: fx.Node) -> fx.Proxy:
        return ConcreteProxy(node, self)

    def call_module(self, m: nn.Module, forward: Any, args: tuple, kwargs: dict) -> Any:
        if self._computing:
            return forward(*args, **kwargs)
        return super().call_module(m, forward, args, kwargs)

    def getattr(self, attr: str, attr_val: Any, parameter_proxy_cache: dict) -> Any:
        if self._computing:
            return attr_val
        return super().getattr(attr, attr_val, parameter_proxy_cache)

    def create_proxy(self, kind, target, args, kwargs, name=None, type_expr=None, proxy_factory_fn=None):
        if kind == "call_method" and target in _META_METHODS and args and isinstance(args[0], ConcreteProxy):
            obj = value_of(args[0])
            if isinstance(obj, torch.Tensor):
                return getattr(obj, target)(*_values(tuple(args[1:])), **_values(dict(kwargs)))
        proxy = super().create_proxy(kind, target, args, kwargs, name, type_expr, proxy_factory_fn)
        if isinstance(proxy, ConcreteProxy):
            proxy.__dict__["value"] = self._compute(kind, target, args, kwargs)
        return proxy

    def _compute(self, kind: str, target: Any, args: tuple, kwargs: dict) -> Any:
        if kind == "placeholder":
            self._placeholders_seen += 1
            k = self._placeholders_seen
            if k <= len(self.example_inputs):
                return self.example_inputs[k - 1]
            return args[0] if args else None  # an argument bound to its default
        vals, kvals = _values(tuple(args)), _values(dict(kwargs))
        self._computing = True
        try:
            if kind == "get_attr":
                obj: Any = self.root
                for part in str(target).split("."):
                    obj = getattr(obj, part)
                return obj
            with torch.no_grad():
                if kind == "call_function":
                    return target(*vals, **kvals)
                if kind == "call_method":
                    return getattr(vals[0], target)(*vals[1:], **kvals)
                if kind == "call_module":
                    mod: nn.Module = self.root.get_submodule(target)
                    # (a compiled submodule refuses to run inside fx's tracing: its value comes
                    # from the module it compiles)
                    mod = mod._orig_mod if is_compiled(mod) else mod
                    return mod(*vals, **kvals)
        finally:
            self._computing = False
        raise RuntimeError(f"unexpected fx node kind {kind!r}")


def is_compiled(mod: nn.Module) -> bool:
    """Whether `mod` is a torch.compile wrapper (OptimizedModule). Asked without importing
    torch._dynamo (1.5 s): only a process that compiled something has one."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    return eval_frame is not None and isinstance(mod, eval_frame.OptimizedModule)
