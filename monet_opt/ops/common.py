"""Shared helpers for the op families: out-of-place defaults, argument binding, bit packing.

The runtime detaches a node's inputs and may need them again (for another consumer or for a
recomputation), so no implementation may mutate its inputs. `out_of_place_default` turns any
op into its out-of-place equivalent with the same result.
"""

from __future__ import annotations

import inspect
import operator
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.fx.immutable_collections import immutable_list

from .base import Implementation, call_target

# --------------------------------------------------------------------------- in-place rewriting

# operator.iadd & co. (fx records `x += y` as operator.iadd) -> their out-of-place operators.
INPLACE_OPERATORS: dict[Callable, Callable] = {
    operator.iadd: operator.add,
    operator.isub: operator.sub,
    operator.imul: operator.mul,
    operator.itruediv: operator.truediv,
    operator.ifloordiv: operator.floordiv,
    operator.imod: operator.mod,
    operator.ipow: operator.pow,
    operator.imatmul: operator.matmul,
    operator.iand: operator.and_,
    operator.ior: operator.or_,
    operator.ixor: operator.xor,
    operator.ilshift: operator.lshift,
    operator.irshift: operator.rshift,
}

# In-place tensor methods whose out-of-place twin (name without the trailing "_") computes the
# same value with the same arguments. Anything else ending in "_" is run on a clone.
SAFE_OUT_OF_PLACE_METHODS = frozenset(
    """add_ sub_ mul_ div_ true_divide_ floor_divide_ remainder_ fmod_ pow_ neg_ abs_ sqrt_ rsqrt_ exp_
    log_ sigmoid_ tanh_ relu_ clamp_ clamp_min_ clamp_max_ clip_ masked_fill_ masked_scatter_ addcmul_
    addcdiv_ lerp_ sign_ floor_ ceil_ round_ trunc_ reciprocal_ square_ sin_ cos_ erf_ exp2_ log1p_
    expm1_ hardtanh_ leaky_relu_ index_add_ index_fill_ index_copy_ scatter_ scatter_add_
    scatter_reduce_ logical_not_ logical_and_ logical_or_ bitwise_and_ bitwise_or_ bitwise_xor_
    squeeze_ unsqueeze_ transpose_ t_ baddbmm_ addmm_ addmv_ addbmm_ nan_to_num_ where_
    """.split()
)

# Methods ending in "_" that do not mutate values (metadata only): call them as written.
NON_MUTATING_UNDERSCORE = frozenset({"requires_grad_", "retain_grad", "share_memory_", "record_stream"})

# Dunder in-place methods.
INPLACE_DUNDERS = {
    "__iadd__": "__add__",
    "__isub__": "__sub__",
    "__imul__": "__mul__",
    "__itruediv__": "__truediv__",
    "__ifloordiv__": "__floordiv__",
    "__imod__": "__mod__",
    "__ipow__": "__pow__",
    "__imatmul__": "__matmul__",
    "__iand__": "__and__",
    "__ior__": "__or__",
    "__ixor__": "__xor__",
    "__ilshift__": "__lshift__",
    "__irshift__": "__rshift__",
}


def is_mutating_method_name(name: str) -> bool:
    return (
        name.endswith("_") and not name.startswith("_") and name not in NON_MUTATING_UNDERSCORE
    ) or name in INPLACE_DUNDERS


def _run_on_clone(method: str) -> Callable:
    def run(target, args, kwargs, recompute):
        return getattr(args[0].clone(), method)(*args[1:], **kwargs)

    return run


def _method_runner(name: str) -> Callable:
    """Out-of-place runner for a (possibly in-place) tensor method name."""
    if name in INPLACE_DUNDERS:
        twin = INPLACE_DUNDERS[name]
        return lambda target, args, kwargs, recompute: getattr(args[0], twin)(*args[1:], **kwargs)
    if is_mutating_method_name(name):
        if name in SAFE_OUT_OF_PLACE_METHODS:
            twin = name[:-1]
            return lambda target, args, kwargs, recompute: getattr(args[0], twin)(*args[1:], **kwargs)
        return _run_on_clone(name)
    return lambda target, args, kwargs, recompute: getattr(args[0], name)(*args[1:], **kwargs)


def _signature(fn: Callable) -> inspect.Signature | None:
    try:
        return inspect.signature(fn)
    except (TypeError, ValueError):
        return None


def bind(fn: Callable, args: tuple, kwargs: dict, sig: inspect.Signature | None = None) -> dict[str, Any]:
    """Bind a call's arguments to `fn`'s parameter names, defaults applied."""
    sig = sig or inspect.signature(fn)
    bound = sig.bind(*args, **kwargs)
    bound.apply_defaults()
    return dict(bound.arguments)


def inplace_position(fn: Callable) -> int | None:
    """The position of `fn`'s `inplace` parameter (F.relu, F.dropout, ...), None if it has none."""
    sig = _signature(fn)
    if sig is None or "inplace" not in sig.parameters:
        return None
    return list(sig.parameters).index("inplace")


def _function_runner(fn: Callable) -> Callable:
    """Out-of-place runner for a function target."""
    if fn in INPLACE_OPERATORS:
        twin = INPLACE_OPERATORS[fn]
        return lambda target, args, kwargs, recompute: twin(*args, **kwargs)
    pos = inplace_position(fn)
    if pos is not None:

        def run(target, args, kwargs, recompute):
            if len(args) > pos:
                args = args[:pos] + (False,) + args[pos + 1 :]
            elif kwargs.get("inplace"):
                kwargs = {**kwargs, "inplace": False}
            return fn(*args, **kwargs)

        return run
    name = getattr(fn, "__name__", "")
    if is_mutating_method_name(name) and not name.startswith("_"):
        # torch.relu_, F.relu_, torch.Tensor.add_, torch.sigmoid_, ... : the first argument is mutated.
        owner_twin = None
        if name in SAFE_OUT_OF_PLACE_METHODS:
            for ns in (torch, torch.nn.functional, torch.Tensor):
                if getattr(ns, name, None) is fn and hasattr(ns, name[:-1]):
                    owner_twin = getattr(ns, name[:-1])
                    break
        if owner_twin is not None:
            twin = owner_twin
            return lambda target, args, kwargs, recompute: twin(*args, **kwargs)

        def run_clone(target, args, kwargs, recompute):
            return fn(args[0].clone(), *args[1:], **kwargs)

        return run_clone
    return lambda target, args, kwargs, recompute: fn(*mutable(args), **kwargs)


def mutable(args: tuple) -> tuple:
    """`args` with fx's immutable lists made plain lists: a model's own function may change a
    list it is given (torchvision's video Swin, `_get_window_and_shift_size`), as in its Python,
    where each call gets its list made anew."""
    if not any(type(a) is immutable_list for a in args):
        return args
    return tuple(list(a) if type(a) is immutable_list else a for a in args)


class _InplaceOff:
    """Temporarily set `module.inplace = False` (restored afterwards, even on error)."""

    def __init__(self, module: nn.Module):
        self.module = module

    def __enter__(self):
        self.saved = self.module.inplace
        self.module.inplace = False

    def __exit__(self, *exc):
        self.module.inplace = self.saved
        return False


def _module_runner(module: nn.Module) -> Callable:
    if isinstance(getattr(module, "inplace", None), bool):

        def run(target, args, kwargs, recompute):
            if not target.inplace:
                return target(*args, **kwargs)
            with _InplaceOff(target):
                return target(*args, **kwargs)

        return run
    return lambda target, args, kwargs, recompute: target(*args, **kwargs)


def out_of_place_runner(op: str, target: Any) -> Callable:
    """A `run(target, args, kwargs, recompute)` computing the op's value without mutating inputs."""
    if op == "call_module" or isinstance(target, nn.Module):
        return _module_runner(target)
    if op == "call_method" or isinstance(target, str):
        return _method_runner(target)
    if callable(target):
        return _function_runner(target)
    return lambda t, args, kwargs, recompute: call_target(t, args, kwargs)


def out_of_place_default(
    op: str, target: Any, description: str = "the op as the model wrote it"
) -> Implementation:
    return Implementation("default", out_of_place_runner(op, target), description + " (run out of place)")


# --------------------------------------------------------------------------- argument helpers


def first_tensor(args: tuple, kwargs: dict, name: str = "input") -> torch.Tensor:
    if args:
        return args[0]
    return kwargs[name]


def is_fake_or_meta(t: Any) -> bool:
    if not isinstance(t, torch.Tensor):
        return True
    if t.is_meta:
        return True
    try:
        from torch._subclasses.fake_tensor import FakeTensor

        return isinstance(t, FakeTensor)
    except ImportError:  # pragma: no cover
        return False


# --------------------------------------------------------------------------- 1-bit packing
#
# Bit i of byte j holds element 8*j + i. Packing reads each group of 8 bool bytes as one int64 and
# gathers the 8 low bits with one multiplication (0x0102040810204080 moves byte i's bit 0 to bit
# 56 + i without carries); unpacking looks each byte up in a 256-entry int64 table whose 8 bytes
# are the bool values. Both are a few passes over numel/8 elements.

_LITTLE = sys.byteorder == "little"
_MAGIC = 0x0102040810204080
_TABLES: dict[torch.device, torch.Tensor] = {}
_BIT_WEIGHTS: dict[torch.device, torch.Tensor] = {}


def _bit_weights(device: torch.device) -> torch.Tensor:
    w = _BIT_WEIGHTS.get(device)
    if w is None:
        w = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8, device=device)
        _BIT_WEIGHTS[device] = w
    return w


def _unpack_table(device: torch.device) -> torch.Tensor:
    t = _TABLES.get(device)
    if t is None:
        bits = torch.arange(256).unsqueeze(1).bitwise_and(_bit_weights(torch.device("cpu")).long()).ne(0)
        t = bits.to(torch.uint8).contiguous().view(torch.int64).view(-1).to(device)
        _TABLES[device] = t
    return t


def memory_order(t: torch.Tensor) -> tuple[int, ...] | None:
    """The permutation whose view of `t` is contiguous where `t` is channels_last (4-d) or
    channels_last_3d (5-d): packing that view reads `t` as it lies in memory, where packing `t`
    itself copies it (a channels_last ResNet stem-sized ReLU's bit mask: forward 7.6 ms and
    backward 31 ms, against 4.0 and 9.1 contiguous). None for any other layout."""
    if t.is_contiguous():
        return None
    perm = {4: (0, 2, 3, 1), 5: (0, 2, 3, 4, 1)}.get(t.dim())
    return perm if perm is not None and t.permute(perm).is_contiguous() else None


def inverse(perm: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(sorted(range(len(perm)), key=perm.__getitem__))


def pack_bits(mask: torch.Tensor) -> torch.Tensor:
    """Pack a bool tensor into uint8, 8 elements per byte (ceil(numel/8) bytes)."""
    flat = mask.reshape(-1)
    n = flat.numel()
    pad = (-n) % 8
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    if _LITTLE:
        words = flat.view(torch.uint8).view(torch.int64)
        return words.mul(_MAGIC).bitwise_right_shift_(56).to(torch.uint8)
    bits = flat.view(-1, 8).view(torch.uint8)
    return (bits * _bit_weights(mask.device)).sum(dim=1, dtype=torch.uint8)


def unpack_bits(packed: torch.Tensor, numel: int, shape: torch.Size) -> torch.Tensor:
    """Inverse of `pack_bits`: a bool tensor of `shape`."""
    if _LITTLE:
        words = _unpack_table(packed.device).index_select(0, packed.to(torch.int32))
        bits = words.view(torch.bool)
    else:
        bits = packed.unsqueeze(1).bitwise_and(_bit_weights(packed.device)).ne(0).view(-1)
    return bits[:numel].view(shape)


def refuse_higher_order(impl: str) -> None:
    """Called first in the backward of an implementation that writes into the gradient it is
    fed: that backward cannot be differentiated again (`create_graph=True`)."""
    if torch.is_grad_enabled():
        raise RuntimeError(
            f"monet-opt: higher-order gradients (create_graph=True) through the {impl!r} implementation "
            "are not supported: its backward writes into the gradient it is fed; solve with the default "
            "implementations (solver.baselines.no_recompute) or use the plain model for them"
        )
