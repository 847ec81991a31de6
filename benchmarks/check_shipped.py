"""Measure every shipped schedule's peak with today's runtime, against its budget and prediction.

    python benchmarks/check_shipped.py                  # all of schedules/
    python benchmarks/check_shipped.py --only resnet50  # file names containing "resnet50"

A shipped schedule records the peak measured when it was made; the runtime has changed since
for some of them. This re-measures one training step of each (memory only: no timing, so it
is quick and the machine's load does not matter) and writes a markdown table to
`benchmarks/results/shipped_check.md`. Exit code 1 if any schedule measures over its budget.
"""

from __future__ import annotations

import argparse
import datetime
import sys
from pathlib import Path

import torch

import solver
from monet_opt.bench import measure_step_peak, spec_of
from monet_opt.runtime import MonetWrapper
from solver.jsonio import atomic_write_text

ROOT = Path(__file__).resolve().parent.parent
MiB = 2**20


def check(path: Path) -> dict:
    schedule = solver.Schedule.from_json(path)
    spec = spec_of(schedule)
    torch.manual_seed(0)
    model = spec.build().train()
    inputs = spec.example_inputs()
    peak = measure_step_peak(MonetWrapper(model, schedule, example_inputs=inputs), inputs)
    return {
        "file": path.name,
        "measured": peak,
        "predicted": schedule.predicted_peak_bytes,
        "budget": schedule.budget_bytes,
        "made": schedule.meta.get("date", "?")[:10],
    }


def _previous_rows(path: Path, remeasured: set[str]) -> dict[str, str]:
    """The table's rows at `path` for shipped files not in `remeasured`, by file name."""
    shipped = {f.name for f in (ROOT / "schedules").glob("*.json")}
    rows = {}
    for line in path.read_text().splitlines() if path.exists() else []:
        name = line.split("|")[1].strip() if line.startswith("| ") else ""
        if name in shipped and name not in remeasured:
            rows[name] = line
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", help="comma-separated substrings of file names")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "shipped_check.md"))
    args = ap.parse_args()
    files = sorted((ROOT / "schedules").glob("*.json"))
    if args.only:
        files = [f for f in files if any(k in f.name for k in args.only.split(","))]
    rows = []
    for f in files:
        r = check(f)
        rows.append(r)
        over = r["measured"] > r["budget"]
        print(
            f"{r['file']}: measured {r['measured'] / MiB:.2f} MiB, predicted {r['predicted'] / MiB:.2f}, "
            f"budget {r['budget'] / MiB:.2f} ({'OVER' if over else 'fits'})",
            flush=True,
        )
    lines = [
        f"# Shipped schedules re-measured ({datetime.date.today()}, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads)",
        "",
        "One training step per schedule with today's runtime; `python benchmarks/check_shipped.py`.",
        "",
        "| schedule | made | measured MiB | predicted MiB | budget MiB | measured - budget MiB |",
        "|---|---|---:|---:|---:|---:|",
    ]
    table = {
        r["file"]: f"| {r['file']} | {r['made']} | {r['measured'] / MiB:.2f} | {r['predicted'] / MiB:.2f} | "
        f"{r['budget'] / MiB:.2f} | {(r['measured'] - r['budget']) / MiB:+.2f} |"
        for r in rows
    }
    if args.only:  # (the other files' rows as the previous run left them)
        lines[2] += f" Last run with `--only {args.only}`: the other rows are from earlier runs."
        table = {**_previous_rows(Path(args.out), {f.name for f in files}), **table}
    lines += [table[name] for name in sorted(table)]
    atomic_write_text(args.out, "\n".join(lines) + "\n")
    return 1 if any(r["measured"] > r["budget"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
