"""Measurement tools: the step breakdown (node timer, measured and predicted parts), page
faults, and keeping freed memory in the process."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import textwrap

import pytest
import torch

import solver
from monet_opt.bench import bench_model, measure_parts, predicted_parts
from monet_opt.node_timer import BACKWARD, FORWARD, RECOMPUTE, NodeTimer
from monet_opt.profile import build_problem
from monet_opt.runtime import MonetWrapper
from solver import baselines
from tests import models


@pytest.fixture(scope="module")
def narrow():
    torch.manual_seed(0)
    model, x = models.narrow_resnet(batch=4, size=32)
    model.train()
    problem = build_problem(model, (x,), progress=False, repeats=1)
    return model, x, problem


def test_simulator_splits_time_into_forward_recompute_backward(narrow):
    _, _, problem = narrow
    plain = baselines.no_recompute(problem)
    r = solver.simulate(problem, plain)
    by_name = {n.name: n for n in problem.nodes}
    forward = sum(
        next(im for im in by_name[s.node].impls if im.name == s.impl).fwd_time
        for s in plain.stages[0].steps
        if s.op == "compute"
    )
    assert r.forward_time_s == pytest.approx(forward) and r.recompute_time_s == 0.0
    sqrt = baselines.chen_sqrt(problem)
    r = solver.simulate(problem, sqrt)
    assert r.recompute_time_s > 0 and r.forward_time_s == pytest.approx(forward)
    parts = predicted_parts(problem, sqrt)
    assert parts.recompute_s == r.recompute_time_s and parts.other_s == pytest.approx(0.0, abs=1e-12)
    assert parts.forward_s + parts.recompute_s + parts.backward_s == pytest.approx(r.time_s)


def test_measured_parts_follow_the_schedule(narrow):
    """Recomputation is timed only where the schedule recomputes; the parts add up to no more than
    the step; the timer leaves the executor's own methods in place afterwards."""
    model, x, problem = narrow
    for schedule, recomputes in (
        (baselines.no_recompute(problem), False),
        (baselines.chen_sqrt(problem), True),
    ):
        wrapped = MonetWrapper(model, schedule, example_inputs=(x,))
        parts = measure_parts(wrapped, (x,), steps=2)
        assert parts.forward_s > 0 and parts.backward_s > 0
        assert (parts.recompute_s > 0) == recomputes
        assert parts.forward_s + parts.recompute_s + parts.backward_s <= parts.step_s
        assert not {"compute", "backward", "_run_stage", "_run_segment"} & set(wrapped.executor.__dict__)
        assert all(p.grad is None for p in model.parameters())


def test_node_timer_counts_each_call_by_kind(narrow):
    model, x, problem = narrow
    schedule = baselines.chen_sqrt(problem)
    wrapped = MonetWrapper(model, schedule, example_inputs=(x,))
    wrapped.executor.separate_graphs()  # one compute and one backward call per node
    timer = NodeTimer(wrapped.executor, (x,))
    timer.recording = True
    from monet_opt.bench import training_step, zero_grad

    training_step(wrapped, (x,))
    zero_grad(model)
    timer.close()
    recomputed = schedule.recomputed()
    assert set(timer.medians(RECOMPUTE)) == set(recomputed)
    assert sum(len(v) for (k, _), v in timer.times.items() if k == RECOMPUTE) == sum(recomputed.values())
    assert set(timer.medians(FORWARD)) == {s.node for s in schedule.stages[0].steps if s.op == "compute"}
    assert timer.total(BACKWARD) > 0


def test_bench_reports_paired_quartiles_and_page_faults(narrow):
    model, x, problem = narrow
    res = bench_model(model, (x,), baselines.chen_sqrt(problem), steps=3, name="narrow")
    q1, med, q3 = res.ratio_quartiles
    assert 0 < q1 <= med <= q3
    assert res.plain_page_faults >= 0 and res.wrapped_page_faults >= 0
    table = res.table()
    assert "paired; quartiles" in table and "page faults per step" in table


def test_bench_of_a_step_in_backward_schedule_has_one_baseline(narrow):
    """Peak and time against the same plain model: the one with the step in its backward, whose
    peak the schedule's budget fractions are of (the unfused model's holds every gradient)."""
    from monet_opt.bench import measure_step_peak

    model, x, _ = narrow
    problem = build_problem(model, (x,), progress=False, repeats=1, optimizer="sgd")
    schedule = baselines.no_recompute(problem)
    schedule = dataclasses.replace(schedule, meta={"step_in_backward": problem.meta["step_in_backward"]})
    res = bench_model(model, (x,), schedule, steps=1, name="narrow")
    assert res.plain_name == "plain PyTorch + sgd step in backward"
    predicted_plain = baselines.no_recompute(problem).predicted_peak_bytes
    assert abs(res.plain_peak_bytes - predicted_plain) <= 0.05 * predicted_plain
    assert res.plain_peak_bytes < measure_step_peak(model, (x,))
    assert "vs plain PyTorch + sgd step in backward" in res.table()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt: Linux only")
def test_keep_freed_memory_stops_the_kernel_handing_out_fresh_pages():
    """A tensor made and freed, one MiB larger each round: with glibc's default thresholds each
    round's block is mapped afresh and faults in all its pages; kept, a round reuses the freed
    block and faults in only the growth. Each case in its own process (mallopt is process-wide)."""
    code = textwrap.dedent(
        """
        import sys, torch
        from monet_opt.malloc import keep_freed_memory, page_faults
        if sys.argv[1] == "keep":
            assert keep_freed_memory()
        counts = []
        for i in range(8):
            before = page_faults()
            a = torch.ones((20 + i) * 2**18)
            del a
            counts.append(page_faults() - before)
        print(sum(counts[3:]))
        """
    )

    def faults(mode: str) -> int:
        out = subprocess.run([sys.executable, "-c", code, mode], capture_output=True, text=True, check=True)
        return int(out.stdout.split()[-1])

    default, kept = faults("default"), faults("keep")
    assert default > 0.9 * sum((20 + i) * 256 for i in range(3, 8))  # every page of rounds 3-7
    assert kept < default / 4


def test_step_parts_plot_stacks_each_part():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from monet_opt import plots
    from monet_opt.bench import StepParts

    bars = [
        ("measured", StepParts(0.1, 0.05, 0.2, 0.4)),
        ("predicted", {"forward_s": 0.1, "recompute_s": 0.0, "backward_s": 0.2, "step_s": 0.3}),
    ]
    ax = plots.step_parts(bars)
    # bars drawn part by part (forward, recompute, backward, other), each for both labels
    assert [p.get_height() for p in ax.patches] == pytest.approx([100, 100, 50, 0, 200, 200, 50, 0])
    plt.close("all")


def test_step_breakdown_script_runs_on_a_solved_schedule(tmp_path):
    """benchmarks/step_breakdown.py end to end on a small solved schedule: table and plot."""
    import runpy
    from pathlib import Path

    from monet_opt.cli import main
    from monet_opt.profile import cpu_model

    sched, prob = tmp_path / "s.json", tmp_path / "p.json"
    small = ["resnet18", "--batch", "2", "--image", "32", "--time-limit", "5", "--step-in-backward", "adam"]
    assert main(["solve", *small, "--budget", "0.98", "-o", str(sched), "--problem-out", str(prob)]) == 0
    script = Path(__file__).resolve().parent.parent / "benchmarks" / "step_breakdown.py"
    argv = sys.argv
    sys.argv = [
        str(script),
        str(sched),
        str(prob),
        "--rounds",
        "2",
        "--part-steps",
        "1",
        "--out",
        str(tmp_path),
    ]
    try:
        with pytest.raises(SystemExit) as done:
            runpy.run_path(str(script), run_name="__main__")
    finally:
        sys.argv = argv
    assert done.value.code == 0
    text = (tmp_path / "step_breakdown_s.md").read_text()
    assert "Overhead, paired over 2 rounds" in text and "| schedule | recompute |" in text
    # (the host's CPU model: step times differ by host, 1.6x between two sessions' VMs)
    assert f"({cpu_model()})" in text
    assert (tmp_path / "step_breakdown_s.png").stat().st_size > 0
