"""Code a model runs under torch.no_grad() sends no gradient, traced as in plain PyTorch: its
values reach the rest of the graph detached (`monet_opt.no_grad`), its nodes have no backward,
and gradients equal plain PyTorch's, with and without recomputation. An in-place change under
no_grad of a value computed with gradients is refused by name."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import solver
from monet_opt.graph import TraceError, trace
from monet_opt.profile import build_problem
from monet_opt.runtime import MonetWrapper
from tests.test_runtime import assert_same_gradients, budget_at


class NormAsConstant(nn.Module):
    """A scale computed under no_grad: plain PyTorch sends no gradient through it."""

    def __init__(self, width: int = 64, blocks: int = 4) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(blocks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            y = F.gelu(layer(x))
            with torch.no_grad():
                scale = y.norm(dim=1, keepdim=True) + 1.0
            x = x + y / scale
        return x


class Distillation(nn.Module):
    """A frozen teacher and a mask built under no_grad, weighting a student's log-probabilities;
    the teacher reads a trained stem (before, the stem got the teacher's gradient too)."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(64, 64)
        self.teacher = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 16))
        self.teacher.requires_grad_(False)
        self.student = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.stem(x))
        with torch.no_grad():
            target = self.teacher(h).softmax(-1)
            mask = torch.zeros_like(target)
            mask[:, 0] = 1.0
        return self.student(h).log_softmax(-1) * target * (1.0 + mask)


class ClampsUnderNoGrad(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.a(x))
        with torch.no_grad():
            y.clamp_(max=1.0)
        return y * 2.0


@pytest.mark.parametrize("make", [NormAsConstant, Distillation])
@pytest.mark.parametrize("fraction", [1.0, 0.3])
def test_no_grad_code_sends_no_gradient(make, fraction, monkeypatch, tmp_path):
    """Before, the traced graph ran `scale` with gradients: NormAsConstant's gradients were 16 %
    off plain PyTorch's, with nothing recomputed."""
    monkeypatch.setenv("MONET_OPT_CACHE", str(tmp_path))
    torch.manual_seed(0)
    model, x = make(), torch.randn(256, 64)
    problem = build_problem(model, (x,), progress=False, repeats=1)
    no_grad_nodes = {
        n.name
        for n in trace(model, (x,)).gm.graph.nodes
        if n.meta.get("monet_opt_no_grad") and n.op != "placeholder"
    }
    assert no_grad_nodes
    backward = {n.name: n.requires_backward for n in problem.nodes}
    assert not any(backward[name] for name in no_grad_nodes if name in backward), backward
    schedule = solver.solve(problem, budget_at(problem, fraction), time_limit=10, verbose=False)
    wrapped = MonetWrapper(model, schedule, example_inputs=(x,))
    assert_same_gradients(model, wrapped, x, f"{make.__name__} at {fraction}")


def test_an_in_place_change_under_no_grad_of_a_value_with_gradients_is_refused():
    with pytest.raises(TraceError, match="'clamp_' changes 'relu' in place under torch.no_grad"):
        trace(ClampsUnderNoGrad(), torch.randn(4, 8))


class _Gelu(torch.autograd.Function):
    """Bloom's GELU is written this way: a custom Function, traced inline by fx."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return x * 0.5 * (1.0 + torch.tanh(0.79788456 * x * (1 + 0.044715 * x * x)))

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        t = torch.tanh(0.79788456 * x * (1 + 0.044715 * x * x))
        return g * (0.5 * (1 + t) + 0.5 * x * (1 - t * t) * 0.79788456 * (1 + 3 * 0.044715 * x * x))


class CustomFunctionInline(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(64, 64)
        self.b = nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.a(x)
        if y.shape[0] > 2:  # (shape-dependent Python: the concrete trace)
            y = y * 1.0
        return self.b(_Gelu.apply(y))


def test_a_custom_functions_forward_is_not_no_grad_code(monkeypatch, tmp_path):
    """A custom autograd.Function's forward runs with gradients off, set in C++; fx traces it
    inline. Its nodes were marked as the model's no_grad code and detached: Hugging Face Bloom's
    gradients stopped at its GELUs (model_sweep: word embeddings 0.000586 off). Only grad mode
    set from Python marks nodes now."""
    monkeypatch.setenv("MONET_OPT_CACHE", str(tmp_path))
    torch.manual_seed(0)
    model, x = CustomFunctionInline(), torch.randn(256, 64)
    graph = trace(model, (x,))
    assert not [n.name for n in graph.gm.graph.nodes if n.meta.get("monet_opt_no_grad")]
    problem = build_problem(model, (x,), progress=False, repeats=1)
    schedule = solver.solve(problem, budget_at(problem, 0.3), time_limit=10, verbose=False)
    assert_same_gradients(model, MonetWrapper(model, schedule, example_inputs=(x,)), x, "custom Function")


class AllUnderNoGrad(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(64, 64) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            with torch.no_grad():
                y = torch.nn.functional.gelu(layer(x))
            x = y + x
        return x


def test_a_model_with_nothing_needing_a_backward_gets_a_clear_answer(monkeypatch, tmp_path):
    """Nothing needs a backward, so nothing is kept for one: a budget under the plain peak is
    infeasible, and says why (the MILP, built for backward stages, failed with an IndexError)."""
    monkeypatch.setenv("MONET_OPT_CACHE", str(tmp_path))
    torch.manual_seed(0)
    model, x = AllUnderNoGrad(), torch.randn(512, 64)
    problem = build_problem(model, (x,), progress=False, repeats=1)
    assert not any(n.requires_backward for n in problem.nodes)
    from solver.bounds import min_feasible_lower_bound

    plain = solver.simulate(problem, solver.baselines.no_recompute(problem)).peak_bytes
    assert min_feasible_lower_bound(problem) < plain
    with pytest.raises(solver.InfeasibleBudget, match="nothing in the model needs a backward") as info:
        solver.solve(problem, (min_feasible_lower_bound(problem) + plain) // 2, time_limit=5, verbose=False)
    assert (
        info.value.minimum_bytes
        == solver.simulate(problem, solver.baselines.no_recompute(problem)).peak_bytes
    )
    assert solver.solve(problem, 1.0, time_limit=5, verbose=False).solver.status == "optimal"
