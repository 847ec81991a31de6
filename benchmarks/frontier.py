"""Memory/time frontier, measured in one process: plain PyTorch, torch.utils.checkpoint
(sqrt(n) segments), torch.compile with activation_memory_budget, and monet-opt.

    python benchmarks/frontier.py --quick                      # resnet18, batch 4, 64x64, budgets 1.0,0.75,0.5
    python benchmarks/frontier.py --model resnet50 --batch 8 --image 224 \\
        --budgets 1.0,0.75,0.5,0.33,0.25 --time-limit 60 --steps 3 --out benchmarks/results

Every peak is `monet_opt.measure_peak` of one training step (forward, loss, backward;
bytes above what was live before the step, parameter gradients included), as in
`monet_opt.bench.measure_step`; step time is the median of `--steps` steps after a
warm-up (torch.compile's compilation is excluded). monet-opt budgets are fractions of
plain PyTorch's *measured* peak. Writes DIR/frontier_<model>.md (the table),
DIR/frontier_<model>.csv and DIR/frontier_<model>.png (memory ratio vs overhead).
"""

from __future__ import annotations

import argparse
import copy
import csv
import datetime
import math
import os
import platform
import shlex
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import nn

import solver
from monet_opt.bench import measure_step, paired_times, training_step, zero_grad
from monet_opt.calibrate import step_estimate
from monet_opt.malloc import keep_freed_memory
from monet_opt.models import TokenLogits
from monet_opt.pipeline import refine_schedule, sweep_model
from monet_opt.profile import build_problem, cpu_model
from monet_opt.runtime import MonetWrapper
from monet_opt.step_in_backward import OPTIMIZERS, fuse_into_backward, optimizer_factory
from monet_opt.zoo import ModelSpec

MiB = 2**20


@dataclass
class Row:
    method: str
    budget: str
    peak_bytes: int | None = None
    step_s: float | None = None
    pred_peak_bytes: int | None = None
    pred_time_s: float | None = None
    status: str = ""
    gap: float | None = None
    solve_s: float | None = None
    note: str = ""
    plain_step_s: float | None = None  # plain PyTorch's median over steps interleaved with this method's
    mem_ratio: float | None = field(default=None)
    overhead: float | None = field(default=None)
    label: str = ""
    ratio_q: list | None = None  # (q1, median, q3) of the paired ratios step / plain step


# -- torch.utils.checkpoint ------------------------------------------------------------
def as_sequential(model: nn.Module) -> nn.Sequential | None:
    """An nn.Sequential computing the same function as `model`, or None if we do not know one.

    Handles torchvision ResNet, MobileNetV2, VGG and plain nn.Sequential models; nested
    nn.Sequential children are flattened (their composition is sequential by definition).
    """
    import torchvision.models as tvm

    def flat(mods):
        for m in mods:
            if type(m) is nn.Sequential:
                yield from flat(m)
            else:
                yield m

    if isinstance(model, tvm.ResNet):
        mods = [model.conv1, model.bn1, model.relu, model.maxpool]
        for layer in (model.layer1, model.layer2, model.layer3, model.layer4):
            mods += list(flat(layer))
        mods += [model.avgpool, nn.Flatten(1), model.fc]
    elif isinstance(model, tvm.MobileNetV2):
        mods = [*flat(model.features), nn.AdaptiveAvgPool2d((1, 1)), nn.Flatten(1), *flat(model.classifier)]
    elif isinstance(model, tvm.VGG):
        mods = [*flat(model.features), model.avgpool, nn.Flatten(1), *flat(model.classifier)]
    elif type(model) is nn.Sequential:
        mods = list(flat(model))
    else:
        return None
    return nn.Sequential(*mods)


class SqrtCheckpoint(nn.Module):
    """checkpoint_sequential over `seq` with about sqrt(len(seq)) segments (non-reentrant)."""

    def __init__(self, seq: nn.Sequential, segments: int | None = None) -> None:
        super().__init__()
        self.seq = seq
        self.segments = segments or max(1, round(math.sqrt(len(seq))))

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint_sequential

        return checkpoint_sequential(self.seq, self.segments, x, use_reentrant=False)


def check_same_function(model: nn.Module, other: nn.Module, inputs: tuple) -> None:
    was = model.training
    model.eval()
    try:
        with torch.no_grad():
            a, b = model(*inputs), other(*inputs)
    finally:
        model.train(was)
    if not torch.allclose(a, b, rtol=1e-4, atol=1e-5):
        raise RuntimeError("the sequential version computes a different function than the model")


# -- timing ------------------------------------------------------------------------------
def paired_step_times(
    plain_model: nn.Module, model: nn.Module, inputs: tuple, steps: int, quartiles: list | None = None
) -> tuple[float, float]:
    """(median step s of `model`, median step s of `plain_model`), timed alternately.

    Steps of the two run in turn (`monet_opt.bench.paired_times`), so a change in the
    machine's load during the measurement hits both alike; both are assumed warm. `quartiles`, if
    a list, receives (q1, median, q3) of the rounds' paired ratios model/plain:
    the overhead the tables report, steadier than the ratio of the two medians.
    """
    plain_s, step_s, q = paired_times(plain_model, model, inputs, steps)
    if quartiles is not None:
        quartiles[:] = q
    return step_s, plain_s


class ContiguousTwin(nn.Module):
    """A contiguous (NCHW) copy of a channels_last model, fed contiguous copies of its inputs."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = copy.deepcopy(model).to(memory_format=torch.contiguous_format)

    def forward(self, *inputs):
        return self.model(*(x.contiguous() for x in inputs))


def measure_paired(
    plain_model: nn.Module, model: nn.Module, inputs: tuple, steps: int, quartiles: list | None = None
) -> tuple[int, float, float]:
    """(peak bytes of one step of `model`, its median step s, plain's median step s, interleaved);
    `quartiles` as in `paired_step_times`."""
    peak, _ = measure_step(model, inputs, 1)  # warm-up + measured peak
    step_s, plain_s = paired_step_times(plain_model, model, inputs, steps, quartiles)
    return peak, step_s, plain_s


def paired_row(
    method: str, budget: str, plain_model: nn.Module, model: nn.Module, inputs: tuple, steps: int, note: str
) -> Row:
    """A method's row, its steps interleaved with plain PyTorch's (`measure_paired`)."""
    q: list = []
    peak, t, tp = measure_paired(plain_model, model, inputs, steps, q)
    return Row(method, budget, peak, t, plain_step_s=tp, ratio_q=q, note=note)


# -- torch.compile -----------------------------------------------------------------------
def measure_compiled(
    model: nn.Module, inputs: tuple, budget: float, steps: int
) -> tuple[int, float, float, float]:
    """(peak, median step s, plain's median step s, compile+first-step s) of torch.compile with
    activation_memory_budget; plain steps are interleaved with the compiled ones."""
    import torch._dynamo
    import torch._functorch.config as fconfig

    torch._dynamo.reset()
    with fconfig.patch(activation_memory_budget=float(budget)):
        compiled = torch.compile(model)
        t0 = time.perf_counter()
        zero_grad(model)
        training_step(compiled, inputs)  # compiles forward and backward
        compile_s = time.perf_counter() - t0
        peak, step_s, plain_s = measure_paired(model, compiled, inputs, steps)
    torch._dynamo.reset()
    return peak, step_s, plain_s, compile_s


# -- one monet-opt budget ------------------------------------------------------------------
def unsolved_row(method: str, label: str, exc: Exception, time_limit: float) -> Row:
    """The row of a budget the solver gave no schedule for."""
    if isinstance(exc, solver.InfeasibleBudget):
        return Row(method, label, status=f"infeasible (min {exc.minimum_bytes / MiB:.1f} MiB)", solve_s=0.0)
    status = f"no schedule in {time_limit:g} s (smallest known {exc.minimum_bytes / MiB:.1f} MiB)"
    return Row(method, label, status=status, solve_s=time_limit)


def solved_row(method: str, label: str, sched, budget_bytes: int, note: str, measure) -> Row:
    """The row of a solved budget: predictions, then `measure(quartiles)` -> (peak, step s, plain step s),
    filling `quartiles` with the paired ratios' (q1, median, q3)."""
    row = Row(
        method,
        label,
        pred_peak_bytes=sched.predicted_peak_bytes,
        pred_time_s=sched.predicted_time_s,
        status=sched.solver.status,
        gap=sched.solver.gap,
        solve_s=sched.solver.solve_time_s,
        note=note,
    )
    try:
        row.ratio_q = []
        row.peak_bytes, row.step_s, row.plain_step_s = measure(row.ratio_q)
        if row.peak_bytes > budget_bytes:
            row.note += "; MEASURED OVER BUDGET"
    except Exception as exc:
        traceback.print_exc()
        row.status += "; run failed"
        row.note += "; " + short_error(exc)
    return row


def refined(
    args,
    model: nn.Module,
    inputs: tuple,
    problem,
    solved: list,
    fractions: list,
    tag: str,
    say,
    optimizer=None,
):
    """With --refine R: each solved schedule run, its problem's times corrected by what its nodes
    took there, and solved again from it, R times (`monet_opt.pipeline.refine_schedule`); each
    corrected problem is kept beside the schedules."""
    if not args.refine:
        return solved
    out = []
    for f, sched in zip(fractions, solved):
        if isinstance(sched, Exception):
            out.append(sched)
            continue
        say(f"{tag}: refining budget {f:g} ({args.refine} round(s))")
        prob_f, sched = refine_schedule(
            model, inputs, problem, sched, args.refine, args.time_limit, args.verbose, optimizer
        )
        prob_f.to_json(Path(args.out) / "schedules" / f"{model_file(args)}_{tag}_{f:g}_refined_problem.json")
        out.append(sched)
    return out


# -- the optimizer step in the backward ---------------------------------------------------
def step_in_backward_rows(args, model: nn.Module, inputs: tuple, plain_peak: int, say) -> list[Row]:
    """Plain PyTorch with the optimizer step fused into the backward (post-accumulate-grad hooks),
    then monet-opt's schedules solved with it. Each monet-opt step is timed against the fused plain
    model (both do the optimizer's work); memory ratios are to plain PyTorch's peak, as above.
    The models train on copies: `model` stays as it was for the rows after."""
    name = args.step_in_backward
    factory = optimizer_factory(name)
    fused = copy.deepcopy(model)
    fuse_into_backward(fused, factory)
    say(f"plain PyTorch, {name} step in the backward")
    q: list = []
    peak, t, tp = measure_paired(model, fused, inputs, args.steps, q)
    rows = [
        Row(
            f"plain + {name} step in backward",
            "—",
            peak,
            t,
            plain_step_s=tp,
            ratio_q=q,
            note="register_post_accumulate_grad_hook; its time includes the optimizer step",
        )
    ]
    say("monet-opt, step in the backward: profiling")
    problem = build_problem(
        model,
        inputs,
        progress=args.verbose,
        calibrate=args.calibrate,
        optimizer=name,
        meta=spec_meta(args),
        zero_pack=args.zero_pack,
    )
    problem.to_json(Path(args.out) / "schedules" / f"{model_file(args)}_{name}_problem.json")
    say(f"monet-opt, step in the backward: solving budgets {', '.join(f'{f:g}' for f in args.budgets)}")
    solved = sweep_model(
        problem, [int(f * plain_peak) for f in args.budgets], time_limit=args.time_limit, verbose=args.verbose
    )
    solved = refined(args, model, inputs, problem, solved, args.budgets, name, say, optimizer=name)
    for f, sched in zip(args.budgets, solved):
        budget_bytes = int(f * plain_peak)
        label = f"{f:g} ({budget_bytes / MiB:.0f} MiB)"
        method = f"monet-opt + {name} step in backward"
        if isinstance(sched, (solver.NoScheduleFound, solver.InfeasibleBudget)):
            rows.append(unsolved_row(method, label, sched, args.time_limit))
            continue
        sched.to_json(Path(args.out) / "schedules" / f"{model_file(args)}_{name}_{f:g}.json")
        say(f"monet-opt, step in the backward: budget {label}")

        def measure(quartiles, sched=sched):
            wrapped = MonetWrapper(copy.deepcopy(model), sched, example_inputs=inputs, optimizer=name)
            return measure_paired(fused, wrapped, inputs, args.steps, quartiles)

        note = f"{len(sched.recomputed())} nodes recomputed; overhead vs the fused plain step"
        rows.append(solved_row(method, label, sched, budget_bytes, note, measure))
    return rows


# -- the run ------------------------------------------------------------------------------
def fmt_mib(b) -> str:
    return "—" if b is None else f"{b / MiB:.1f}"


def fmt_ms(s) -> str:
    return "—" if s is None else f"{s * 1e3:.0f}"


def short_error(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".replace("\n", " ").replace("|", "/")
    return text[:160] + ("…" if len(text) > 160 else "")


def model_file(args) -> str:
    """The model's name as a file name part (`hf/gpt2` -> `hf_gpt2`)."""
    return args.model.replace("/", "_").replace(":", "_")


def model_spec(args) -> ModelSpec:
    return ModelSpec(
        args.model, batch=args.batch, image=args.image, seq=args.seq, channels_last=args.channels_last
    )


def spec_meta(args) -> dict:
    """The model's metadata for the problems and schedules written (`monet-opt bench FILE` reads it)."""
    return model_spec(args).meta()


def run(args) -> list[Row]:
    spec = model_spec(args)
    torch.manual_seed(0)
    model = spec.build().train()
    inputs = spec.example_inputs()
    rows: list[Row] = []
    log = print if args.verbose else (lambda *a, **k: None)

    def say(msg):
        print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)

    # plain PyTorch
    say("plain PyTorch")
    plain_peak, plain_t = measure_step(model, inputs, args.steps)
    plain = Row("plain PyTorch", "—", plain_peak, plain_t)
    rows.append(plain)

    if spec.channels_last:
        # the same model contiguous (NCHW), as users train it without channels_last
        say("plain PyTorch, contiguous")
        note = "a contiguous copy of the model, fed x.contiguous(); peak includes that input copy"
        rows.append(
            paired_row(
                "contiguous (NCHW) model, plain PyTorch",
                "—",
                model,
                ContiguousTwin(model),
                inputs,
                args.steps,
                note,
            )
        )

    # torch.utils.checkpoint, sqrt(n) segments
    say("checkpoint_sequential")
    try:
        seq = as_sequential(model)
        if seq is None:
            raise RuntimeError(f"no sequential form known for {type(model).__name__}")
        check_same_function(model, seq, inputs)
        ck = SqrtCheckpoint(seq)
        note = f"{ck.segments} segments over {len(seq)} modules, use_reentrant=False"
        rows.append(
            paired_row(
                "checkpoint_sequential",
                f"sqrt(n): {ck.segments} of {len(seq)}",
                model,
                ck,
                inputs,
                args.steps,
                note,
            )
        )
    except Exception as exc:  # report, do not stop the run
        traceback.print_exc()
        rows.append(Row("checkpoint_sequential", "sqrt(n)", status="failed", note=short_error(exc)))

    # Hugging Face's own activation checkpointing (one checkpoint per transformer block)
    hf = model.model if isinstance(model, TokenLogits) else None  # (TokenLoss too)
    if hf is not None and getattr(hf, "supports_gradient_checkpointing", False):
        say("Hugging Face gradient_checkpointing_enable")
        try:
            ck = copy.deepcopy(model)
            ck.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            note = "model.gradient_checkpointing_enable(use_reentrant=False)"
            rows.append(
                paired_row("HF gradient checkpointing", "per block", model, ck, inputs, args.steps, note)
            )
        except Exception as exc:  # report, do not stop the run
            traceback.print_exc()
            rows.append(Row("HF gradient checkpointing", "per block", status="failed", note=short_error(exc)))

    # monet-opt
    say("monet-opt: profiling")
    t0 = time.perf_counter()
    problem = build_problem(
        model,
        inputs,
        zero_pack=args.zero_pack,
        progress=args.verbose,
        use_cache=not args.fresh_profile,
        calibrate=args.calibrate,
        meta=spec_meta(args),
        defer_weight_grads=args.defer_weight_grads,
    )
    profile_s = time.perf_counter() - t0
    # the problem the schedules are solved on, beside them
    problem.to_json(Path(args.out) / "schedules" / f"{model_file(args)}_problem.json")
    nr = solver.no_recompute(problem)
    plain.pred_peak_bytes, plain.pred_time_s = nr.predicted_peak_bytes, nr.predicted_time_s
    plain.note = f"monet-opt simulator: no-recompute prediction; {len(problem.nodes)} nodes profiled in {profile_s:.0f} s"
    # tightest budget first, each solve starting from the tighter budget's plan (solver.sweep)
    say(f"monet-opt: solving budgets {', '.join(f'{f:g}' for f in args.budgets)}")
    solved = sweep_model(
        problem, [int(f * plain_peak) for f in args.budgets], time_limit=args.time_limit, verbose=args.verbose
    )
    solved = refined(args, model, inputs, problem, solved, args.budgets, "kept", say)
    for f, sched in zip(args.budgets, solved):
        budget_bytes = int(f * plain_peak)
        label = f"{f:g} ({budget_bytes / MiB:.0f} MiB)"
        say(f"monet-opt: budget {label}")
        if isinstance(sched, (solver.NoScheduleFound, solver.InfeasibleBudget)):
            rows.append(unsolved_row("monet-opt", label, sched, args.time_limit))
            continue
        # kept beside the results: a row that surprises can be re-run (`monet-opt bench FILE`)
        sched.to_json(Path(args.out) / "schedules" / f"{model_file(args)}_{f:g}.json")
        n_rec = len(sched.recomputed())
        default = {n.name: n.impls[0].name for n in problem.nodes}
        n_impl = sum(1 for k, v in sched.impl_choice().items() if v != default.get(k))

        def measure(quartiles, sched=sched):
            wrapped = MonetWrapper(model, sched, example_inputs=inputs)
            return measure_paired(model, wrapped, inputs, args.steps, quartiles)

        note = f"{n_rec} nodes recomputed, {n_impl} non-default impls"
        estimate = None if args.refine else step_estimate(problem, sched)
        if estimate is not None:  # (calibrated: against plain's step measured while calibrating)
            note += f"; estimated {estimate[0] / estimate[1] - 1:+.1%} vs plain"
        row = solved_row("monet-opt", label, sched, budget_bytes, note, measure)
        rows.append(row)
        log(f"  {row}")

    if args.step_in_backward:
        rows += step_in_backward_rows(args, model, inputs, plain_peak, say)

    # torch.compile with activation_memory_budget
    if args.no_compile:
        rows.append(Row("torch.compile", "all", status="skipped (--no-compile)"))
    else:
        for f in args.compile_budgets or args.budgets:
            say(f"torch.compile activation_memory_budget={f:g}")
            try:
                peak, t, tp, compile_s = measure_compiled(model, inputs, f, args.steps)
                rows.append(
                    Row(
                        "torch.compile",
                        f"amb={f:g}",
                        peak,
                        t,
                        plain_step_s=tp,
                        status="ok",
                        note=f"inductor CPU; compile + first step {compile_s:.0f} s (excluded)",
                    )
                )
            except Exception as exc:
                traceback.print_exc()
                rows.append(Row("torch.compile", f"amb={f:g}", status="failed", note=short_error(exc)))
            zero_grad(model)

    # plain again, to show how much timing drifted during the run
    say("plain PyTorch (re-measured)")
    peak, t = measure_step(model, inputs, args.steps)
    rows.append(Row("plain PyTorch (again, at end)", "—", peak, t, note="timing drift / noise check"))

    for r in rows:
        if r.peak_bytes is not None:
            r.mem_ratio = r.peak_bytes / plain_peak
        if r.ratio_q:
            r.overhead = r.ratio_q[1] - 1.0
        elif r.step_s is not None:
            r.overhead = r.step_s / (r.plain_step_s or plain_t) - 1.0
        r.label = r.budget.split(" ")[0].replace("amb=", "") if r.budget not in ("—",) else ""
        if r.method.startswith("checkpoint"):
            r.label = "sqrt(n)"
        if r.method.startswith("HF gradient"):
            r.label = "HF ckpt"
    return rows


def markdown(rows: list[Row], args, header: dict) -> str:
    out = [
        f"### {model_spec(args).describe()} — {header['date']}",
        "",
        f"Command: `{header['command']}`",
        "",
        f"torch {torch.__version__}, {header['threads']} threads on {header['cpu']}; "
        f"load average {header['load_start']} at start, {header['load_end']} at end. "
        f"Freed memory kept in the process (glibc, monet_opt.malloc): {header['kept_freed_memory']}. "
        "monet-opt budgets are fractions of plain PyTorch's measured peak.",
        "",
        "Step times are medians of the steps; each method's steps alternate with plain PyTorch "
        "steps (column 'plain ms': their median). Overhead: the median of the rounds' paired ratios "
        "(method step / plain step of the same round), their quartiles in brackets; torch.compile "
        "rows: the ratio of the two medians.",
        "",
        "| method | budget | measured peak MiB | peak/plain | step ms | plain ms | overhead vs plain | "
        "predicted peak MiB | predicted step ms | solver status / gap | solve s | notes |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---|",
    ]
    for r in rows:
        ratio = "—" if r.mem_ratio is None else f"{r.mem_ratio:.2f}"
        over = "—" if r.overhead is None else f"{r.overhead:+.0%}"
        if r.ratio_q:
            over += f" ({r.ratio_q[0] - 1:+.0%}..{r.ratio_q[2] - 1:+.0%})"
        status = r.status or ""
        if r.gap is not None:
            status += f" / gap {r.gap:.1%}"
        solve_s = "" if r.solve_s is None else f"{r.solve_s:.0f}"
        out.append(
            f"| {r.method} | {r.budget} | {fmt_mib(r.peak_bytes)} | {ratio} | {fmt_ms(r.step_s)} | "
            f"{fmt_ms(r.plain_step_s)} | {over} | "
            f"{fmt_mib(r.pred_peak_bytes)} | {fmt_ms(r.pred_time_s)} | {status} | {solve_s} | {r.note} |"
        )
    return "\n".join(out) + "\n"


def write_csv(rows: list[Row], path: Path) -> None:
    fields = list(asdict(rows[0]))
    with open(path, "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=fields)
        w.writeheader()
        for r in rows:
            w.writerow(asdict(r))


def plot(rows: list[Row], args, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # here, not at import: notebooks import this module for its helpers
    import matplotlib.pyplot as plt

    from monet_opt import plots

    fig, ax = plt.subplots(figsize=(7.5, 5.0))
    pts = [r for r in rows if r.mem_ratio is not None and r.overhead is not None and "again" not in r.method]
    plots.frontier(
        pts,
        ax=ax,
        title=f"{model_spec(args).describe()}, CPU (labels: budget; timing noisy, shared CPU)",
    )
    again = next((r for r in rows if "again" in r.method and r.overhead is not None), None)
    if again is not None:
        ax.plot(
            [again.mem_ratio], [100 * again.overhead], "o", mfc="none", color="black", label="plain, re-run"
        )
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="resnet50")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--image", type=int, default=224)
    ap.add_argument("--seq", type=int, default=128, help="sequence length for token models (gpt)")
    ap.add_argument(
        "--budgets", default="1.0,0.75,0.5,0.33,0.25", help="fractions of the measured plain peak"
    )
    ap.add_argument(
        "--compile-budgets", default=None, help="activation_memory_budget values (default: --budgets)"
    )
    ap.add_argument("--time-limit", type=float, default=60.0, help="solver time limit per budget (s)")
    ap.add_argument("--steps", type=int, default=3, help="timed steps per method (median)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument(
        "--channels-last", action="store_true", help="model and inputs channels_last (every method)"
    )
    ap.add_argument("--no-compile", action="store_true", help="skip torch.compile")
    ap.add_argument(
        "--refine",
        type=int,
        default=0,
        help="rounds of: run each schedule, correct its problem's costs by what its nodes took there, solve "
        "again (one --time-limit each; monet_opt.pipeline.refine_schedule)",
    )
    ap.add_argument(
        "--keep-freed-memory",
        action="store_true",
        help="CPU: glibc keeps freed blocks for every method (no fresh pages per step; monet_opt.malloc)",
    )
    ap.add_argument(
        "--fresh-profile",
        action="store_true",
        help="measure operator costs again instead of using the profile cache (whose times may "
        "have been measured under a different machine load)",
    )
    ap.add_argument(
        "--calibrate",
        action="store_true",
        help="time every implementation inside real training steps too (monet_opt.calibrate): "
        "predicted step times close to measured ones",
    )
    ap.add_argument(
        "--step-in-backward",
        metavar="OPTIMIZER",
        choices=sorted(OPTIMIZERS),
        help="also measure plain PyTorch and monet-opt with this optimizer's step fused into the backward",
    )
    ap.add_argument(
        "--defer-weight-grads",
        action="store_true",
        help="monet-opt with gradients kept: heavy weight gradients made after the backward "
        "(`build_problem(defer_weight_grads=True)`; not the rows with the step in the backward)",
    )
    ap.add_argument(
        "--zero-pack",
        action="store_true",
        help="let monet-opt's convolutions keep their ReLU input packed (`build_problem(zero_pack=True)`)",
    )
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--quick", action="store_true", help="resnet18, batch 4, 64x64, budgets 1.0,0.75,0.5")
    ap.add_argument("-v", "--verbose", action="store_true")
    args = ap.parse_args(argv)
    if args.quick:
        args.model, args.batch, args.image, args.budgets = "resnet18", 4, 64, "1.0,0.75,0.5"
    args.budgets = [float(x) for x in str(args.budgets).split(",") if x.strip()]
    if args.compile_budgets:
        args.compile_budgets = [float(x) for x in args.compile_budgets.split(",") if x.strip()]
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")  # silence the CPU profiler's per-call log lines
    if args.threads:
        torch.set_num_threads(args.threads)
    kept = "yes" if args.keep_freed_memory and keep_freed_memory() else "no"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    load = " / ".join(f"{x:.1f}" for x in os.getloadavg())
    header = {
        "date": datetime.datetime.now().strftime("%Y-%m-%d %H:%M"),
        "command": "python benchmarks/frontier.py "
        + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:])),
        "threads": torch.get_num_threads(),
        # (the host's model: ResNet-50's plain step took 1.6x longer on session 58's VM host)
        "cpu": f"{os.cpu_count()}-core {platform.machine()} CPU ({cpu_model()})",
        "load_start": load,
        "kept_freed_memory": kept,
    }
    t0 = time.perf_counter()
    rows = run(args)
    header["load_end"] = " / ".join(f"{x:.1f}" for x in os.getloadavg())
    md = markdown(rows, args, header) + f"\nTotal wall time {time.perf_counter() - t0:.0f} s.\n"
    print(md)
    stem = out / f"frontier_{model_file(args)}"
    stem.with_suffix(".md").write_text(md)
    write_csv(rows, stem.with_suffix(".csv"))
    plot(rows, args, stem.with_suffix(".png"))
    print(f"wrote {stem}.md, {stem}.csv, {stem}.png", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
