"""monet-opt command line: solve, sweep, inspect, bench, profile, trace."""

from __future__ import annotations

import argparse
import csv
import logging
import math
import sys
import time
from pathlib import Path

# monet_opt.step_in_backward.OPTIMIZERS' names (not imported: the CLI loads torch only when it runs)
OPTIMIZER_NAMES = ("adam", "adamw", "sgd", "sgd-momentum")

MiB = 2**20


def _gap_scope(schedule) -> str:
    """' within recompute window 6 nodes' when the proven gap is that of a restricted MILP, and
    the same plan's gap within the widest window whose MILP ran, if wider, and over the MILP that
    holds the plan itself, if the plan departs from the window's rule and that gap is wider."""
    scope = schedule.meta.get("milp_gap_scope")
    text = f" within {scope}" if scope and "unbounded" not in scope else ""
    widest = schedule.meta.get("milp_gap_widest")
    if text and widest:
        window = "unbounded" if widest["window"] is None else f"{widest['window']} nodes"
        text += f"; {widest['gap']:.2%} within recompute window {window}"
    if text and "milp_gap_plan_milp" in schedule.meta:
        # the plan departs from the window's rule: the gap above bounds the window's own schedules
        own = schedule.meta["milp_gap_plan_milp"]
        text += "; over the MILP that holds the plan itself " + (
            "none proven" if own is None else f"{own['gap']:.2%}"
        )
    return text


def _mib(n: float | None) -> str:
    return "-" if n is None else f"{n / MiB:.1f} MiB"


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "model",
        help="torchvision model name (resnet50, vgg16, ...), 'gpt', 'timm/NAME', 'hf/gpt2' "
        "(also hf/gpt2-medium, hf/bert-base; ids in, loss out), or 'module.path:factory'",
    )
    p.add_argument("--batch", type=_positive_int, default=8, help="batch size (default 8)")
    p.add_argument(
        "--image", type=_positive_int, default=224, help="image side for vision models (default 224)"
    )
    p.add_argument(
        "--seq", type=_positive_int, default=128, help="sequence length for token models (default 128)"
    )
    p.add_argument(
        "--channels-last",
        action="store_true",
        help="vision models: weights and input images laid out channels_last "
        "(model.to(memory_format=torch.channels_last)), as you would train them",
    )


def _profile_args(p: argparse.ArgumentParser) -> None:
    """What profiling takes besides the model (every command that profiles; not `trace`)."""
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    p.add_argument(
        "--autocast",
        choices=("bfloat16", "float16"),
        help="profile and solve for training under torch.autocast with this dtype (train the "
        "wrapped model's forward under the same autocast; `bench` does)",
    )
    p.add_argument("--no-cache", action="store_true", help="profile again even if cached")
    p.add_argument(
        "--calibrate",
        action="store_true",
        help="time every implementation inside real training steps too (slower to profile; "
        "predicted step times closer to measured ones)",
    )
    p.add_argument(
        "--step-in-backward",
        metavar="OPTIMIZER",
        choices=OPTIMIZER_NAMES,
        help="solve for training with this optimizer's step inside the backward: each parameter "
        "updated, and its gradient freed, once its gradient is complete (run the schedule with "
        "MonetWrapper(..., optimizer=OPTIMIZER)); choices: %(choices)s",
    )
    p.add_argument(
        "--zero-pack",
        action="store_true",
        help="also let convolutions keep their ReLU input packed (bit mask + nonzero elements, "
        "lossless): less memory for ReLU networks, but its size follows the data's density, "
        "measured on the example batch",
    )
    p.add_argument(
        "--defer-weight-grads",
        action="store_true",
        help="with gradients kept (no --step-in-backward): let convolutions and linear layers whose "
        "weight gradient outweighs their input and output gradient make it after the backward "
        "instead of holding it through it (ResNet-50 b8 224: layer4 and fc, 28.7 MiB less held)",
    )
    p.add_argument(
        "--bitwise",
        action="store_true",
        help="only implementations whose gradients are bit for bit plain PyTorch's (default: also "
        "those within float rounding, ~1e-6 relative: batch-chunked convolution backward, BatchNorm "
        "rebuilding its input from its output, other attention kernels)",
    )
    _keep_freed_arg(p)


def _milp_solver_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--milp-solver",
        choices=("highs", "gurobi"),
        default="highs",
        help="MILP backend (default highs; gurobi needs gurobipy and a licence for the model's size)",
    )
    p.add_argument(
        "--highs-log",
        action="store_true",
        help="print HiGHS' own log (presolve, branch-and-bound tables) instead of a progress line "
        "every 10 s (same as MONET_OPT_HIGHS_LOG=1)",
    )


def _keep_freed_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--keep-freed-memory",
        action="store_true",
        help="CPU: glibc keeps freed blocks, no fresh pages per step (as a GPU's caching allocator; "
        "monet_opt.malloc). Calibrate with it when you train or benchmark with it: times differ",
    )


def _spec(args):
    from monet_opt.zoo import ModelSpec

    return ModelSpec(
        args.model, batch=args.batch, image=args.image, seq=args.seq, channels_last=args.channels_last
    )


def _device(args):
    import torch

    return torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))


def _autocast(args):
    """torch.autocast as --autocast says (off without it), on the command's device."""
    import torch

    dtype = getattr(args, "autocast", None)
    return torch.autocast(_device(args).type, dtype=getattr(torch, dtype or "bfloat16"), enabled=bool(dtype))


def _problem(args, quiet: bool = False):
    from monet_opt.profile import build_problem

    spec = _spec(args)
    device = _device(args)
    model = spec.build().to(device)
    inputs = spec.example_inputs(device)
    t0 = time.perf_counter()
    with _autocast(args):
        problem = build_problem(
            model,
            inputs,
            device=device,
            use_cache=not args.no_cache,
            progress=not quiet,
            calibrate=getattr(args, "calibrate", False),
            optimizer=getattr(args, "step_in_backward", None),
            zero_pack=getattr(args, "zero_pack", False),
            bitwise=getattr(args, "bitwise", False),
            defer_weight_grads=getattr(args, "defer_weight_grads", False),
            meta=spec.meta(),
        )
    if not quiet:
        print(
            f"profiled {len(problem.nodes)} nodes of {spec.describe()} in {time.perf_counter() - t0:.1f} s "
            f"({problem.meta.get('profile_cache_hits', 0)} cached measurements); the runtime adds "
            f"{problem.recompute_overhead_s * 1e3:.3f} ms per recomputed node (monet_opt.runtime_cost)"
        )
    return spec, model, inputs, problem


def _summary(problem, schedule) -> str:
    import solver

    sim = solver.simulate(problem, schedule)
    plain = schedule.meta.get("no_recompute_peak_bytes")
    base_time = sum(n.impls[0].fwd_time + n.impls[0].bwd_time for n in problem.nodes)
    rec = schedule.recomputed()
    changed = {n: i for n, i in schedule.impl_choice().items() if i != "default"}
    gap = schedule.solver.gap
    lines = [
        f"strategy         {schedule.strategy} ({schedule.solver.name}, status {schedule.solver.status}, "
        f"gap {'-' if gap is None else f'{gap:.2%}'}{_gap_scope(schedule)}, {schedule.solver.solve_time_s:.1f} s)",
        f"budget           {_mib(schedule.budget_bytes)}"
        + (f" ({schedule.budget_bytes / plain:.0%} of plain PyTorch's {_mib(plain)})" if plain else ""),
        f"predicted peak   {_mib(sim.peak_bytes)}",
        f"predicted time   {sim.time_s * 1e3:.1f} ms per step (plain {base_time * 1e3:.1f} ms, "
        f"overhead {sim.time_s / base_time - 1:+.1%})"
        if base_time
        else f"predicted time   {sim.time_s:.3f} s",
        *_against_plain(problem, schedule),
        f"recomputed       {len(rec)} of {len(problem.nodes)} nodes"
        + (f": {', '.join(list(rec)[:12])}{' ...' if len(rec) > 12 else ''}" if rec else ""),
        f"implementations  {len(changed)} non-default"
        + (
            f": {', '.join(f'{k}={v}' for k, v in list(changed.items())[:8])}{' ...' if len(changed) > 8 else ''}"
            if changed
            else ""
        ),
    ]
    return "\n".join(lines)


def _against_plain(problem, schedule) -> list[str]:
    """The summary's line for the overhead against plain PyTorch's step as measured while
    calibrating (`monet_opt.calibrate.step_estimate`); none for an uncalibrated problem."""
    from monet_opt.calibrate import step_estimate

    est = step_estimate(problem, schedule)
    if est is None:
        return []
    step, plain = est
    return [
        f"against plain    {step / plain - 1:+.1%} (estimated step {step * 1e3:.1f} ms against plain PyTorch's "
        f"{plain * 1e3:.1f} ms, measured while calibrating"
        + ("; the optimizer step left out of both)" if schedule.meta.get("step_in_backward") else ")")
    ]


def cmd_solve(args) -> int:
    from monet_opt.pipeline import parse_budget, solve_model
    from solver.baselines import no_recompute
    from solver.milp import InfeasibleBudget, check_backend

    budget = parse_budget(args.budget)
    check_backend(args.milp_solver)  # before profiling
    spec, model, inputs, problem = _problem(args)
    if args.problem_out:
        problem.to_json(args.problem_out)
    try:
        with _autocast(args):  # (--refine runs the schedule: under the autocast it was solved for)
            problem, schedule = solve_model(
                model,
                inputs,
                budget,
                time_limit=args.time_limit,
                verbose=True,
                problem=problem,
                optimizer=getattr(args, "step_in_backward", None),
                refine=args.refine,
                milp_solver=args.milp_solver,
                reuse=not args.fresh,
            )
    except InfeasibleBudget as exc:
        # the user may think in fractions of plain PyTorch's peak: say the smallest one as well
        plain = no_recompute(problem.without_deferral()).predicted_peak_bytes
        raise InfeasibleBudget(
            f"{exc}; as a fraction of plain PyTorch's peak ({_mib(plain)}): --budget "
            f"{math.ceil(1000 * exc.minimum_bytes / plain) / 1000:g}",
            exc.minimum_bytes,
        ) from None
    if args.problem_out and args.refine:
        problem.to_json(args.problem_out)  # the corrected costs the schedule was solved on
    print(_summary(problem, schedule))
    if schedule.strategy == "milp" and schedule.solver.status != "optimal":
        print(
            "not proven within 1 % in the time limit: run the same command again to go on from this "
            "schedule (kept beside the profile cache), or give a longer --time-limit"
        )
    if args.output:
        schedule.to_json(args.output)
        print(f"wrote {args.output}")
        # predictions from one-at-a-time operator timings run low (ResNet-50 b8 224 at 0.5:
        # +8.4 % predicted, +15.3 % measured; session 29): say how to measure it
        calibrated = "in_situ_calibration" in problem.meta or args.refine
        print(
            f"measure it with: monet-opt bench {args.output}"
            + (
                ""
                if calibrated
                else " (predicted times from operators timed one at a time; --calibrate times them inside steps)"
            )
        )
    return 0


def cmd_sweep(args) -> int:
    from monet_opt.pipeline import parse_budget, sweep_model
    from solver.milp import check_backend

    budgets = [parse_budget(b) for b in args.budgets.split(",")]
    check_backend(args.milp_solver)  # before profiling
    spec, model, inputs, problem = _problem(args)
    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    # tightest budget first, each solve starting from the tighter plan (printed in the order given)
    for b, schedule in zip(
        budgets,
        sweep_model(
            problem, budgets, time_limit=args.time_limit, verbose=False, milp_solver=args.milp_solver
        ),
    ):
        if isinstance(schedule, Exception):
            exc = schedule
            print(f"budget {b}: {exc}")
            rows.append(
                {
                    "budget": b,
                    "status": "infeasible",
                    "predicted_peak_mib": "",
                    "predicted_time_ms": "",
                    "recomputed": "",
                    "gap": "",
                    "file": "",
                }
            )
            continue
        name = out / f"{spec.name}_b{spec.batch}_{b}.json"
        schedule.to_json(name)
        rows.append(
            {
                "budget": b,
                "status": schedule.solver.status,
                "predicted_peak_mib": round(schedule.predicted_peak_bytes / MiB, 2),
                "predicted_time_ms": round(schedule.predicted_time_s * 1e3, 2),
                "recomputed": len(schedule.recomputed()),
                "gap": "" if schedule.solver.gap is None else round(schedule.solver.gap, 4),
                "file": str(name),
            }
        )
        print(
            f"budget {b}: peak {rows[-1]['predicted_peak_mib']} MiB, time {rows[-1]['predicted_time_ms']} ms, "
            f"{schedule.solver.status} -> {name}"
        )
    with open(out / "summary.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    print(f"wrote {out / 'summary.csv'}")
    return 0


def cmd_inspect(args) -> int:
    from solver.schedule import Schedule

    s = Schedule.from_json(args.file)
    m = s.meta
    print(f"schedule {args.file}")
    print(f"  model        {m.get('model_summary', m.get('model', '?'))}")
    device = str(m.get("device", "?"))
    torch_version = "" if "torch " in device else f", torch {m.get('torch', '?')}"
    print(f"  made on      {device}{torch_version}, {m.get('date', '?')}")
    optimizer = m.get("step_in_backward", {}).get("optimizer")
    if optimizer:
        print(
            f"  runs with    the {optimizer} step in the backward: MonetWrapper(..., optimizer={optimizer!r})"
        )
    for key, what in (
        ("bitwise", "bit-for-bit implementations only"),
        ("zero_pack", "zero-packed inputs offered"),
        (
            "defer_weight_grads",
            "weight gradients deferred to the end of the backward where they outweigh their inputs",
        ),
    ):
        if m.get(key):
            print(f"  solved with  {what}")
    print(
        f"  strategy     {s.strategy} ({s.solver.name}, {s.solver.status}, gap "
        f"{'-' if s.solver.gap is None else f'{s.solver.gap:.2%}'}{_gap_scope(s)}, {s.solver.solve_time_s:.1f} s)"
    )
    print(
        f"  budget       {_mib(s.budget_bytes)}; predicted peak {_mib(s.predicted_peak_bytes)}, "
        f"time {s.predicted_time_s * 1e3:.1f} ms"
    )
    if "measured_peak_bytes" in m:
        print(
            f"  measured     peak {_mib(m['measured_peak_bytes'])}, step {m.get('measured_step_s', 0) * 1e3:.1f} ms "
            f"(plain: {_mib(m.get('plain_peak_bytes'))}, {m.get('plain_step_s', 0) * 1e3:.1f} ms)"
        )
    impls = {k: v for k, v in s.impl_choice().items() if v != "default"}
    print(f"  implementations (non-default): {len(impls)}")
    for k, v in impls.items():
        print(f"    {k:<32} {v}")
    print(f"  {'stage':<36} {'recomputes':>10}  nodes")
    for st in s.stages:
        comp = [x.node for x in st.steps if x.op == "compute"]
        if st.name == "forward":
            print(f"  {st.name:<36} {'':>10}  {len(comp)} computed")
        elif comp:
            print(f"  {st.name:<36} {len(comp):>10}  {', '.join(comp[:6])}{' ...' if len(comp) > 6 else ''}")
    rec = s.recomputed()
    print(f"  {len(rec)} nodes recomputed, {sum(rec.values())} recompute steps in all")
    made = [x.node for st in s.stages for x in st.steps if x.op == "make_state"]
    if made:
        print(
            f"  {len(made)} backward states made from held inputs, without a forward: "
            f"{', '.join(made[:6])}{' ...' if len(made) > 6 else ''}"
        )
    gathered = s.meta.get("gathered_backwards")
    if gathered:
        print(
            f"  backward steps gathered into {gathered['blocks']} blocks ({gathered['moved_steps']} moved "
            "earlier, next to their block's first), each run in one autograd call"
        )
    return 0


def cmd_bench(args) -> int:
    from monet_opt.bench import bench_schedule
    from solver.schedule import Schedule

    s = Schedule.from_json(args.file)
    res = bench_schedule(s, steps=args.steps)
    print(res.table())
    return 0


def cmd_profile(args) -> int:
    spec, model, inputs, problem = _problem(args)
    w = max([18] + [len(im.name) for n in problem.nodes for im in n.impls])
    print(
        f"{'node':<28} {'op':<22} {'out':>9} {'impl':<{w}} {'fwd ms':>8} {'bwd ms':>8} {'keeps':<14} {'state':>9}"
    )
    for n in problem.nodes:
        for k, impl in enumerate(n.impls):
            keeps = ",".join([f"in{p}" for p in impl.keeps_inputs] + (["out"] if impl.keeps_output else []))
            print(
                f"{n.name if k == 0 else '':<28} {n.op if k == 0 else '':<22} "
                f"{_mib(n.output_bytes) if k == 0 else '':>9} {impl.name:<{w}} {impl.fwd_time * 1e3:8.3f} "
                f"{impl.bwd_time * 1e3:8.3f} {keeps:<14} {_mib(impl.state_bytes):>9}"
            )
    if args.output:
        problem.to_json(args.output)
        print(f"wrote {args.output}")
    return 0


def cmd_trace(args) -> int:
    from monet_opt.graph import trace

    spec = _spec(args)
    model = spec.build()
    graph = trace(model, spec.example_inputs())
    print(f"{spec.describe()}: {len(graph.nodes)} nodes, fingerprint {graph.fingerprint[:16]}")
    for n in graph.nodes:
        shape = n.shapes[0] if n.shapes else "-"
        # (a view or an in-place op owns no new storage: say whose it shares, not 0.0 MiB)
        size = _mib(n.output_bytes) if n.alias_of is None else f"= {n.inputs[n.alias_of]}"
        print(f"  {n.name:<32} {n.kind:<24} {str(shape):<24} {size:>10}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="monet-opt",
        description="Fit a PyTorch training step into a memory budget: profile, solve, inspect, benchmark.",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("solve", help="profile a model and solve a schedule for a memory budget")
    _model_args(p)
    _profile_args(p)
    p.add_argument(
        "--budget",
        required=True,
        help="fraction of plain PyTorch's peak (0.5), a size (800MB, 2GiB), or 'min' (smallest peak found)",
    )
    p.add_argument("-o", "--output", help="write the schedule JSON here")
    p.add_argument("--time-limit", type=float, default=60.0, help="solver time limit in seconds (default 60)")
    p.add_argument("--problem-out", help="also write the profiled problem JSON here")
    p.add_argument(
        "--refine",
        type=int,
        default=0,
        help="rounds of: run the schedule, correct the costs by what its nodes took there, solve again "
        "(each round one --time-limit; --problem-out then holds the last corrected problem)",
    )
    p.add_argument(
        "--fresh",
        action="store_true",
        help="solve from scratch: do not start from the schedules earlier solves of this model, input "
        "shape and device kept (by default a solve goes on from the fastest one that fits the budget)",
    )
    _milp_solver_arg(p)
    p.set_defaults(func=cmd_solve)

    p = sub.add_parser("sweep", help="solve for several budgets; write schedules and summary.csv")
    _model_args(p)
    _profile_args(p)
    p.add_argument("--budgets", default="1.0,0.75,0.5,0.33,0.25")
    p.add_argument("-o", "--output", required=True, help="output folder")
    p.add_argument("--time-limit", type=float, default=60.0)
    _milp_solver_arg(p)
    p.set_defaults(func=cmd_sweep)

    p = sub.add_parser("inspect", help="print a schedule as a table")
    p.add_argument("file")
    p.set_defaults(func=cmd_inspect)

    p = sub.add_parser(
        "bench", help="run a schedule and plain PyTorch side by side: measured peak and step time"
    )
    p.add_argument("file")
    p.add_argument(
        "--steps",
        type=_positive_int,
        default=3,
        help="timed steps of each model, alternating (default 3; 11+ for quartiles that mean something)",
    )
    _keep_freed_arg(p)
    p.set_defaults(func=cmd_bench)

    p = sub.add_parser("profile", help="profile a model: per-node table of implementations and costs")
    _model_args(p)
    _profile_args(p)
    p.add_argument("-o", "--output", help="write the problem JSON here")
    p.set_defaults(func=cmd_profile)

    p = sub.add_parser("trace", help="trace a model and print its operator graph")
    _model_args(p)  # (no profiling flags: tracing measures nothing)
    p.set_defaults(func=cmd_trace)

    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if getattr(args, "highs_log", False):
        import os

        os.environ["MONET_OPT_HIGHS_LOG"] = "1"
    if getattr(args, "keep_freed_memory", False):
        from monet_opt.malloc import keep_freed_memory

        if not keep_freed_memory():
            print("--keep-freed-memory: not glibc, nothing changed", file=sys.stderr)
    try:
        return args.func(args)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the output was piped into something that stopped reading (head)
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no error at exit's flush
        return 141
    except (ValueError, FileNotFoundError, RuntimeError, ImportError) as exc:
        print(f"monet-opt {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
