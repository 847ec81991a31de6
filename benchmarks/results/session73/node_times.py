"""In-step node times of three runs of one model, steps interleaved: the problem's no-recompute
schedule with default implementations ("base"), the same with SCHEDULE's chosen implementations
("chosen"), and SCHEDULE itself ("schedule"); every executor with separate graphs (each node's
own backward timed, as the calibration does). Printed per (operator, implementation) family of
the chosen nodes, and for the nodes whose implementation is the default, beside the problem's
predictions.

    python benchmarks/results/session73/node_times.py SCHEDULE.json PROBLEM.json [--steps 7]
"""

from __future__ import annotations

import argparse
import collections
import copy
import sys

import torch

from monet_opt.bench import spec_of, timed_step, zero_grad
from monet_opt.malloc import keep_freed_memory
from monet_opt.node_timer import FORWARD, RECOMPUTE, NodeTimer
from monet_opt.runtime import MonetWrapper
from solver import Problem, Schedule, baselines


def chosen_impls(schedule: Schedule) -> dict[str, str]:
    out = {}
    for stage in schedule.stages:
        for step in stage.steps:
            if step.op == "compute" and step.node not in out:
                out[step.node] = step.impl
    return out


def load(schedule_path: str, problem_path: str):
    """(schedule, problem, model, inputs): the schedule's zoo model (seed 0, training) and inputs,
    glibc keeping freed memory (`monet_opt.malloc`) as in the frontier runs."""
    keep_freed_memory()
    schedule = Schedule.from_json(schedule_path)
    problem = Problem.from_json(problem_path)
    spec = spec_of(schedule)
    torch.manual_seed(0)
    return schedule, problem, spec.build().train(), spec.example_inputs()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("schedule")
    ap.add_argument("problem")
    ap.add_argument("--steps", type=int, default=7)
    ap.add_argument("--dump", help="write every node's medians (JSON) here")
    ap.add_argument("--grouped", action="store_true", help="keep the runtime's groups (no per-node backward)")
    args = ap.parse_args(argv)
    schedule, problem, model, inputs = load(args.schedule, args.problem)
    nodes = {n.name: n for n in problem.nodes}
    picked = chosen_impls(schedule)
    chosen = {k: v for k, v in picked.items() if v != nodes[k].impls[0].name}

    runs = {
        "base": baselines.no_recompute(problem),
        "chosen": baselines.no_recompute(problem, impls=chosen),
        "schedule": schedule,
    }
    wrapped, timers = {}, {}
    for label, sched in runs.items():
        w = MonetWrapper(copy.deepcopy(model), sched, example_inputs=inputs)
        if not args.grouped:
            w.executor.separate_graphs()
        wrapped[label] = w
        timers[label] = NodeTimer(w.executor, inputs)
    for label in runs:
        timed_step(wrapped[label], inputs)
    step_s = collections.defaultdict(list)
    for r in range(args.steps):
        order = list(runs) if r % 2 == 0 else list(reversed(runs))
        for label in order:
            timed_step(wrapped[label], inputs)  # untimed: after its own step
            timers[label].recording = True
            step_s[label].append(timed_step(wrapped[label], inputs))
            timers[label].recording = False
            print(f"round {r} {label} {step_s[label][-1]:.3f}", file=sys.stderr, flush=True)
    med = {}
    for label in runs:
        med[label] = (
            timers[label].medians(FORWARD),
            timers[label].backward_medians(),
            timers[label].medians(RECOMPUTE),
        )
        timers[label].close()
        zero_grad(wrapped[label])

    if args.dump:
        import json

        with open(args.dump, "w") as f:
            json.dump(
                {label: {"forward": m[0], "backward": m[1], "recompute": m[2]} for label, m in med.items()}, f
            )

    def impl_of(name, impl):
        return next(im for im in nodes[name].impls if im.name == impl)

    rows = collections.defaultdict(lambda: collections.defaultdict(float))
    for name in nodes:
        impl = chosen.get(name, nodes[name].impls[0].name)
        key = (nodes[name].op, impl) if name in chosen else ("(default)", nodes[name].op)
        r = rows[key]
        r["n"] += 1
        d, c = nodes[name].impls[0], impl_of(name, impl)
        r["pred_f_default"] += d.fwd_time
        r["pred_f_chosen"] += c.fwd_time
        r["pred_b_default"] += d.bwd_time if nodes[name].requires_backward else 0
        r["pred_b_chosen"] += c.bwd_time if nodes[name].requires_backward else 0
        for label in runs:
            f, b, _ = med[label]
            r[f"f_{label}"] += f.get(name, 0.0)
            r[f"b_{label}"] += b.get(name, 0.0)
    print(
        "| family | n | fwd predicted default / chosen | fwd in-step base / chosen / schedule | bwd predicted default / chosen | bwd in-step base / chosen / schedule |"
    )
    print("|---|---:|---|---|---|---|")
    tot = collections.defaultdict(float)
    for key in sorted(rows, key=str):
        r = rows[key]
        for k, v in r.items():
            tot[k] += v
        print(
            f"| {key[0]} {key[1]} | {int(r['n'])} | {r['pred_f_default'] * 1e3:.1f} / {r['pred_f_chosen'] * 1e3:.1f} | "
            f"{r['f_base'] * 1e3:.1f} / {r['f_chosen'] * 1e3:.1f} / {r['f_schedule'] * 1e3:.1f} | "
            f"{r['pred_b_default'] * 1e3:.1f} / {r['pred_b_chosen'] * 1e3:.1f} | "
            f"{r['b_base'] * 1e3:.1f} / {r['b_chosen'] * 1e3:.1f} / {r['b_schedule'] * 1e3:.1f} |"
        )
    r = tot
    print(
        f"| all | {int(r['n'])} | {r['pred_f_default'] * 1e3:.1f} / {r['pred_f_chosen'] * 1e3:.1f} | "
        f"{r['f_base'] * 1e3:.1f} / {r['f_chosen'] * 1e3:.1f} / {r['f_schedule'] * 1e3:.1f} | "
        f"{r['pred_b_default'] * 1e3:.1f} / {r['pred_b_chosen'] * 1e3:.1f} | "
        f"{r['b_base'] * 1e3:.1f} / {r['b_chosen'] * 1e3:.1f} / {r['b_schedule'] * 1e3:.1f} |"
    )
    rec = sum(med["schedule"][2].values())
    print(f"\nschedule recompute (sum of node medians) {rec * 1e3:.1f} ms")
    for label in runs:
        s = sorted(step_s[label])
        print(f"{label}: median step {s[len(s) // 2] * 1e3:.0f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
