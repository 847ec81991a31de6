"""MonetWrapper under DistributedDataParallel (gloo, 2 processes on CPU)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from monet_opt.bench import loss_of, zero_grad
from monet_opt.profile import build_problem
from monet_opt.runtime import MonetWrapper
from solver import baselines
from tests import models


def _worker(rank: int, world: int, init_file: str, schedule_path: str, state: dict, xs, out_path: str):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        torch.set_num_threads(1)
        model, _ = models.resnet18(batch=2, size=32)
        model.load_state_dict(state)
        wrapped = MonetWrapper(model, schedule_path, example_inputs=(xs[rank],))
        ddp = torch.nn.parallel.DistributedDataParallel(wrapped)
        for _ in range(2):  # (the first step of a signature decides in place runs, the next replays)
            zero_grad(model)
            loss_of(ddp(xs[rank])).backward()
        if rank == 0:
            torch.save({n: p.grad for n, p in model.named_parameters()}, out_path)
    finally:
        dist.destroy_process_group()


def _two_ranks(worker, tmp_path, state: dict, xs, out) -> None:
    """Run worker(rank, 2, init file, tmp_path/schedule.json, state, xs, out) in 2 processes."""
    args = (2, str(tmp_path / "init"), str(tmp_path / "schedule.json"), state, xs, str(out))
    mp.spawn(worker, args=args, nprocs=2, join=True)


@pytest.mark.parametrize(
    "strategy, defer", [("checkpoint_all", False), ("no_recompute", False), ("no_recompute", True)]
)
def test_ddp_gradients_equal_single_process(tmp_path, strategy, defer):
    """Through the wrapper's own backward (a schedule that recomputes, or one that defers weight
    gradients to its end: `monet_opt.runtime.deferred`) and in the caller's graph (nothing
    recomputed: `ScheduleExecutor.attachable`), DDP averages plain's gradients."""
    torch.manual_seed(0)
    model, x = models.resnet18(batch=2, size=32)
    xs = [x, torch.randn_like(x)]
    problem = build_problem(model, (x,), progress=False, repeats=1, defer_weight_grads=defer)
    schedule = getattr(baselines, strategy)(problem)
    assert bool(schedule.recomputed()) == (strategy == "checkpoint_all")
    assert bool(schedule.meta.get("deferred_param_grads")) == defer
    attached = MonetWrapper(copy.deepcopy(model), schedule, example_inputs=(x,)).executor.attachable
    assert attached == (strategy == "no_recompute" and not defer)
    schedule.to_json(tmp_path / "schedule.json")
    state = copy.deepcopy(model.state_dict())

    # single process: the average of each rank's gradients (one thread, as in the workers,
    # so that kernels sum in the same order)
    expected: dict[str, torch.Tensor] = {}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    for xr in xs:
        m = copy.deepcopy(model)
        m.load_state_dict(state)
        loss_of(m(xr)).backward()
        for n, p in m.named_parameters():
            expected[n] = expected.get(n, 0) + p.grad / len(xs)
        zero_grad(m)
    torch.set_num_threads(threads)

    out = tmp_path / "grads.pt"
    _two_ranks(_worker, tmp_path, state, xs, out)
    got = torch.load(out)
    for n, g in expected.items():
        torch.testing.assert_close(got[n], g, rtol=1e-5, atol=1e-6, msg=f"grad of {n}")


def _step_worker(rank: int, world: int, init_file: str, schedule_path: str, state: dict, xs, out_path: str):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        torch.set_num_threads(1)
        params = {}
        for under_ddp in (False, True):
            model, _ = models.resnet18(batch=2, size=32)
            model.load_state_dict(state)
            wrapped = MonetWrapper(model, schedule_path, example_inputs=(xs[rank],), optimizer="adam")
            net = torch.nn.parallel.DistributedDataParallel(wrapped) if under_ddp else wrapped
            for _ in range(2):
                loss_of(net(xs[rank])).backward()
            params[under_ddp] = {n: p.detach().clone() for n, p in model.named_parameters()}
        torch.save(params, f"{out_path}.{rank}")
    finally:
        dist.destroy_process_group()


def test_ddp_with_the_step_in_the_backward_steps_with_the_averaged_gradient(tmp_path):
    """The optimizer step in the backward under torch.distributed: every rank steps each
    parameter with the gradient averaged over the ranks (before, each stepped with its own and
    the ranks' models drifted apart), with or without a DDP wrapper around the wrapper."""
    torch.manual_seed(0)
    model, x = models.resnet18(batch=2, size=32)
    xs = [x, torch.randn_like(x)]
    problem = build_problem(model, (x,), progress=False, repeats=1, optimizer="adam")
    schedule = baselines.checkpoint_all(problem)
    schedule.to_json(tmp_path / "schedule.json")
    state = copy.deepcopy(model.state_dict())

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    plain = copy.deepcopy(model)
    opt = torch.optim.Adam(plain.parameters(), lr=1e-3)
    for _ in range(2):
        for xr in xs:
            # (the mean of the ranks' losses: the mean of their gradients, BatchNorm per rank)
            (loss_of(plain(xr)) / len(xs)).backward()
        opt.step()
        zero_grad(plain)
    torch.set_num_threads(threads)

    out = tmp_path / "params"
    _two_ranks(_step_worker, tmp_path, state, xs, out)
    got = [torch.load(f"{out}.{rank}") for rank in range(2)]
    for under_ddp in (False, True):
        for n, p in plain.named_parameters():
            for rank in range(2):
                torch.testing.assert_close(
                    got[rank][under_ddp][n],
                    p.detach(),
                    rtol=1e-5,
                    atol=1e-6,
                    msg=f"ddp={under_ddp} rank {rank}: {n}",
                )
