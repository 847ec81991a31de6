"""Leaf modules that change their own buffers while they train, recomputed from the state they
started from.

Spectral normalisation (`nn.utils.parametrizations.spectral_norm`, `nn.utils.spectral_norm`)
runs a power iteration in every training forward and writes its vectors `u`, `v` back into
buffers; its output depends on them. Run again in the backward, such a module would start from
the state its first run left, compute another weight, and hand the backward another graph than
the forward's: wrong gradients, silently (measured: a spectral-normed Linear's bias gradient
1.3e-4 off plain's, largest 2.3e-3), and one update too many of its buffers (a batch norm
inside a submodule kept whole for its hooks).

The tracer records, per leaf module node, the buffers its run changed (`record`, by their
values; a batch or instance norm node is left out, `monet_opt.ops.norm` keeps its statistics
right on recomputation; one inside a larger leaf, kept whole for its hooks, counts). The runtime
keeps a copy of those buffers as they were before the node's first run in a step (`snapshot`),
and recomputes the node on a fresh copy of that state (`replayed`), putting the module's own
buffers (the first run's result) back afterwards: the recomputation is the first run again, and
the buffers advance once per step. Profiling and tracing put every buffer back as it was
(`saved_buffers`, `restore_buffers`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import fx, nn

__all__ = [
    "CHANGED_BUFFERS",
    "buffer_values",
    "changed_buffers",
    "record",
    "replayed",
    "restore_buffers",
    "saved_buffers",
    "snapshot",
]

CHANGED_BUFFERS = "monet_opt_changed_buffers"  # fx node meta: buffer names the module changes

_NormBase = nn.modules.batchnorm._NormBase


def buffer_values(module: nn.Module) -> dict[str, torch.Tensor]:
    """Copies of `module`'s buffers (none for a batch or instance norm node, whose
    implementations keep their statistics themselves; a norm inside a larger leaf counts)."""
    return {} if isinstance(module, _NormBase) else saved_buffers(module)


def changed_buffers(module: nn.Module, before: dict[str, torch.Tensor]) -> list[str]:
    """The buffers named in `before` whose values changed since. (By value: batch norm's
    kernels update the running statistics without moving their version counters.)"""
    now = dict(module.named_buffers())
    return [
        name
        for name, value in before.items()
        if name in now and (now[name].shape != value.shape or not torch.equal(now[name], value))
    ]


def record(node: fx.Node, module: nn.Module, before: dict[str, torch.Tensor]) -> int:
    """Mark `node` with the buffers of `module` changed since `before`; their bytes."""
    names = changed_buffers(module, before)
    if not names:
        node.meta.pop(CHANGED_BUFFERS, None)
        return 0
    node.meta[CHANGED_BUFFERS] = names
    buffers = dict(module.named_buffers())
    return sum(buffers[n].numel() * buffers[n].element_size() for n in names)


def snapshot(module: nn.Module, names: list[str]) -> dict[str, torch.Tensor]:
    """Copies of the named buffers, as they are now."""
    buffers = dict(module.named_buffers())
    return {n: buffers[n].detach().clone() for n in names}


@contextmanager
def replayed(module: nn.Module, state: dict[str, torch.Tensor]) -> Iterator[None]:
    """Run with each named buffer replaced by a fresh copy of `state`'s; the module's own
    tensors are put back afterwards (swapped, not copied into: a graph the run built may have
    saved them, and an in-place copy back would invalidate it)."""
    originals = []
    for name, value in state.items():
        owner, attr = _owner(module, name)
        originals.append((owner, attr, owner._buffers[attr]))
        owner._buffers[attr] = value.clone()
    try:
        yield
    finally:
        for owner, attr, tensor in originals:
            owner._buffers[attr] = tensor


def saved_buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    """Copies of all of `model`'s buffers (tracing and profiling run the model, which moves
    batch norm statistics and power iterations on: they put these back)."""
    return {k: b.detach().clone() for k, b in model.named_buffers()}


def restore_buffers(model: nn.Module, saved: dict[str, torch.Tensor]) -> None:
    """Copy `saved_buffers`' copies back into the model's buffers."""
    with torch.no_grad():
        for k, b in model.named_buffers():
            if k in saved and b.shape == saved[k].shape:
                b.copy_(saved[k])


def _owner(module: nn.Module, name: str) -> tuple[nn.Module, str]:
    path, _, attr = name.rpartition(".")
    return (module.get_submodule(path) if path else module), attr
