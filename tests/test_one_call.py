"""A recomputing schedule run inside the caller's one backward call (`monet_opt/runtime/one_call.py`,
an experiment, on with MONET_OPT_ONE_CALL=1): plain PyTorch's gradients and BatchNorm statistics,
the peak within the budget and 5 % of the prediction, no executor backward step, deferred weight
gradients, and the cases it leaves to the executor."""

import copy

import pytest
import torch

import solver
from monet_opt.bench import loss_of, zero_grad
from monet_opt.runtime import MonetWrapper, one_call
from monet_opt.runtime.one_call import OneCall
from solver import baselines


@pytest.fixture
def on(monkeypatch):
    monkeypatch.setattr(one_call, "_ON", True)


def _runs_in_one_call(wrapped, x, monkeypatch) -> None:
    """One step of `wrapped` runs in the caller's graph: its output is the model's own autograd
    node (not the wrapper's), and the executor's backward never runs."""

    def no_backward_step(run, name):
        raise AssertionError(f"the executor ran {name!r}'s backward")

    monkeypatch.setattr(wrapped.executor, "backward", no_backward_step)
    out = wrapped(x)
    assert type(out.grad_fn).__name__ != "_StashBackward"
    loss_of(out).backward()
    zero_grad(wrapped)
    monkeypatch.undo()  # (the fixture's too: put back below by the caller if needed)
    monkeypatch.setattr(one_call, "_ON", True)
    assert isinstance(wrapped.executor.one_call, OneCall)


@pytest.mark.parametrize("name", ["resnet18", "googlenet", "gpt"])
@pytest.mark.parametrize("strategy", ["chen_sqrt", "multilevel"])
def test_a_recomputing_schedule_runs_in_one_backward_call(name, strategy, on, monkeypatch):
    from tests.test_runtime import check_schedule, setup

    model, x, problem = setup(name)
    schedule = getattr(baselines, strategy)(problem)
    assert schedule.recomputed()
    _runs_in_one_call(MonetWrapper(copy.deepcopy(model), schedule, example_inputs=(x,)), x, monkeypatch)
    check_schedule(name, schedule)  # (gradients, statistics, peak; a wrapper of its own)


def test_deferred_weight_gradients_in_one_backward_call(on, monkeypatch):
    """Deferred weight gradients are made when the engine's call ends, as plain PyTorch's; a hook
    on a deferred parameter (which the engine would not run) sends the step to the executor,
    where it runs once."""
    from tests.test_deferred_param_grads import check_schedule_on, deferred_setup
    from tests.test_runtime import budget_at, check_schedule

    model, x, problem = deferred_setup("resnet18")
    schedule = baselines.checkpoint_all(problem)
    deferred = schedule.meta["deferred_param_grads"]
    assert deferred
    wrapped = MonetWrapper(copy.deepcopy(model), schedule, example_inputs=(x,))
    _runs_in_one_call(wrapped, x, monkeypatch)
    check_schedule_on("resnet18 checkpoint_all", model, x, problem, schedule, check_schedule)
    solved = solver.solve(problem, budget_at(problem, 0.4), time_limit=5, verbose=False)
    check_schedule_on("resnet18 0.4", model, x, problem, solved, check_schedule)

    plain = copy.deepcopy(model)
    ours = copy.deepcopy(model)
    wrapped = MonetWrapper(ours, schedule, example_inputs=(x,))
    calls = {"plain": 0, "ours": 0}
    for tag, net in (("plain", plain), ("ours", ours)):
        param = dict(net.named_parameters())[f"{deferred[0].replace('_', '.')}.weight"]

        def count(g, tag=tag):
            calls[tag] += 1

        param.register_hook(count)
    assert not OneCall(wrapped.executor).usable()
    for net in (plain, wrapped):
        zero_grad(net)
        torch.manual_seed(1)
        loss_of(net(x)).backward()
    assert calls == {"plain": 1, "ours": 1}
    for (n, pa), pb in zip(plain.named_parameters(), ours.parameters()):
        torch.testing.assert_close(pb.grad, pa.grad, rtol=1e-5, atol=1e-5, msg=f"gradient of {n}")


def test_a_second_backward_is_a_clear_error(on):
    from tests.test_runtime import setup

    model, x, problem = setup("resnet18")
    wrapped = MonetWrapper(model, baselines.chen_sqrt(problem), example_inputs=(x,))
    loss = loss_of(wrapped(x))
    loss.backward(retain_graph=True)
    assert isinstance(wrapped.executor.one_call, OneCall)
    with pytest.raises(RuntimeError, match="retain_graph=True and a second backward"):
        loss.backward()
    zero_grad(wrapped)


def test_off_by_default_and_left_to_the_executor_where_it_cannot_run(monkeypatch):
    from tests.test_runtime import setup

    model, x, problem = setup("resnet18")
    wrapped = MonetWrapper(model, baselines.chen_sqrt(problem), example_inputs=(x,))
    assert one_call.why_not(wrapped.executor).startswith("off")
    loss_of(wrapped(x)).backward()
    assert wrapped.executor.one_call is None
    zero_grad(wrapped)
    monkeypatch.setattr(one_call, "_ON", True)
    kept_again = solver.Schedule.from_dict(
        {
            **baselines.no_recompute(problem).to_dict(),
        }
    )
    # a node whose state the forward keeps and a backward stage makes again: refused, named
    stages = list(kept_again.stages)
    node = next(s.node for s in stages[0].steps if s.op == "compute" and s.grad)
    last = stages[-1]
    stages[-1] = solver.Stage(last.name, (solver.Step("compute", node, "default", True), *last.steps))
    import dataclasses

    again = dataclasses.replace(kept_again, stages=tuple(stages))
    other = MonetWrapper(model, again, example_inputs=(x,))
    assert node in one_call.why_not(other.executor)
