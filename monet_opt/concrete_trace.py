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
not depend on the data. So does Python reading a size that depends on the data: the output of
`nonzero`, `torch.where(mask)`, a boolean mask (`x[mask]`), `unique`, ..., and what is computed
from it (a mixture of experts' tokens per expert). Answered with the example's number, the
trace would fix it (`if rows.numel() == 0: continue` skipped an expert on other data, and the
outputs were wrong, silently). Such values carry `alt`: meta tensors of the shapes they would
have had, were each data-dependent size one larger; a size read where the two differ raises
`DataDependentSize`, and the submodule doing it runs eagerly, as a leaf.
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

# ops whose output may have a size read from the input's values (checked on meta tensors)
_DATA_SIZED_FUNCTIONS = frozenset(
    {
        torch.nonzero,
        torch.argwhere,
        torch.masked_select,
        torch.unique,
        torch.unique_consecutive,
        torch.repeat_interleave,
        torch.bincount,
        torch.where,
        operator.getitem,
    }
)
_DATA_SIZED_METHODS = frozenset(
    {
        "nonzero",
        "argwhere",
        "masked_select",
        "unique",
        "unique_consecutive",
        "repeat_interleave",
        "bincount",
        "__getitem__",
    }
)


class DataDependentSize(RuntimeError):
    """Python code read a size that depends on the values of the example inputs."""


class ConcreteProxy(fx.Proxy):
    """A proxy with the value its node has on the example inputs (`value`)."""

    def __init__(self, node: fx.Node, tracer: fx.Tracer | None = None) -> None:
        super().__init__(node, tracer)
        self.__dict__["value"] = _NO_VALUE

    def __getattr__(self, k: str) -> Any:
        value = self.__dict__.get("value", _NO_VALUE)
        if k in _META_ATTRS and isinstance(value, torch.Tensor):
            return self._static(f".{k}", lambda v: getattr(v, k))
        return super().__getattr__(k)

    def __len__(self) -> int:
        value = self.__dict__.get("value", _NO_VALUE)
        if value is _NO_VALUE:
            return super().__len__()
        return self._static("len()", len)

    def __iter__(self):
        value = self.__dict__.get("value", _NO_VALUE)
        if value is _NO_VALUE or (isinstance(value, torch.Tensor) and value.dim() == 0):
            return super().__iter__()
        return iter([self[i] for i in range(self._static("iteration", len))])

    def _static(self, what: str, read: Any) -> Any:
        """read(value), if it does not depend on the data: DataDependentSize where the value's
        size does and `read` tells (`alt`, the shapes had those sizes been larger, reads
        otherwise)."""
        value = self.__dict__["value"]
        got = read(value)
        alt = self.__dict__.get("alt", _NO_VALUE)
        if alt is _NO_VALUE:
            return got
        if alt is not None:
            try:
                if read(alt) == got:
                    return got
            except Exception:
                pass
        raise DataDependentSize(
            f"Python reads the size of {self.node.name!r} ({what}), which depends on the input's "
            "values (it comes from nonzero, torch.where(mask), a boolean mask, unique, ...): a trace "
            "would fix it to the example's"
        )

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
                rest, kw = _values(tuple(args[1:])), _values(dict(kwargs))
                return args[0]._static(f".{target}()", lambda v: getattr(v, target)(*rest, **kw))
        proxy = super().create_proxy(kind, target, args, kwargs, name, type_expr, proxy_factory_fn)
        if isinstance(proxy, ConcreteProxy):
            value = self._compute(kind, target, args, kwargs)
            proxy.__dict__["value"] = value
            if _reads_data_sized(args, kwargs) or _candidate(kind, target, _values(tuple(args))):
                alt = self._alt(kind, target, args, kwargs, value)
                if alt is None or not _same_shapes(alt, value):
                    proxy.__dict__["alt"] = alt
        return proxy

    def _alt(self, kind: str, target: Any, args: tuple, kwargs: dict, value: Any) -> Any:
        """The node's output as meta tensors, computed from its inputs' `alt`s (meta copies of
        the others); where the op cannot run on meta (its size comes from the data: nonzero, a
        boolean mask), the value with its first dimension one larger; None if neither."""
        try:
            return self._run(kind, target, _meta(args), _meta(kwargs), on_meta=True)
        except _Unknown:
            return None
        except Exception:
            return _first_dim_larger(value)

    def _compute(self, kind: str, target: Any, args: tuple, kwargs: dict) -> Any:
        if kind == "placeholder":
            self._placeholders_seen += 1
            k = self._placeholders_seen
            if k <= len(self.example_inputs):
                return self.example_inputs[k - 1]
            return args[0] if args else None  # an argument bound to its default
        if kind == "get_attr":
            self._computing = True  # (the attribute itself, not a proxy of it)
            try:
                obj: Any = self.root
                for part in str(target).split("."):
                    obj = getattr(obj, part)
                return obj
            finally:
                self._computing = False
        return self._run(kind, target, _values(tuple(args)), _values(dict(kwargs)))

    def _run(self, kind: str, target: Any, vals: tuple, kvals: dict, on_meta: bool = False) -> Any:
        """A call node's op on these values (on_meta: a module with meta copies of its state)."""
        self._computing = True  # (modules and attributes run as they are, not traced)
        try:
            with torch.no_grad():
                if kind in ("call_function", "call_method"):
                    return _call_op(kind, target, vals, kvals)
                if kind == "call_module":
                    mod: nn.Module = self.root.get_submodule(target)
                    # (a compiled submodule refuses to run inside fx's tracing: its value comes
                    # from the module it compiles)
                    mod = mod._orig_mod if is_compiled(mod) else mod
                    if on_meta:
                        state = dict(mod.named_parameters()) | dict(mod.named_buffers())
                        meta_state = {k: _meta_tensor(v) for k, v in state.items()}
                        return torch.func.functional_call(mod, meta_state, tuple(vals), kvals)
                    return mod(*vals, **kvals)
        finally:
            self._computing = False
        raise RuntimeError(f"unexpected fx node kind {kind!r}")


class _Unknown(Exception):
    """An input's `alt` is unknown."""


def _call_op(kind: str, target: Any, vals: tuple, kvals: dict) -> Any:
    """A call_function or call_method node's op on these values."""
    if kind == "call_function":
        return target(*vals, **kvals)
    return getattr(vals[0], target)(*vals[1:], **kvals)


def _reads_data_sized(args: tuple, kwargs: dict) -> bool:
    found = []
    map_aggregate((args, kwargs), lambda a: found.append(a) if _data_sized(a) else None)
    return bool(found)


def _data_sized(a: Any) -> bool:
    return isinstance(a, ConcreteProxy) and "alt" in a.__dict__


def may_size_by_data(kind: str, target: Any) -> bool:
    """An op that may size its output by its input's values (nonzero, indexing, unique, ...)."""
    if kind == "call_function":
        return target in _DATA_SIZED_FUNCTIONS
    return kind == "call_method" and target in _DATA_SIZED_METHODS


def _candidate(kind: str, target: Any, vals: tuple) -> bool:
    """An op that may size its output by its input's values, given a tensor argument (indexing
    by a tensor: a boolean mask)."""
    if not may_size_by_data(kind, target):
        return False
    if target is operator.getitem or target == "__getitem__":
        found = []
        map_aggregate(vals[1:], lambda a: found.append(a) if isinstance(a, torch.Tensor) else None)
        return bool(found) and isinstance(vals[0], torch.Tensor)
    return True


def sized_by_data(kind: str, target: Any, vals: tuple, kvals: dict) -> bool:
    """Whether a call node, on these input values, sizes its output by their values: one of the
    ops that may (nonzero, a boolean mask, unique, ...), and it cannot run on meta tensors."""
    if not _candidate(kind, target, vals):
        return False
    margs, mkwargs = map_aggregate(vals, _meta_tensor), map_aggregate(kvals, _meta_tensor)
    try:
        with torch.no_grad():
            _call_op(kind, target, margs, mkwargs)
    except Exception:
        return True
    return False


def _meta(obj: Any) -> Any:
    """obj with each proxy's value as meta tensors (a data-sized one's `alt`)."""

    def convert(a: Any) -> Any:
        if _data_sized(a):
            if a.__dict__["alt"] is None:
                raise _Unknown
            return a.__dict__["alt"]
        return map_aggregate(value_of(a), _meta_tensor) if isinstance(a, ConcreteProxy) else _meta_tensor(a)

    return map_aggregate(obj, convert)


def _meta_tensor(a: Any) -> Any:
    if isinstance(a, torch.Tensor) and a.device.type != "meta":
        return torch.empty_strided(a.shape, a.stride(), dtype=a.dtype, device="meta")
    return a


def _first_dim_larger(value: Any) -> Any:
    def grow(a: Any) -> Any:
        if isinstance(a, torch.Tensor) and a.dim() > 0:
            return torch.empty((a.shape[0] + 1, *a.shape[1:]), dtype=a.dtype, device="meta")
        return a

    return map_aggregate(value, grow)


def _same_shapes(alt: Any, value: Any) -> bool:
    shapes: list[list] = [[], []]
    for k, obj in enumerate((alt, value)):
        map_aggregate(
            obj, lambda a, k=k: shapes[k].append(tuple(a.shape)) if isinstance(a, torch.Tensor) else None
        )
    return shapes[0] == shapes[1]


def is_compiled(mod: nn.Module) -> bool:
    """Whether `mod` is a torch.compile wrapper (OptimizedModule). Asked without importing
    torch._dynamo (1.5 s): only a process that compiled something has one."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    return eval_frame is not None and isinstance(mod, eval_frame.OptimizedModule)
