"""A model that trains with some submodules in eval mode (frozen BatchNorms when fine-tuning)
keeps them so through tracing, profiling and calibration: monet-opt never flattens the modes."""

from __future__ import annotations

import torch
import torchvision
from torch import nn

from monet_opt.graph import trace
from monet_opt.profile import build_problem
from monet_opt.train_modes import training_modes
from tests.test_transformers_timm import _check


def _frozen_bn_resnet18() -> nn.Module:
    torch.manual_seed(0)
    model = torchvision.models.resnet18(weights=None, num_classes=10).train()
    for name, m in model.named_modules():
        if isinstance(m, nn.BatchNorm2d) and name.startswith(("bn1", "layer1", "layer2")):
            m.eval()  # running statistics used, not updated
            m.weight.requires_grad_(False)
            m.bias.requires_grad_(False)
    return model


def test_frozen_batch_norms_stay_frozen_and_train_within_budget():
    model = _frozen_bn_resnet18()
    modes = training_modes(model)
    assert not all(modes.values()) and any(modes.values())
    x = torch.randn(4, 3, 64, 64)
    trace(model, (x,))
    assert training_modes(model) == modes, "tracing changed a submodule's mode"
    build_problem(model, (x,), progress=False, repeats=1, calibrate=True)
    assert training_modes(model) == modes, "profiling or calibration changed a submodule's mode"
    stats = {k: v.clone() for k, v in model.state_dict().items() if "running" in k}
    # solved, wrapped: plain PyTorch's gradients (the plain copy trains with the frozen norms),
    # inside the budget and within 5 % of the prediction
    _check(model, x, 0.4, "frozen BatchNorms", example_inputs=(x,))
    assert training_modes(model) == modes
    frozen = [k for k in stats if k.startswith(("bn1", "layer1", "layer2"))]
    assert frozen and all(torch.equal(model.state_dict()[k], stats[k]) for k in frozen)
    assert not all(torch.equal(model.state_dict()[k], stats[k]) for k in stats if k not in frozen)


def test_a_model_in_eval_mode_is_profiled_in_training_mode_and_left_in_eval():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Dropout(0.5), nn.Linear(8, 2)).eval()
    x = torch.randn(16, 8)
    problem = build_problem(model, (x,), progress=False, repeats=1)
    assert not any(training_modes(model).values())
    # profiled as it trains: the dropout draws a mask and keeps it (in eval mode it is the identity)
    (dropout,) = [n for n in problem.nodes if n.op == "dropout"]
    assert problem.meta["random_nodes"] == [dropout.name] and dropout.impls[0].state_bytes > 0
