"""Restores: a value read back out of a consumer's backward state instead of recomputed.

A convolution run with "zero_packed_input" keeps its input (a ReLU output, mostly zeros) in
its backward state as a bit mask and the nonzero elements (`monet_opt.ops.zero_pack`). While
that state is held, the input itself need not be: a backward stage that needs it again (to
recompute what follows it) unpacks it from there, bitwise equal, in about the time of a copy,
instead of recomputing the chain that made it.

The problem offers this as a `solver.Restore` of the input node, named
`restore_name(consumer)`; a schedule names it in a compute step of that node (in a backward
stage, without grad) and the runtime's executor runs it with `restored_value`.
"""

from __future__ import annotations

import torch

from monet_opt.ops import zero_pack
from monet_opt.ops.conv import Conv2dZeroPackedInput

PREFIX = "restore_from:"
CONSUMER_IMPL = "zero_packed_input"  # the consumer implementation whose state holds the copy


def restore_name(consumer: str) -> str:
    return PREFIX + consumer


def consumer_of(impl_name: str) -> str | None:
    """The consumer a restore's name reads from; None for an implementation's name."""
    return impl_name[len(PREFIX) :] if impl_name.startswith(PREFIX) else None


def holds_packed_input(grad_fn) -> bool:
    """The autograd node is a zero-packed convolution's: its state holds its input packed."""
    return isinstance(grad_fn, Conv2dZeroPackedInput._backward_cls)


def restored_value(grad_fn) -> torch.Tensor:
    """The input a zero-packed convolution's backward node keeps, unpacked (a new tensor)."""
    if not holds_packed_input(grad_fn):
        raise TypeError(f"not a zero-packed convolution's backward node: {type(grad_fn).__name__}")
    bits, values, _weight = grad_fn.saved_tensors
    shape, dtype, offsets = grad_fn.packed
    return zero_pack.unpack(zero_pack.Packed(bits, values, shape, dtype, offsets))
