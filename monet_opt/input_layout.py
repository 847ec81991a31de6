"""The memory format of the model's input tensors: recorded when a problem is profiled, checked
at every wrapped step.

A channels_last input makes every convolution after it run channels_last, with other kernels
and other temporaries: resnet18 b4 64x64 solved for contiguous inputs and fed channels_last
ones measured 62.5 MB against a 48.0 MB budget (gradients equal). The fingerprint holds shapes
and dtypes, not strides, so the wrapper checks the format itself. Solving for channels_last
inputs is refused: the memory model does not hold for channels_last activations yet (resnet18
b4 32x32, every state recomputed: 60.6 MB measured against 51.4 MB predicted).
"""

from __future__ import annotations

from typing import Any

import torch

CONTIGUOUS = "contiguous"
FORMATS = {"channels_last": torch.channels_last, "channels_last_3d": torch.channels_last_3d}


def layout_of(x: Any) -> str:
    """'contiguous', 'channels_last', 'channels_last_3d' or 'strided' (anything else: a slice)."""
    if not isinstance(x, torch.Tensor) or x.is_contiguous():
        return CONTIGUOUS
    for name, fmt in FORMATS.items():
        if x.dim() == (4 if fmt is torch.channels_last else 5) and x.is_contiguous(memory_format=fmt):
            return name
    return "strided"


def check_solvable(inputs: tuple) -> None:
    """ValueError for an example input in a channels_last format, naming it."""
    for k, x in enumerate(inputs):
        layout = layout_of(x)
        if layout in FORMATS:
            raise ValueError(
                f"example input {k} is laid out {layout}: monet-opt's memory model does not hold for "
                "channels_last activations yet (resnet18 b4 32x32, every state recomputed: 60.6 MB "
                "measured against 51.4 MB predicted). Pass it contiguous (x.contiguous()) and train "
                "with contiguous inputs"
            )


def differs(now: str, solved: str) -> bool:
    """Whether an input laid out `now` is refused by a schedule solved for `solved`: one dense
    format for another (a slice of either runs: its first reader copies it as it did)."""
    dense = {CONTIGUOUS, *FORMATS}
    return now != solved and now in dense and solved in dense
