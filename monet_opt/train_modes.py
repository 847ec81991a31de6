"""Each submodule's own train/eval mode, kept through profiling, tracing and calibration.

`model.train()` sets every submodule's mode, and a user's model is often meant to train with some
of them in eval mode (a frozen BatchNorm when fine-tuning): monet-opt records every module's
mode and puts each back, never flattening them into the top-level one.
"""

from __future__ import annotations

from torch import nn


def training_modes(model: nn.Module) -> dict[str, bool]:
    """Every module's `training` flag, by its name in `model` ('' is the model itself)."""
    return {name: m.training for name, m in model.named_modules(remove_duplicate=False)}


def restore_training_modes(model: nn.Module, modes: dict[str, bool]) -> None:
    """Set each module named in `modes` back to its recorded flag (others are left alone)."""
    for name, m in model.named_modules(remove_duplicate=False):
        if name in modes:
            m.training = modes[name]


def training_for_profile(model: nn.Module) -> dict[str, bool]:
    """Put `model` in the mode a training step runs in and return the modes to restore.

    A model in training mode stays as it is, submodules in eval mode included (they train that
    way); a model in eval mode is switched to training mode whole, as `model.train()` would."""
    modes = training_modes(model)
    if not model.training:
        model.train()
    return modes
