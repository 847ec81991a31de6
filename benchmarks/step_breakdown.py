"""Where a solved schedule's step time goes, measured beside its prediction, and its overhead
against plain PyTorch as paired ratios.

    python benchmarks/step_breakdown.py SCHEDULE.json PROBLEM.json [--rounds 21] [--keep-freed-memory]

The schedule's metadata names its model and input size (`monet_opt.bench.spec_of`); PROBLEM is
the problem it was solved on (its costs are the prediction). A schedule solved with the
optimizer step in the backward is timed against plain PyTorch with the same step fused into its
backward (`monet_opt.bench.bench_model`).

Reported, in one run:
* the overhead vs plain: the median and quartiles of the rounds' paired ratios (rounds
  alternate the two models; `monet_opt.bench.interleaved_samples`), and each model's median step;
* page faults per step of each (CPU: with glibc's default thresholds a high-memory step lands in
  fresh pages that the kernel zeroes; `--keep-freed-memory` keeps freed blocks in the process,
  as a GPU's caching allocator does: `monet_opt.malloc`);
* the step by part -- forward computes, recomputations, backward steps, the rest -- measured
  (`monet_opt.bench.measure_parts`) and predicted (`solver.simulate`), for the schedule and for
  the problem's no-recompute schedule (the same runtime, nothing recomputed), so that an error of
  the cost model in general is told apart from one in what recomputation costs.
Predicted backward times leave out an optimizer step in the backward (the same for every
schedule of a problem); measured ones include it.

Writes DIR/step_breakdown_<schedule name>.md and .png (stacked bars of the parts; DIR: --out).
"""

from __future__ import annotations

import argparse
import copy
import datetime
import os
import platform
import shlex
import sys
from pathlib import Path

import torch

from monet_opt.bench import bench_model, measure_parts, predicted_parts, spec_of
from monet_opt.malloc import keep_freed_memory
from monet_opt.profile import cpu_model
from monet_opt.runtime import MonetWrapper
from solver import Problem, Schedule, baselines

MiB = 2**20


def parts_rows(label: str, measured, predicted) -> list[str]:
    rows = []
    for part in ("forward", "recompute", "backward", "other", "step"):
        m = getattr(measured, f"{part}_s")
        p = getattr(predicted, f"{part}_s")
        rel = f"{m / p - 1:+.0%}" if p > 0 else "—"
        rows.append(f"| {label} | {part} | {m * 1e3:.0f} | {p * 1e3:.0f} | {rel} |")
    return rows


def plot(bars: list, title: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from monet_opt import plots

    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    plots.step_parts(bars, ax=ax, title=title)
    fig.tight_layout()
    tmp = path.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=120)
    plt.close(fig)
    os.replace(tmp, path)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("schedule")
    ap.add_argument("problem")
    ap.add_argument("--rounds", type=int, default=21, help="paired rounds (one timed step of each model)")
    ap.add_argument("--part-steps", type=int, default=5, help="timed steps for the breakdown")
    ap.add_argument(
        "--keep-freed-memory", action="store_true", help="glibc keeps freed blocks (monet_opt.malloc)"
    )
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args(argv)

    kept = keep_freed_memory() if args.keep_freed_memory else False
    schedule = Schedule.from_json(args.schedule)
    problem = Problem.from_json(args.problem)
    schedule.check_fingerprint(problem.fingerprint, what="problem")
    spec = spec_of(schedule)
    torch.manual_seed(0)
    model = spec.build().train()
    inputs = spec.example_inputs()
    optimizer = schedule.meta.get("step_in_backward", {}).get("optimizer")

    print(f"{spec.describe()}: {args.rounds} paired rounds", file=sys.stderr, flush=True)
    res = bench_model(model, inputs, schedule, steps=args.rounds, name=spec.describe())
    print("breakdown", file=sys.stderr, flush=True)
    lines, bars = [], []
    for label, sched in (("schedule", schedule), ("no recomputation", baselines.no_recompute(problem))):
        wrapped = MonetWrapper(copy.deepcopy(model), sched, example_inputs=inputs, optimizer=optimizer)
        measured, predicted = measure_parts(wrapped, inputs, args.part_steps), predicted_parts(problem, sched)
        lines += parts_rows(label, measured, predicted)
        bars += [(f"{label}\nmeasured", measured), (f"{label}\npredicted", predicted)]
        del wrapped

    q1, med, q3 = res.ratio_quartiles
    out = [
        f"### {spec.describe()}: {Path(args.schedule).name} — {datetime.datetime.now():%Y-%m-%d %H:%M}",
        "",
        f"Command: `python {' '.join(shlex.quote(a) for a in sys.argv)}`",
        "",
        f"torch {torch.__version__}, {torch.get_num_threads()} threads on {os.cpu_count()}-core "
        f"{platform.machine()} ({cpu_model()}); freed memory kept in the process: {'yes' if kept else 'no'}; "
        f"optimizer step in the backward: {optimizer or 'no'}.",
        "",
        "| | plain PyTorch" + (f" + {optimizer} step in backward" if optimizer else "") + " | monet-opt |",
        "|---|---:|---:|",
        f"| measured peak MiB | {res.plain_peak_bytes / MiB:.1f} | {res.wrapped_peak_bytes / MiB:.1f} "
        f"(predicted {res.predicted_peak_bytes / MiB:.1f}, budget "
        f"{(res.budget_bytes or 0) / MiB:.1f}) |",
        f"| median step ms | {res.plain_step_s * 1e3:.0f} | {res.wrapped_step_s * 1e3:.0f} |",
        f"| page faults per step | {res.plain_page_faults} | {res.wrapped_page_faults} |",
        "",
        f"Overhead, paired over {args.rounds} rounds: **{med - 1:+.1%}** (quartiles {q1 - 1:+.1%} .. {q3 - 1:+.1%}).",
        "",
        f"Step by part, means of {args.part_steps} steps (ms):",
        "",
        "| schedule | part | measured | predicted | measured / predicted |",
        "|---|---|---:|---:|---:|",
        *lines,
        "",
    ]
    text = "\n".join(out)
    print(text)
    path = Path(args.out) / f"step_breakdown_{Path(args.schedule).stem}{'_kept' if kept else ''}.md"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
    plot(
        bars,
        f"{spec.describe()}, {Path(args.schedule).name}: overhead {med - 1:+.1%}",
        path.with_suffix(".png"),
    )
    print(f"wrote {path} and {path.with_suffix('.png')}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
