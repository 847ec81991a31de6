"""Linear layers and matrix products: default only.

On CPU and CUDA alike, the backward of a linear/matmul needs both operands (input for the weight
gradient, weight for the input gradient); no cheaper storage variant exists without extra compute
comparable to recomputing the op, which the solver already models. Listed for completeness.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .base import Implementation
from .common import out_of_place_default

_FUNCTIONS = (F.linear, torch.matmul, torch.mm, torch.bmm, torch.addmm)


def matches(op: str, target: Any) -> bool:
    if op == "call_module":
        return isinstance(target, (nn.Linear, nn.Bilinear))
    if op == "call_method":
        return target in ("matmul", "mm", "bmm")
    return any(target is f for f in _FUNCTIONS)


def implementations(op: str, target: Any, example_args=None, example_kwargs=None) -> list[Implementation]:
    return [
        Implementation(
            "default",
            out_of_place_default(op, target).run,
            "torch linear/matmul; backward keeps input (and weight)",
        )
    ]


IMPLEMENTATION_NAMES = {"linear / matmul (nn.Linear, F.linear, matmul, mm, bmm)": ["default"]}
