"""The memory format of the model's input tensors and of its convolution weights: recorded when a
problem is profiled, the inputs' checked at every wrapped step, the weights' when a wrapper is
made.

A channels_last input makes every convolution after it run channels_last, with other kernels
and other temporaries: resnet18 b4 64x64 solved for contiguous inputs and fed channels_last
ones measured 62.5 MB against a 48.0 MB budget (gradients equal). The fingerprint holds shapes
and dtypes, not strides, so the wrapper checks the formats itself.

A model and its inputs both channels_last (`model.to(memory_format=torch.channels_last)`, as
torch recommends) solve and train within the memory model (resnet18 b4 32x32, every state
recomputed: 47.9 MB measured against 48.1 MB predicted; b16 64x64 at 60 MiB: 0.994 of the
prediction), as does a channels_last model fed contiguous inputs, and a contiguous model fed
channels_last inputs (its convolutions run channels_last; refused in sessions 43-45, measured
up to 7 % over the prediction, until the executor copied weight gradients made channels_last into
their parameters' layout where plain PyTorch does: `runtime.executor._laid_out_as_param`).
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


def weight_layout(model: torch.nn.Module, dim: int) -> str:
    """The format of the model's `dim`-dimensional floating parameters (convolution weights):
    'contiguous' (or none), 'channels_last' / 'channels_last_3d' (every one that tells the two
    apart), or 'mixed: NAME' naming a contiguous one among channels_last ones. A weight whose
    kernel and input channels are 1 is both, and does not count."""
    fmt = torch.channels_last if dim == 4 else torch.channels_last_3d
    last, contiguous = [], []
    for name, p in model.named_parameters():
        if p.dim() != dim or not p.is_floating_point():
            continue
        is_last, is_contiguous = p.is_contiguous(memory_format=fmt), p.is_contiguous()
        if is_last and not is_contiguous:
            last.append(name)
        elif is_contiguous and not is_last:
            contiguous.append(name)
    if not last:
        return CONTIGUOUS
    name = "channels_last" if dim == 4 else "channels_last_3d"
    return f"mixed: {contiguous[0]}" if contiguous else name


def weight_layouts(model: torch.nn.Module) -> dict[str, str]:
    """{'4': layout, '5': layout} of the model's 4- and 5-dimensional weights (`weight_layout`,
    'mixed' without the name: a root around the model prefixes it)."""
    return {str(dim): weight_layout(model, dim).split(":")[0] for dim in (4, 5)}


def differs(now: str, solved: str) -> bool:
    """Whether an input laid out `now` is refused by a schedule solved for `solved`: one dense
    format for another (a slice of either runs: its first reader copies it as it did)."""
    dense = {CONTIGUOUS, *FORMATS}
    return now != solved and now in dense and solved in dense
