"""A model's own `torch.autocast` blocks run under their autocast in a wrapped step, whatever
autocast the caller has around it (`monet_opt.autocast_regions`): in bfloat16 where the block
turns it on (before: trace failed, its graph computed in float32), in float32 where it turns it
off inside a caller's bfloat16 autocast (before: bfloat16), recomputed as first computed."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import solver
from monet_opt.autocast_regions import AUTOCAST
from monet_opt.bench import loss_of, zero_grad
from monet_opt.graph import trace
from monet_opt.profile import build_problem
from monet_opt.runtime import MonetWrapper
from tests.test_runtime import budget_at


class HalfInBfloat16(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(64, 64) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            for layer in self.layers[:2]:
                x = F.gelu(layer(x))
        x = x.float()
        for layer in self.layers[2:]:
            x = F.gelu(layer(x)) + x
        return x


class SoftmaxInFloat32(nn.Module):
    """Trained under the caller's bfloat16 autocast, with the attention's softmax and product kept
    in float32."""

    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(32, 32)
        self.k = nn.Linear(32, 32)
        self.out = nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = self.q(x) @ self.k(x).transpose(1, 2)
        with torch.autocast("cpu", enabled=False):
            mixed = (scores.float() * 0.17).softmax(-1) @ x
        return self.out(mixed)


def _check_step(model, x, schedule, caller_autocast: bool, rtol: float, atol: float) -> None:
    """One step of the wrapped model and of a plain copy (under the caller's bfloat16 autocast if
    asked): outputs bit for bit, parameter gradients within (rtol, atol)."""
    plain = copy.deepcopy(model)
    wrapped = MonetWrapper(model, schedule, example_inputs=(x,))
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=caller_autocast):
        out_plain, out_wrapped = plain(x), wrapped(x)
        torch.testing.assert_close(out_wrapped, out_plain, rtol=0, atol=0)
        loss_of(out_plain).backward()
        loss_of(out_wrapped).backward()
    expected = dict(plain.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, expected[name].grad, rtol=rtol, atol=atol, msg=name)
    zero_grad(model)


@pytest.mark.parametrize("fraction", [1.0, 0.0])
def test_a_bfloat16_block_runs_in_bfloat16(fraction, monkeypatch, tmp_path):
    monkeypatch.setenv("MONET_OPT_CACHE", str(tmp_path))
    torch.manual_seed(0)
    model, x = HalfInBfloat16(), torch.randn(128, 64)
    graph = trace(model, (x,))
    inside = [n.name for n in graph.gm.graph.nodes if AUTOCAST in n.meta]
    assert inside == ["layers_0", "gelu", "layers_1", "gelu_1"], inside
    problem = build_problem(model, (x,), progress=False, repeats=1)
    schedule = solver.solve(problem, budget_at(problem, fraction), time_limit=10, verbose=False)
    _check_step(model, x, schedule, caller_autocast=False, rtol=1e-5, atol=1e-6)


def test_a_float32_block_stays_float32_under_the_callers_autocast(monkeypatch, tmp_path):
    monkeypatch.setenv("MONET_OPT_CACHE", str(tmp_path))
    torch.manual_seed(0)
    model, x = SoftmaxInFloat32(), torch.randn(16, 24, 32)
    problem = build_problem(model, (x,), progress=False, repeats=1)
    schedule = solver.solve(problem, 1.0, time_limit=10, verbose=False)
    # (gradients through bfloat16 kernels within bfloat16's rounding, as in test_runtime's
    # test_autocast_bf16_runs)
    _check_step(model, x, schedule, caller_autocast=True, rtol=1e-2, atol=1e-3)
