"""Overhead of the runtime itself: a schedule that recomputes nothing, with every node's
default implementation, run through `MonetWrapper`, against plain PyTorch in the same run.

    python benchmarks/runtime_overhead.py                          # resnet50, mobilenet_v2, googlenet, gpt
    python benchmarks/runtime_overhead.py --models resnet18 --batch 4 --image 64 --steps 5

Such a schedule does exactly plain PyTorch's arithmetic, so any step-time difference is the
executor's own cost (per-node autograd graphs, Python bookkeeping, allocation pattern).
Step times: `monet_opt.bench.interleaved_samples` (rounds alternate the two models; each timed
step follows an untimed step of the same model). The overhead is the median of the rounds'
wrapped/plain ratios, with its quartiles (`paired_ratio`), and the ratio of the two fastest
steps (the executor adds work to every step; what a busy machine adds to a step only slows it,
so the fastest steps are the least disturbed); the table also gives each model's median step.
Peaks: `monet_opt.bench.measure_step_peak`. Page faults: minor faults of one step after a
step of the same model (`monet_opt.bench.step_page_faults`): on CPU, memory glibc handed back
to the kernel comes back as fresh zeroed pages, a cost that depends on the order of frees, not
on the arithmetic; `--keep-freed-memory` (`monet_opt.malloc`) removes it for both models.
`--bare` also times, paired with plain in rounds of their own, the structure of a wrapped step
without the executor (`BareNested`: the model's own forward inside an autograd Function whose
backward runs the engine again over it and hands the parameters' gradients back, as
`MonetWrapper` does for a schedule that recomputes): what any wrapper built that way costs.
Such a schedule runs in the caller's graph (`ScheduleExecutor.attachable`: column "runs");
`--nested` also times it through the wrapper's own backward (`MONET_OPT_ATTACHED=0`), paired
with plain in rounds of its own.
Writes DIR/runtime_overhead.md. Target (issue 5): within 3 % of plain.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import shlex
import statistics
import sys
from pathlib import Path

import torch

from monet_opt.bench import interleaved_samples, measure_step_peak, paired_ratio, step_page_faults
from monet_opt.malloc import keep_freed_memory
from monet_opt.profile import build_problem
from monet_opt.runtime import MonetWrapper, executor
from monet_opt.zoo import ModelSpec
from solver import baselines

MiB = 2**20


class _NestedStep(torch.autograd.Function):
    @staticmethod
    def forward(ctx, model: torch.nn.Module, x: torch.Tensor, *params: torch.Tensor) -> torch.Tensor:
        with torch.enable_grad():
            out = model(x)
        ctx.out, ctx.params = out, params
        return out.detach()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out, params = ctx.out, ctx.params
        del ctx.out, ctx.params
        got = torch.autograd.grad(out, params, grad, allow_unused=True)
        return (None, None, *got)


class BareNested(torch.nn.Module):
    """`model` (one tensor in, one out) run as a wrapped step is structured, with no executor:
    its forward inside an autograd Function, whose backward runs `autograd.grad` over the
    forward's graph and hands the parameters' gradients back through the Function."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        params = [p for p in self.model.parameters() if p.requires_grad]
        return _NestedStep.apply(self.model, x, *params)


def measure(spec: ModelSpec, steps: int, bare: bool = False, nested: bool = False) -> dict:
    torch.manual_seed(0)
    model = spec.build().train()
    inputs = spec.example_inputs(torch.device("cpu"))
    problem = build_problem(model, inputs, progress=False)
    schedule = baselines.no_recompute(problem)
    wrapped = MonetWrapper(model, schedule, example_inputs=inputs)
    runs = "attached" if wrapped._attaches(wrapped.executor) else "nested"
    plain_peak = measure_step_peak(model, inputs)
    peak = measure_step_peak(wrapped, inputs)
    faults = (step_page_faults(model, inputs), step_page_faults(wrapped, inputs))
    plain_t, step_t = interleaved_samples(model, wrapped, inputs, steps)
    ratio, q1, q3 = paired_ratio(plain_t, step_t)
    bare_ratio = None
    if bare and len(inputs) == 1:
        bare_ratio = paired_ratio(*interleaved_samples(model, BareNested(model), inputs, steps))
    nested_ratio = None
    if nested:
        attached, executor._ATTACHED = executor._ATTACHED, False
        try:
            through = MonetWrapper(model, schedule, example_inputs=inputs)
        finally:
            executor._ATTACHED = attached
        nested_ratio = paired_ratio(*interleaved_samples(model, through, inputs, steps))
    return {
        "model": spec.describe(),
        "nodes": len(problem.nodes),
        "plain_peak": plain_peak,
        "peak": peak,
        "plain_s": statistics.median(plain_t),
        "step_s": statistics.median(step_t),
        "ratio": (ratio, q1, q3),
        "min_ratio": min(step_t) / min(plain_t),
        "faults": faults,
        "bare": bare_ratio,
        "runs": runs,
        "nested": nested_ratio,
    }


def _overhead(ratio: tuple[float, float, float]) -> str:
    med, q1, q3 = ratio
    return f"{med - 1:+.1%} ({q1 - 1:+.1%} .. {q3 - 1:+.1%})"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="resnet50,mobilenet_v2,googlenet,gpt")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--image", type=int, default=224)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--steps", type=int, default=11, help="timed steps per model (median)")
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--channels-last", action="store_true", help="vision models and inputs channels_last")
    ap.add_argument(
        "--keep-freed-memory",
        action="store_true",
        help="CPU: glibc keeps freed blocks for both models (no fresh pages per step; monet_opt.malloc)",
    )
    ap.add_argument(
        "--bare", action="store_true", help="also time BareNested (the structure without the executor)"
    )
    ap.add_argument(
        "--nested", action="store_true", help="also time the schedule through the wrapper's own backward"
    )
    args = ap.parse_args(argv)
    kept = "yes" if args.keep_freed_memory and keep_freed_memory() else "no"

    rows = []
    for name in args.models.split(","):
        spec = ModelSpec(
            name, batch=args.batch, image=args.image, seq=args.seq, channels_last=args.channels_last
        )
        print(f"{spec.describe()} ...", flush=True)
        r = measure(spec, args.steps, args.bare, args.nested)
        rows.append(r)
        print(
            f"  plain {r['plain_s'] * 1e3:.1f} ms, wrapped {r['step_s'] * 1e3:.1f} ms "
            f"(paired {_overhead(r['ratio'])}; fastest steps {r['min_ratio'] - 1:+.1%}); "
            f"peak {r['peak'] / MiB:.1f} vs {r['plain_peak'] / MiB:.1f} MiB; "
            f"page faults {r['faults'][1]} vs {r['faults'][0]}"
            + (f"; bare nested step {_overhead(r['bare'])}" if r["bare"] else "")
            + (f"; through the wrapper's backward {_overhead(r['nested'])}" if r["nested"] else ""),
            flush=True,
        )

    lines = [
        "# Runtime overhead: no-recompute schedule vs plain PyTorch",
        "",
        f"`python benchmarks/runtime_overhead.py {shlex.join(sys.argv[1:] if argv is None else argv)}`",
        f"({datetime.datetime.now().isoformat(timespec='minutes')}, torch {torch.__version__}, "
        f"{platform.machine()}, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.2f} at the end; "
        f"glibc keeps freed memory: {kept})",
        "",
        "| model | nodes | runs | plain ms | wrapped ms | overhead (paired median, quartiles) | fastest vs fastest "
        "| plain MiB | wrapped MiB | plain page faults | wrapped page faults | bare nested step (paired) "
        "| through the wrapper's backward (paired) |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['nodes']} | {r['runs']} | {r['plain_s'] * 1e3:.1f} | {r['step_s'] * 1e3:.1f} | "
            f"{_overhead(r['ratio'])} | {r['min_ratio'] - 1:+.1%} | "
            f"{r['plain_peak'] / MiB:.1f} | {r['peak'] / MiB:.1f} | {r['faults'][0]} | {r['faults'][1]} | "
            f"{_overhead(r['bare']) if r['bare'] else 'not run'} | "
            f"{_overhead(r['nested']) if r['nested'] else 'not run'} |"
        )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "runtime_overhead.md"
    tmp = path.with_suffix(".md.tmp")
    tmp.write_text("\n".join(lines) + "\n")
    tmp.replace(path)
    print("\n".join(lines))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
