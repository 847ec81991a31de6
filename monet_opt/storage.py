"""Which memory a tensor uses, asked without changing what autograd may do with it.

`t.untyped_storage()` makes a Python object for t's storage, and in this torch (2.14)
that object lives as long as the storage does and holds a reference to it. The autograd
engine adds two gradients for the same value in place only if it holds the last
reference to the first one's storage (`InputBuffer::accumulate`), so after a single
`untyped_storage()` call it never does again: it allocates `a + b` and keeps both
operands until the sum is made. Measured on ResNet-50 b8 224 (session 12): one shared
autograd graph whose member received a gradient from outside and one from inside
allocated a 6.1 MiB sum the memory model does not have (at the step's peak 1.1 MiB more than
with one graph per node, 0.5 MiB over the budget), because the executor had asked for the
outside gradient's storage.

These helpers read the storage's address and reference count directly (no Python
storage object), so gradients that pass through the runtime stay as stealable as in plain
PyTorch. Use them, not `untyped_storage()`, on anything the engine may still accumulate;
forward values and saved tensors are never accumulated, so `spans_storage` may ask them.
"""

from __future__ import annotations

import torch

_ADDRESS = getattr(torch._C, "_storage_address", None)


def storage_key(t: torch.Tensor) -> int:
    """An identifier of t's storage (its StorageImpl's address), equal for every tensor sharing
    it (while it lives)."""
    if _ADDRESS is None:  # (a torch without it: the same address, through a storage object)
        return t.untyped_storage()._cdata
    return _ADDRESS(t)


def storage_use_count(t: torch.Tensor) -> int:
    """How many tensors (or other C++ holders) refer to t's storage."""
    if _ADDRESS is None:
        return torch._C._storage_Use_Count(t.untyped_storage()._cdata) - 1  # (the temporary object's)
    return torch._C._storage_Use_Count(_ADDRESS(t))


def only_reference(t: torch.Tensor, references: int = 1) -> bool:
    """Nothing but this tensor object refers to its memory (no other tensor on its storage, no
    C++ holder such as the autograd engine's input buffers). references: how many holders of
    the tensor object itself are known and fine (2 in a tensor hook: the engine's buffer, and
    the hook's argument)."""
    return t._use_count() <= references and storage_use_count(t) == 1


def spans_storage(t: torch.Tensor) -> bool:
    """t covers its whole storage (not a slice of, or an expanded view on, a larger one).

    Exact, but asks for the storage object: use it on forward values, never on gradients.
    """
    return t.untyped_storage().nbytes() == t.numel() * t.element_size()


def gradient_spans_storage(g: torch.Tensor) -> bool:
    """`spans_storage` for a gradient the autograd engine made, without a storage object.

    The engine's slices and expansions of a gradient (cat's, split's, sum's backward) are views,
    compared here with their base; a gradient that is not a view is an operator's output, with
    a storage of its own size. (Not valid for detached tensors: `x[2:5].detach()` is no view.)
    """
    base = g._base if g._is_view() else None
    if base is None:
        return True
    return base.numel() * base.element_size() == g.numel() * g.element_size()
