"""The command line as a user meets it: one clear line and exit code 2 on bad input."""

from __future__ import annotations

import subprocess
import sys
import warnings

import pytest

import solver
from monet_opt.cli import main
from solver.problem import Problem
from solver.schedule import Schedule

SMALL = ["resnet18", "--batch", "2", "--image", "32", "--time-limit", "5"]


def test_help_lists_commands():
    out = subprocess.run([sys.executable, "-m", "monet_opt.cli", "--help"], capture_output=True, text=True)
    assert out.returncode == 0
    for command in ("solve", "sweep", "inspect", "bench", "profile", "trace"):
        assert command in out.stdout


def test_solve_inspect_bench(tmp_path, capsys):
    path = tmp_path / "r18.json"
    assert main(["solve", *SMALL, "--budget", "1.0", "-o", str(path)]) == 0
    out = capsys.readouterr().out
    assert "predicted peak" in out and f"wrote {path}" in out
    assert (
        f"measure it with: monet-opt bench {path} (predicted times from operators timed one at a time" in out
    )
    schedule = Schedule.from_json(path)
    assert schedule.meta["model"] == "resnet18" and schedule.meta["batch"] == 2
    assert schedule.predicted_peak_bytes <= schedule.budget_bytes

    assert main(["inspect", str(path)]) == 0
    out = capsys.readouterr().out
    assert "resnet18" in out and "predicted peak" in out

    assert main(["bench", str(path), "--steps", "1"]) == 0
    out = capsys.readouterr().out
    assert "plain PyTorch" in out and "monet-opt (measured)" in out and "page faults per step" in out


def test_sweep_writes_schedules_and_summary(tmp_path, capsys):
    assert main(["sweep", *SMALL, "--budgets", "1.0,0.99", "-o", str(tmp_path)]) == 0
    summary = (tmp_path / "summary.csv").read_text().splitlines()
    assert summary[0].startswith("budget,") and len(summary) == 3


@pytest.mark.parametrize(
    "args, message",
    [
        (["solve", *SMALL, "--budget", "lots"], "bad budget"),
        (["solve", "no_such_model", "--budget", "0.5"], "unknown model"),
        (["solve", *SMALL, "--budget", "1KB"], "minimum"),
        (["solve", *SMALL, "--budget", "2"], "a bare number above 1 is read as bytes"),
        (["solve", *SMALL, "--budget", "0.5"], "MiB of it parameter gradients (the optimizer step inside"),
        (["solve", *SMALL, "--budget", "-0.5"], "bad budget"),
        (["inspect", "/nonexistent/schedule.json"], "not found"),
    ],
)
def test_errors_are_one_clear_line(args, message, capsys):
    assert main(args) == 2
    err = capsys.readouterr().err
    assert message in err
    assert "Traceback" not in err


def test_corrupt_schedule_file(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    assert main(["inspect", str(bad)]) == 2
    assert "corrupt" in capsys.readouterr().err


def test_solve_min_budget_finds_the_smallest_peak(tmp_path, capsys):
    """--budget min: a schedule at or below the lowest peak of every baseline, above the lower bound."""
    from solver import baselines as B
    from solver import min_feasible_lower_bound

    path = tmp_path / "min.json"
    problem_path = tmp_path / "problem.json"
    args = ["solve", *SMALL, "--budget", "min", "-o", str(path), "--problem-out", str(problem_path)]
    assert main(args) == 0
    schedule = Schedule.from_json(path)
    from solver import Problem, simulate

    problem = Problem.from_json(problem_path)
    peak = simulate(problem, schedule).peak_bytes
    lowest = min(s.predicted_peak_bytes for s in B.all_baselines(problem, None).values())
    assert min_feasible_lower_bound(problem) <= peak <= lowest
    assert peak <= schedule.budget_bytes


def test_zero_pack_is_offered_only_when_asked_and_its_schedule_runs(tmp_path, capsys):
    args = ["resnet18", "--batch", "2", "--image", "32"]
    assert main(["profile", *args]) == 0
    assert "zero_packed_input" not in capsys.readouterr().out
    assert main(["profile", *args, "--zero-pack"]) == 0
    assert "zero_packed_input" in capsys.readouterr().out
    path = tmp_path / "r18_zp.json"
    assert main(["solve", *SMALL, "--zero-pack", "--budget", "1.0", "-o", str(path)]) == 0
    capsys.readouterr()
    schedule = Schedule.from_json(path)
    assert schedule.predicted_peak_bytes <= schedule.budget_bytes
    assert main(["bench", str(path), "--steps", "1"]) == 0
    assert "monet-opt (measured)" in capsys.readouterr().out


def test_solve_refine_writes_the_corrected_problem(tmp_path, capsys):
    sched_path, prob_path = tmp_path / "r18.json", tmp_path / "r18_problem.json"
    args = ["solve", *SMALL, "--budget", "0.98", "--step-in-backward", "adam", "--refine", "1"]
    assert main([*args, "-o", str(sched_path), "--problem-out", str(prob_path)]) == 0
    assert "refine 1/1" in capsys.readouterr().out
    problem, schedule = Problem.from_json(prob_path), Schedule.from_json(sched_path)
    assert len(problem.meta["schedule_calibration"]) == 1
    assert "freed_memory_kept" in problem.meta["schedule_calibration"][0]
    sim = solver.simulate(problem, schedule)
    assert sim.peak_bytes <= schedule.budget_bytes and sim.time_s == pytest.approx(schedule.predicted_time_s)


def test_keep_freed_memory_is_applied_before_calibrating(tmp_path):
    """`--keep-freed-memory` on solve applies before profiling (in its own process: mallopt is
    process-wide), and both calibrations record it in the problem."""
    sched_path, prob_path = tmp_path / "r18.json", tmp_path / "r18_problem.json"
    args = ["solve", *SMALL, "--budget", "1.0", "--calibrate", "--refine", "1", "--keep-freed-memory"]
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "monet_opt.cli",
            *args,
            "-o",
            str(sched_path),
            "--problem-out",
            str(prob_path),
        ],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr
    assert "against plain    " in out.stdout  # (calibrated: the overhead against plain's measured step)
    meta = Problem.from_json(prob_path).meta
    kept = sys.platform.startswith("linux")  # glibc's mallopt
    assert meta["in_situ_calibration"]["freed_memory_kept"] is kept
    assert [r["freed_memory_kept"] for r in meta["schedule_calibration"]] == [kept]


def test_a_budget_under_the_smallest_peak_says_it_as_a_fraction_too(tmp_path, capsys):
    """The user asked in fractions of plain PyTorch's peak: the error says the minimum as one too."""
    from solver import min_feasible_lower_bound, simulate

    path, problem_path = tmp_path / "min.json", tmp_path / "problem.json"
    assert (
        main(["solve", *SMALL, "--budget", "min", "-o", str(path), "--problem-out", str(problem_path)]) == 0
    )
    problem = Problem.from_json(problem_path)
    lowest = simulate(problem, Schedule.from_json(path)).peak_bytes
    plain = solver.baselines.no_recompute(problem).predicted_peak_bytes
    bound = min_feasible_lower_bound(problem)
    # just above the lower bound, under every schedule's peak ('min' is the smallest found in the
    # time limit, not a proven minimum: 16 KiB under it was once solved)
    too_low = (bound + 2**10) / plain
    assert bound + 2**10 < lowest
    capsys.readouterr()
    assert main(["solve", *SMALL, "--budget", f"{too_low:.6f}"]) == 2
    err = capsys.readouterr().err
    assert "of plain PyTorch's peak" in err and "Traceback" not in err
    fraction = float(err.split("--budget ")[-1].split()[0])
    assert fraction * plain > bound + 2**10
    # the fraction it names works, with the same 5-s limit: another 5-s search need not find that
    # peak again (CI, 74dfd04: the peak MILP stopped 25 KB above it), but the schedule that had it
    # is kept (monet_opt.fastest_found) and the solve starts from it
    assert main(["solve", *SMALL, "--budget", str(fraction)]) == 0


@pytest.mark.parametrize(
    "args", [["bench", "x.json", "--steps", "0"], ["solve", "resnet18", "--batch", "0", "--budget", "0.5"]]
)
def test_counts_below_one_are_refused_before_any_work(args, capsys):
    with pytest.raises(SystemExit) as ei:
        main(args)
    assert ei.value.code == 2
    assert "must be at least 1" in capsys.readouterr().err


def test_output_into_a_closed_pipe_is_no_traceback():
    """`monet-opt inspect FILE | head -1`: the reader goes away; exit quietly (141, as a shell's)."""
    import os

    read, write = os.pipe()
    os.close(read)
    path = os.path.join(os.path.dirname(__file__), "..", "schedules", "resnet50_b8_i224_0.33.json")
    proc = subprocess.run(
        [sys.executable, "-m", "monet_opt.cli", "inspect", path],
        stdout=write,
        stderr=subprocess.PIPE,
        text=True,
    )
    os.close(write)
    assert proc.returncode == 141 and "Traceback" not in proc.stderr, proc.stderr


def test_python_budgets_are_checked_before_profiling():
    from monet_opt.pipeline import parse_budget

    assert parse_budget(0.5) == 0.5 and parse_budget(10**8) == 10**8 and parse_budget("1") == 1.0
    for bad, message in (
        (1, "give 1.0"),
        (0, "positive"),
        (-5, "positive"),
        (1.5, r"\(0, 1\]"),
        (True, "bad budget"),
    ):
        with pytest.raises(ValueError, match=message):
            parse_budget(bad)


def test_trace_names_the_storage_an_in_place_node_shares_and_takes_no_profiling_flags(capsys):
    assert main(["trace", "resnet18", "--batch", "2", "--image", "32"]) == 0
    out = capsys.readouterr().out
    relu = next(line for line in out.splitlines() if line.split()[:1] == ["relu"])
    assert relu.rstrip().endswith("= bn1"), relu  # torchvision's ReLU(inplace=True) writes bn1's storage
    with pytest.raises(SystemExit):
        main(["trace", "resnet18", "--calibrate"])  # tracing measures nothing
    assert "unrecognized arguments: --calibrate" in capsys.readouterr().err


def test_autocast_solves_and_benches_under_it(tmp_path, capsys):
    """--autocast bfloat16: profiled under autocast (recorded in the schedule); bench runs both
    forwards under it, with no warning that the memory model may not hold."""
    path = tmp_path / "r18_bf16.json"
    args = ["resnet18", "--batch", "16", "--image", "32", "--time-limit", "5", "--autocast", "bfloat16"]
    assert main(["solve", *args, "--budget", "0.95", "-o", str(path)]) == 0
    capsys.readouterr()
    schedule = Schedule.from_json(path)
    assert schedule.meta["autocast"] == [["cpu", True, "bfloat16"]]
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        assert main(["bench", str(path), "--steps", "1"]) == 0
    out = capsys.readouterr().out
    assert "measured peak is within the budget" in out


def test_inspect_names_the_states_made_from_inputs(tmp_path, capsys):
    from solver import SolverInfo, Stage, Step

    stages = (
        Stage("forward", (Step("compute", "conv", "default", False),)),
        Stage("backward:conv", (Step("make_state", "conv", "default"), Step("backward", "conv"))),
    )
    path = tmp_path / "s.json"
    Schedule("x", None, 0, 0.0, SolverInfo("t"), "t", stages).to_json(path)
    assert main(["inspect", str(path)]) == 0
    out = capsys.readouterr().out
    assert "1 backward states made from held inputs, without a forward: conv" in out
    assert "0 nodes recomputed" in out
    assert "gathered" not in out


def test_inspect_says_how_many_backward_steps_were_gathered(tmp_path, capsys):
    from solver import gather_backwards
    from solver.synthetic import resnet
    from tests.test_gather import recomputing_convolution_inputs

    problem = resnet(50, seed=3)
    schedule = gather_backwards(problem, recomputing_convolution_inputs(problem))
    info = schedule.meta["gathered_backwards"]
    path = tmp_path / "s.json"
    schedule.to_json(path)
    assert main(["inspect", str(path)]) == 0
    out = capsys.readouterr().out
    assert f"backward steps gathered into {info['blocks']} blocks ({info['moved_steps']} moved earlier" in out


def test_solving_again_starts_from_the_kept_schedule_unless_fresh(tmp_path, capsys):
    """A second `solve` of the same model, shape and budget goes on from the fastest schedule
    found before (`monet_opt.fastest_found`): it says so, and is no slower; `--fresh` does not."""
    first, again, fresh = tmp_path / "first.json", tmp_path / "again.json", tmp_path / "fresh.json"
    # (resnet18 b2 32's peak is mostly its weight gradients: no budget under 0.99 fits)
    model = ["resnet18", "--batch", "8", "--image", "64", "--time-limit", "3", "--step-in-backward", "adam"]
    assert main(["solve", *model, "--budget", "0.75", "-o", str(first)]) == 0
    out = capsys.readouterr().out
    # (the hint to go on comes with a solve not proven within 1 %, and only then)
    hint = "run the same command again to go on from this schedule" in out
    assert hint == (Schedule.from_json(first).solver.status != "optimal"), out
    assert main(["solve", *model, "--budget", "0.75", "-o", str(again)]) == 0
    assert "starting from the fastest schedule an earlier solve" in capsys.readouterr().out
    a, b = Schedule.from_json(first), Schedule.from_json(again)
    assert b.meta["started_from_kept"]["time_s"] <= a.predicted_time_s * (1 + 1e-12)
    assert b.predicted_time_s <= a.predicted_time_s * (1 + 1e-12)
    assert main(["solve", *model, "--budget", "0.75", "--fresh", "-o", str(fresh)]) == 0
    assert "starting from the fastest" not in capsys.readouterr().out
    assert "started_from_kept" not in Schedule.from_json(fresh).meta
