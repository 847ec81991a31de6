"""The implementation interface every op family follows.

An `Implementation` runs one fx node. It receives the node's resolved target
(the `nn.Module` for call_module, the function for call_function, the method
name for call_method), the node's evaluated args and kwargs, and `recompute`:
True when the runtime runs the node again during backward (batch norm must then
not update its running statistics a second time).

What an implementation's backward keeps is not declared by hand: the profiler
measures it (saved-tensor hooks) and writes it into the solver problem.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Implementation:
    """grad_in_place: the gradient of the op's first tensor argument is the buffer of the
    incoming gradient of its output (same shape and dtype), written in place (ReLU, batch
    norm) or passed through (add, sub), instead of a new buffer. The runtime then hands
    the backward a gradient buffer nobody else holds.

    replays: `run` also takes `memo=`, a dict the runtime keeps per node for one training
    step: the first computation stores in it what a recomputation reuses (batch norm: the
    batch statistics), and a recomputation given a filled memo reuses it. Without a memo, or
    with an empty one, the node computes everything. The profiler times the memo path as the
    implementation's `recompute_time`.

    applies: given the node's example (args, kwargs), whether the implementation is worth
    offering there (the profiler skips it, and the solver never sees it, where this says False);
    None: everywhere. The runtime runs any implementation a schedule names.

    value_state_bytes: for an implementation whose kept bytes depend on the tensor values, not
    only on shapes (a zero-packed input: its size follows the input's density), the private bytes
    its backward keeps for given example (args, kwargs). The profiler takes them from the node's
    own example values (its cache is keyed by shapes: two nodes of one shape share times, not
    these bytes), and offers such implementations only when asked (`build_problem(...,
    zero_pack=True)`): a denser batch in training keeps more than predicted.

    bitwise: the gradients (and outputs) are bit for bit torch's default's. False where the
    arithmetic differs (a weight gradient summed over batch chunks, an input rebuilt from the
    output, another attention kernel): the differences are float rounding (~1e-6 relative),
    and `build_problem(..., bitwise=True)` leaves such implementations out.

    autocast: runs under torch.autocast as the default does (the default's dtypes, its
    arithmetic up to rounding). False where it cannot (batch norm rebuilding its input from a
    bfloat16 output): under autocast the node's default runs instead (`implementations_for`),
    and `build_problem` under autocast does not offer it.

    state_from_inputs: called as `run` is (with grad enabled, in a backward stage), it makes the
    node's backward state from its inputs without running the forward: it returns a stand-in
    for the output (its shape and dtype, no storage of its size) whose backward is this
    implementation's very backward (a convolution's `aten.convolution_backward` on its input and
    weight). It raises RuntimeError where the node's arguments do not allow it (the profiler
    tries it on the example, and offers it where it returns the output's shape and dtype). The
    schedule's `make_state` step; the problem's `Impl.bwd_from_inputs`. None: the
    implementation cannot."""

    name: str
    run: Callable[..., Any]
    description: str = ""
    grad_in_place: bool = False
    replays: bool = False
    applies: Callable[[tuple, dict], bool] | None = None
    value_state_bytes: Callable[[tuple, dict], int] | None = None
    bitwise: bool = True
    autocast: bool = True
    state_from_inputs: Callable[..., Any] | None = None


def call_target(target: Any, args: tuple, kwargs: dict) -> Any:
    """Call a node's target the way fx would (method names are called on args[0])."""
    if isinstance(target, str):
        return getattr(args[0], target)(*args[1:], **kwargs)
    return target(*args, **kwargs)


DEFAULT = Implementation(
    "default",
    lambda target, args, kwargs, recompute: call_target(target, args, kwargs),
    "the op as the model wrote it",
)
