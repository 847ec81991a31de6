"""A Hugging Face causal LM given its inputs by keyword, trained on the loss it returns
(`labels=`), against plain PyTorch in the same run.

    python benchmarks/hf_own_loss.py                                  # GPT-2 small, b8 s128
    python benchmarks/hf_own_loss.py --layers 2 --batch 4 --seq 64 --budgets 0.5 --steps 3

The model is `transformers.GPT2LMHeadModel` itself (random weights), solved with
`monet_opt.solve_model(model, {'input_ids': ids, 'labels': ids, 'use_cache': False}, budget)`:
the logits are held (as the returned ModelOutput holds them) but get no gradient. Plain PyTorch
runs `model(input_ids=ids, labels=ids, use_cache=False)` and `.loss.backward()`, holding its
output through the backward as the wrapped step does (`--outputs-held loss`: both drop it
once the loss is computed, keeping the loss, as Hugging Face's Trainer does, and the schedule
is solved so). Budgets are fractions of the measured
plain peak. Peaks: `monet_opt.bench.measure_step_peak`; step times: paired rounds
(`interleaved_samples`, `paired_ratio`). Writes DIR/hf_own_loss.md.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch
import transformers

import monet_opt
from monet_opt.bench import interleaved_samples, measure_step_peak, paired_ratio
from monet_opt.keyword_inputs import as_traceable

MiB = 2**20


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--budgets", default="0.75,0.6,0.5")
    ap.add_argument("--time-limit", type=float, default=60.0)
    ap.add_argument("--steps", type=int, default=5, help="paired rounds of step times")
    ap.add_argument(
        "--outputs-held",
        choices=("all", "loss"),
        default="all",
        help="'loss': both loops drop the output before the backward, keeping the loss (as "
        "Hugging Face's Trainer), and the schedule is solved so (build_problem's outputs_held)",
    )
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    transformers.logging.set_verbosity_error()
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=args.layers)).train()
    ids = torch.randint(0, model.config.vocab_size, (args.batch, args.seq))
    batch = {"input_ids": ids, "labels": ids, "use_cache": False}
    # plain PyTorch: the model itself, called by keyword (the root only passes the keywords on)
    plain, inputs = as_traceable(model, batch)
    if args.outputs_held == "loss":  # plain drops every output but the loss before the backward too
        with torch.no_grad():
            plain(*inputs)
        plain.dropped_outputs = [k for k in range(plain.out_spec.num_leaves) if k not in plain.grad_outputs]
    plain_peak = measure_step_peak(plain, inputs)
    print(f"plain: {plain_peak / MiB:.1f} MiB", flush=True)
    problem = None
    rows = []
    for b in [float(x) for x in args.budgets.split(",")]:
        started = time.perf_counter()
        problem, schedule = monet_opt.solve_model(
            model,
            batch,
            int(b * plain_peak),
            time_limit=args.time_limit,
            verbose=False,
            problem=problem,
            outputs_held=args.outputs_held,
        )
        solved_s = time.perf_counter() - started
        wrapped = monet_opt.MonetWrapper(model, schedule)
        peak = measure_step_peak(wrapped, inputs)
        plain_t, step_t = interleaved_samples(plain, wrapped, inputs, args.steps)
        ratio, q1, q3 = paired_ratio(plain_t, step_t)
        rows.append(
            {
                "budget": b,
                "peak": peak,
                "predicted": schedule.predicted_peak_bytes,
                "plain_s": statistics.median(plain_t),
                "ratio": (ratio, q1, q3),
                "gap": schedule.solver.gap,
                "solve_s": solved_s,
            }
        )
        print(
            f"budget {b}: {peak / MiB:.1f} MiB ({peak / plain_peak:.3f} of plain, predicted "
            f"{schedule.predicted_peak_bytes / MiB:.1f}), step {100 * (ratio - 1):+.1f} % "
            f"({100 * (q1 - 1):+.1f} .. {100 * (q3 - 1):+.1f})",
            flush=True,
        )
        del wrapped
    lines = [
        "# GPT-2 trained on its own loss, inputs by keyword",
        "",
        f"`python {' '.join(shlex.quote(a) for a in sys.argv)}`, "
        f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, {platform.processor() or platform.machine()}, "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads. GPT-2 ({args.layers} layers), batch "
        f"{args.batch}, sequence {args.seq}; plain PyTorch peak {plain_peak / MiB:.1f} MiB; outputs held "
        f"through the backward: {args.outputs_held} (both loops).",
        "",
        "| budget / plain | measured peak | peak / plain | predicted | step overhead (quartiles) | proven gap |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        ratio, q1, q3 = r["ratio"]
        gap = r["gap"]
        lines.append(
            f"| {r['budget']:.3g} | {r['peak'] / MiB:.1f} MiB | {r['peak'] / plain_peak:.3f} | "
            f"{r['predicted'] / MiB:.1f} MiB | {100 * (ratio - 1):+.1f} % ({100 * (q1 - 1):+.1f} .. "
            f"{100 * (q3 - 1):+.1f}) | {'' if gap is None else f'{100 * gap:.2f} %'} |"
        )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "hf_own_loss.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
