"""Example inputs by keyword (`monet_opt.keyword_inputs`): a model whose forward takes named
inputs and returns a dict, traced, solved and trained through a root that takes them by name."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import solver
from monet_opt.bench import measure_step, zero_grad
from monet_opt.graph import trace
from monet_opt.keyword_inputs import as_traceable, loss_positions
from monet_opt.pipeline import solve_model
from monet_opt.profile import build_problem
from monet_opt.runtime import MonetWrapper
from solver import baselines
from tests.test_runtime import LOSS_SCALARS, assert_grads_close, budget_at


class TwoHeads(nn.Module):
    """Named inputs (one optional), a constant, and a dict output with no loss."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU())
        self.a = nn.Linear(256, 8)
        self.b = nn.Linear(256, 4)

    def forward(self, x, mask=None, scale: float = 1.0):
        h = self.body(x)
        if mask is not None:
            h = h * mask
        return {"a": self.a(h) * scale, "b": self.b(h)}


def test_keyword_inputs_trace_solve_and_train_with_plain_gradients():
    torch.manual_seed(0)
    model = TwoHeads().train()
    # (large enough that the runtime's 64-KiB reserve is noise)
    x, mask = torch.randn(512, 64), (torch.rand(512, 256) > 0.3).float()
    inputs = {"x": x, "mask": mask, "scale": 2.0}
    g = trace(model, inputs)
    assert [n.name for n in g.gm.graph.nodes if n.op == "placeholder"] == ["x", "mask"]
    problem = build_problem(model, inputs, progress=False, repeats=1)
    # no 'loss' in the output: the loss may read every output
    assert all(n.output_grad for n in problem.nodes) and "grad_outputs" not in problem.meta
    _, schedule = solve_model(
        model, inputs, budget_at(problem, 0.3), time_limit=10, verbose=False, problem=problem
    )
    wrapped = MonetWrapper(model, schedule, example_inputs=inputs)
    plain = TwoHeads()
    plain.load_state_dict(model.state_dict())
    for call in ("keywords", "positional"):
        zero_grad(model)
        zero_grad(plain)
        out = wrapped(x=x, mask=mask, scale=2.0) if call == "keywords" else wrapped(x, mask)
        expected = plain(x, mask=mask, scale=2.0)
        assert isinstance(out, dict) and list(out) == ["a", "b"]
        (out["a"].square().sum() + out["b"].sum()).backward()
        (expected["a"].square().sum() + expected["b"].sum()).backward()
        for (name, p), q in zip(model.named_parameters(), plain.parameters()):
            assert_grads_close(p.grad, q.grad, f"{call}: grad of {name}")
    zero_grad(model)
    peak, _ = measure_step(wrapped, (x, mask), steps=1)
    predicted = solver.simulate(problem, schedule).peak_bytes
    assert peak <= schedule.budget_bytes + LOSS_SCALARS
    assert abs(peak - predicted) <= 0.05 * predicted, f"measured {peak} vs predicted {predicted}"
    with pytest.raises(ValueError, match="traced with scale=2.0"):
        wrapped(x=x, mask=mask, scale=3.0)
    # the schedule was solved with the mask given: leaving it out is refused by name
    with pytest.raises(TypeError, match="'mask'"):
        wrapped(x=x)
    # example tensors in the order of the names the schedule was solved with are those inputs
    again = MonetWrapper(model, schedule, example_inputs=(x, mask))
    assert list(again(x, mask=mask, scale=2.0)) == ["a", "b"]


def test_bad_keyword_inputs_are_named():
    model = TwoHeads()
    x = torch.randn(2, 64)
    with pytest.raises(ValueError, match="empty mapping"):
        as_traceable(model, {})
    with pytest.raises(ValueError, match="no tensor"):
        as_traceable(model, {"scale": 1.0})
    with pytest.raises(TypeError, match="'mask' is a list"):
        as_traceable(model, {"x": x, "mask": [1, 2]})
    with pytest.raises(ValueError, match="'class'"):
        as_traceable(model, {"x": x, "class": 1})
    with pytest.raises(ValueError, match="'self'"):
        as_traceable(model, {"self": x})
    root, inputs = as_traceable(model, {"x": x})
    assert inputs == (x,) and root.names == ("x",)
    # any mapping (a tokenizer's BatchEncoding is a UserDict)
    from collections import UserDict

    root, inputs = as_traceable(model, UserDict({"x": x, "scale": 2.0}))
    assert inputs == (x,) and root.names == ("x",) and root.constants == {"scale": 2.0}
    assert as_traceable(model, (x,)) == (model, (x,))


def test_loss_positions_find_a_returned_loss():
    from torch.utils._pytree import tree_flatten

    t = torch.zeros(())
    assert loss_positions(tree_flatten({"logits": t, "loss": t})[1]) == [1]
    assert loss_positions(tree_flatten({"loss": (t, t)})[1]) is None  # not one tensor
    assert loss_positions(tree_flatten((t, t))[1]) is None
    assert loss_positions(tree_flatten({"a": [t, t], "loss": t})[1]) == [2]


class BatchDict(nn.Module):
    """forward(batch): a dict of tensors and a flag, as training code often passes batches;
    returns a dict."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(64, 64), nn.Linear(64, 64), nn.Linear(64, 8)

    def forward(self, batch: dict) -> dict:
        h = torch.nn.functional.gelu(self.b(torch.tanh(self.a(batch["x"]) + batch["noise"])))
        return {"logits": self.c(h), "scaled": batch["scale"] * h.mean()}


class Views(nn.Module):
    """forward(views): a list of augmented views through one encoder."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64))

    def forward(self, views: list) -> torch.Tensor:
        return sum(self.enc(v) for v in views)


def _batch(n: int = 128) -> dict:
    return {"x": torch.randn(n, 64), "noise": torch.randn(n, 64), "scale": 2.0}


@pytest.mark.parametrize(
    "make, inputs", [(BatchDict, _batch), (Views, lambda n=128: [torch.randn(n, 64)] * 2)]
)
def test_positional_inputs_holding_containers_trace_solve_and_train(make, inputs, monkeypatch, tmp_path):
    """model(batch) with a dict, model(views) with a list: as_traceable failed ('dict' object has
    no attribute 'device'). A StructuredRoot takes their tensors flat and rebuilds them."""
    monkeypatch.setenv("MONET_OPT_CACHE", str(tmp_path))
    torch.manual_seed(0)
    model, example = make(), inputs()
    problem = build_problem(model, (example,), progress=False, repeats=1)
    schedule = solver.solve(problem, budget_at(problem, 0.0), time_limit=10, verbose=False)
    assert schedule.recomputed()
    wrapped = MonetWrapper(model, schedule, example_inputs=(example,))
    plain = BatchDict() if make is BatchDict else Views()
    plain.load_state_dict(model.state_dict())
    for batch in (example, inputs(100)):  # (and a smaller batch)
        out, expected = wrapped(batch), plain(batch)
        assert type(out) is type(expected)
        loss = (lambda o: o["logits"].sum() + o["scaled"]) if make is BatchDict else (lambda o: o.sum())
        loss(out).backward()
        loss(expected).backward()
        for (name, p), q in zip(model.named_parameters(), plain.parameters()):
            assert_grads_close(p.grad, q.grad, name)
        zero_grad(model)
        zero_grad(plain)
    if make is BatchDict:
        with pytest.raises(TypeError, match="structured as"):
            wrapped({**example, "scale": 3.0})
        with pytest.raises(ValueError, match="pass example_inputs"):
            MonetWrapper(
                model, solve_model(model, (example,), 1.0, time_limit=5, verbose=False, problem=problem)[1]
            )


def test_hooks_on_the_model_itself_run_around_the_step_as_in_plain_pytorch(monkeypatch, tmp_path):
    """Hooks on the model itself (not on a submodule) are outside fx's trace of its forward: the
    trace's check compared the graph with the hooked model and refused it ("differs from the eager
    model"). They now run around the wrapped step as `model(...)` runs them around its forward:
    a pre-hook changing a keyword input, a forward hook changing the output, a full backward hook
    (on a model returning a tensor: torch calls none for a dict)."""
    monkeypatch.setenv("MONET_OPT_CACHE", str(tmp_path))
    torch.manual_seed(0)
    x, mask = torch.randn(64, 64), (torch.rand(64, 256) > 0.3).float()
    calls = []
    nets = {}
    for tag in ("wrapped", "plain"):
        torch.manual_seed(0)
        nets[tag] = two_heads, chain = (
            TwoHeads(),
            nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 8)),
        )
        two_heads.register_forward_pre_hook(
            lambda mod, args, kw: (args, {**kw, "x": kw["x"] * 2}), with_kwargs=True
        )
        two_heads.register_forward_hook(
            lambda mod, args, out, tag=tag: calls.append(tag) or {**out, "b": out["b"] + 1}
        )
        chain.register_full_backward_hook(lambda mod, grad_in, grad_out, tag=tag: calls.append(tag))
    inputs = {"x": x, "mask": mask}
    wrapped = {}
    for model, example in zip(nets["wrapped"], (inputs, (x,))):
        problem = build_problem(model, example, progress=False, repeats=1)
        wrapped[model] = MonetWrapper(model, baselines.checkpoint_all(problem), example_inputs=example)
    assert len(nets["wrapped"][0]._forward_hooks) == 1  # (put back after tracing)
    for step in range(2):  # (the second with the hooks' count unchanged: not traced again)
        model, plain = nets["wrapped"][0], nets["plain"][0]
        out, expected = wrapped[model](x=x, mask=mask), plain(x=x, mask=mask)
        for k in expected:
            torch.testing.assert_close(out[k], expected[k], rtol=1e-6, atol=1e-6)
        (out["a"].square().sum() + out["b"].sum()).backward()
        (expected["a"].square().sum() + expected["b"].sum()).backward()
        model, plain = nets["wrapped"][1], nets["plain"][1]
        with pytest.warns(UserWarning, match="Full backward hook"):  # (no input requires grad)
            wrapped[model](x).square().sum().backward()
            plain(x).square().sum().backward()
        for tag in ("wrapped", "plain"):
            assert calls.count(tag) == 2 * (step + 1)
        for model, plain in zip(nets["wrapped"], nets["plain"]):
            for (name, p), q in zip(model.named_parameters(), plain.parameters()):
                assert_grads_close(p.grad, q.grad, f"step {step}: grad of {name}")
            zero_grad(model)
            zero_grad(plain)


def test_global_module_hooks_are_warned_about_once(monkeypatch, tmp_path):
    """torch's global module hooks run at every module's call; a wrapped step runs them where
    its graph calls a module whole (at each call: again when recomputed), not for modules it
    traced through: it warns, once, naming the kinds registered."""
    monkeypatch.setenv("MONET_OPT_CACHE", str(tmp_path))
    torch.manual_seed(0)
    model, x = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4)), torch.randn(8, 16)
    problem = build_problem(model, (x,), progress=False, repeats=1)
    wrapped = MonetWrapper(model, baselines.checkpoint_all(problem), example_inputs=(x,))
    calls = []
    handle = torch.nn.modules.module.register_module_forward_hook(lambda mod, args, out: calls.append(mod))
    try:
        with pytest.warns(RuntimeWarning, match="global module forward hooks are registered"):
            wrapped(x).sum().backward()
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)
            wrapped(x).sum().backward()  # (once)
    finally:
        handle.remove()
    # the wrapper's own call each step; the Linears and Tanh at each call of their node, so once
    # more where the schedule recomputes them (plain: each module once a step)
    assert sum(m is wrapped for m in calls) == 2 and len(calls) > 2 * 4, calls
