"""torch's own transformer stacks (nn.TransformerEncoder / Decoder / Transformer) are traced
through in training mode (`graph.TRACED_IN_TRAINING`): each kept as one node, a whole encoder left
the solver nothing to recompute (its lowest peak was plain PyTorch's)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import solver
from monet_opt.bench import measure_step_peak
from monet_opt.graph import trace
from monet_opt.profile import build_problem
from monet_opt.runtime import MonetWrapper
from tests.test_runtime import assert_same_gradients, budget_at


class CausalEncoder(nn.Module):
    """A decoder-only language model's body: causal mask, dropout, pre-norm layers."""

    def __init__(self) -> None:
        super().__init__()
        layer = nn.TransformerEncoderLayer(64, 4, 128, dropout=0.1, batch_first=True, norm_first=True)
        self.body = nn.TransformerEncoder(layer, 3, norm=nn.LayerNorm(64), enable_nested_tensor=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(x.shape[1])
        return self.body(x, mask=mask, is_causal=True)


class Seq2Seq(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.t = nn.Transformer(64, 4, 2, 2, 128, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.t(x, x[:, :16])


@pytest.mark.parametrize("make", [CausalEncoder, Seq2Seq], ids=["encoder", "transformer"])
def test_torch_transformer_stacks_are_solved_layer_by_layer(make, monkeypatch, tmp_path):
    monkeypatch.setenv("MONET_OPT_CACHE", str(tmp_path))
    torch.manual_seed(0)
    model, x = make(), torch.randn(4, 32, 64)
    kinds = [n.kind for n in trace(model, (x,)).nodes]
    assert kinds.count("multiheadattention") in (3, 6) and "transformerencoderlayer" not in kinds
    problem = build_problem(model, (x,), progress=False, repeats=1)
    plain = solver.simulate(problem, solver.no_recompute(problem)).peak_bytes
    for fraction in (1.0, 0.0):
        schedule = solver.solve(problem, budget_at(problem, fraction), time_limit=4, verbose=False)
        wrapped = MonetWrapper(model, schedule, example_inputs=(x,))
        assert_same_gradients(model, wrapped, x, f"budget {fraction}")  # (dropout replayed)
        peak = measure_step_peak(wrapped, (x,))
        assert peak <= schedule.budget_bytes
    # (measured: encoder 0.99 MB at the lowest budget, 2.53 MB plain; as one node, 2.53 MB)
    assert schedule.predicted_peak_bytes < 0.6 * plain
