"""Model in, schedule out: trace, profile, solve, with the metadata tools read."""

from __future__ import annotations

import dataclasses
from typing import Any

from torch import nn

import solver
from monet_opt import fastest_found
from monet_opt.keyword_inputs import as_traceable
from monet_opt.profile import build_problem
from solver.baselines import plan_of
from solver.problem import Problem
from solver.schedule import Schedule


def no_recompute_peak(problem: Problem) -> int:
    """Simulated peak of plain PyTorch (keep everything, weight gradients not deferred) for this
    problem."""
    from solver.baselines import no_recompute

    plain = problem.without_deferral()
    return solver.simulate(plain, no_recompute(plain)).peak_bytes


def parse_budget(text: str | float | int) -> float | int | str:
    """'0.5' -> fraction 0.5; '2GiB', '800MB', '123456' -> bytes; 'min' -> 'min' (smallest peak found)."""
    if isinstance(text, bool):
        raise ValueError(f"bad budget {text!r}: give a fraction in (0, 1], a number of bytes, or 'min'")
    if isinstance(text, float):
        if not 0.0 < text <= 1.0:
            raise ValueError(f"bad budget {text}: a fractional budget is in (0, 1] (of plain PyTorch's peak)")
        return text
    if isinstance(text, int):
        if text < 1:
            raise ValueError(f"bad budget {text}: a budget in bytes must be positive")
        if text == 1:
            raise ValueError("bad budget 1: an int budget is bytes; for plain PyTorch's whole peak give 1.0")
        return text
    t = text.strip().replace(" ", "")
    if t.lower() == "min":
        return "min"
    units = {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "KB": 10**3, "MB": 10**6, "GB": 10**9, "B": 1}
    upper = t.upper()
    for unit, scale in units.items():
        if upper.endswith(unit):
            number = upper[: -len(unit)]
            try:
                return int(float(number) * scale)
            except ValueError:
                break
    else:
        try:
            value = float(t)
        except ValueError:
            value = None
        if value is not None:
            if 0 < value <= 1:
                return value
            if value >= 2**20 and value == int(value):
                return int(value)  # a number of bytes
            if value > 1:
                raise ValueError(
                    f"bad budget {text!r}: a bare number above 1 is read as bytes, and {t} bytes is "
                    "surely not meant; give a fraction in (0, 1] (e.g. 0.5) or a size with a unit (800MB, 2GiB)"
                )
    raise ValueError(
        f"bad budget {text!r}: give a fraction of the plain-PyTorch peak in (0, 1] (e.g. 0.5) "
        "or a size such as 800MB, 2GiB or a number of bytes, or 'min' for the smallest peak the solver finds"
    )


def solve_model(
    model: nn.Module,
    example_inputs: Any,
    budget: float | int | str,
    time_limit: float = 60.0,
    verbose: bool = True,
    problem: Problem | None = None,
    meta: dict | None = None,
    optimizer: Any = None,
    zero_pack: bool = False,
    bitwise: bool = False,
    refine: int = 0,
    milp_solver: str = "highs",
    grad_outputs: str = "auto",
    outputs_held: str = "all",
    defer_weight_grads: bool = False,
    reuse: bool = True,
) -> tuple[Problem, Schedule]:
    """Profile `model` on this device (cached) and solve for `budget`. example_inputs: a tensor,
    a tuple of them, or a dict by keyword (`{'input_ids': ids, 'labels': ids, 'use_cache': False}`
    for a Hugging Face model: `monet_opt.keyword_inputs`). optimizer: solve for its
    step inside the backward (see `build_problem`; run with `MonetWrapper(..., optimizer=)`).
    zero_pack: also offer convolutions that keep their ReLU input packed (see `build_problem`).
    bitwise: offer only implementations whose gradients are bit for bit torch's (see `build_problem`).
    refine: that many rounds of running the schedule found, correcting the problem's times by
    what its nodes took there (`monet_opt.calibrate.calibrate_on_schedule`) and solving again from
    it (`time_limit` each); the problem returned is the last corrected one.
    milp_solver: "highs" or "gurobi" (`solver.solve`'s `solver`).
    grad_outputs: which outputs the loss reads ("auto": a returned loss alone; see `build_problem`).
    outputs_held: "loss" for a loop that drops the outputs the loss does not read before the
    backward (Hugging Face's Trainer; see `build_problem`).
    defer_weight_grads: with gradients kept, make heavy weight gradients after the backward (see
    `build_problem`).
    reuse: start from the fastest schedule an earlier solve of this problem found that fits the
    budget (`monet_opt.fastest_found`; else the lowest-peak one kept there), so
    solving again goes on from it; False solves from scratch. What is found is kept either way."""
    solver.milp.check_backend(milp_solver)  # before profiling: a missing Gurobi fails at once
    budget = parse_budget(budget)  # so does a bad budget
    # (inputs by keyword, {'input_ids': ids, 'labels': ids, 'use_cache': False}: the model is
    # traced, profiled and refined through a root taking them positionally)
    model, example_inputs = as_traceable(model, example_inputs)
    problem = problem or build_problem(
        model,
        example_inputs,
        progress=verbose,
        meta=meta,
        optimizer=optimizer,
        zero_pack=zero_pack,
        bitwise=bitwise,
        grad_outputs=grad_outputs,
        outputs_held=outputs_held,
        defer_weight_grads=defer_weight_grads,
    )
    # the fastest schedule an earlier solve of this problem found within the budget; else the
    # lowest-peak one: a budget an error named is met from it, and 'min' never ends above it
    # (`monet_opt.fastest_found`)
    start = None
    started_from = None
    resume = False  # the kept schedule was solved for this very budget: the solve goes on from it
    if reuse and budget != "min":
        budget_bytes = solver.milp.resolve_budget(problem, budget)
        fast = fastest_found.recall_plan(problem, budget_bytes)
        if fast is not None:
            start, found = fast
            resume = found.schedule.budget_bytes == budget_bytes
            started_from = {"time_s": found.time_s, "peak_bytes": found.peak_bytes, "resumed": resume}
            if verbose:
                print(
                    f"starting from the fastest schedule an earlier solve of this problem found within the "
                    f"budget: {found.time_s * 1e3:.1f} ms per step, peak {found.peak_bytes / 2**20:.1f} MiB "
                    "(--fresh: solve from scratch)",
                    flush=True,
                )
    if reuse and start is None:
        start = fastest_found.lowest_plan(problem)
    try:
        if budget == "min":
            schedule = solver.minimum_peak(
                problem, time_limit=time_limit, verbose=verbose, solver=milp_solver, start_plan=start
            )
        else:
            schedule = solver.solve(
                problem,
                budget,
                time_limit=time_limit,
                verbose=verbose,
                solver=milp_solver,
                start_plan=start,
                resume=resume,
            )
        fastest_found.remember(problem, schedule)
        if started_from is not None:
            schedule = dataclasses.replace(
                schedule, meta={**schedule.meta, "started_from_kept": started_from}
            )
    except solver.InfeasibleBudget as exc:
        if exc.lowest is not None:
            fastest_found.remember(problem, exc.lowest)
        raise
    if refine:
        problem, schedule = refine_schedule(
            model, example_inputs, problem, schedule, refine, time_limit, verbose, optimizer, milp_solver
        )
    return problem, _with_problem_meta(problem, schedule)


def refine_schedule(
    model: nn.Module,
    example_inputs: tuple,
    problem: Problem,
    schedule: Schedule,
    rounds: int = 1,
    time_limit: float = 60.0,
    verbose: bool = True,
    optimizer: Any = None,
    milp_solver: str = "highs",
) -> tuple[Problem, Schedule]:
    """`rounds` times: run `schedule`, correct the problem's times by what its nodes took there
    (`monet_opt.calibrate.calibrate_on_schedule`), and solve the corrected problem again for the
    same budget, started from `schedule` (it fits: memory is unchanged), so never slower than it
    on the corrected costs. Returns the last corrected problem and its schedule (with the problem's
    metadata, as `solve_model`'s: `monet-opt bench FILE` reads the model from it)."""
    from monet_opt.calibrate import calibrate_on_schedule

    budget = schedule.budget_bytes or schedule.predicted_peak_bytes
    for k in range(rounds):
        if verbose:
            print(f"refine {k + 1}/{rounds}: timing the schedule's nodes in its own steps", flush=True)
        problem = calibrate_on_schedule(model, example_inputs, problem, schedule, optimizer=optimizer)
        start = plan_of(problem, schedule)
        schedule = solver.solve(
            problem, budget, time_limit=time_limit, verbose=verbose, start_plan=start, solver=milp_solver
        )
    return problem, _with_problem_meta(problem, schedule)


def sweep_model(
    problem: Problem,
    budgets: list,
    time_limit: float = 60.0,
    verbose: bool = True,
    milp_solver: str = "highs",
) -> list[Schedule | ValueError]:
    """One schedule per budget (parsed as `parse_budget`; 'min' is solved alone), through
    `solver.sweep`: tightest first, so a looser budget's schedule is never slower. Each entry is
    the schedule or the error its budget raised, in the order given."""
    parsed = [parse_budget(b) for b in budgets]
    sized = [k for k, b in enumerate(parsed) if b != "min"]
    out: list = [None] * len(parsed)
    start = fastest_found.lowest_plan(problem)  # (as solve_model: `monet_opt.fastest_found`)
    found = solver.sweep(
        problem,
        [parsed[k] for k in sized],
        time_limit=time_limit,
        verbose=verbose,
        solver=milp_solver,
        start_plan=start,
    )
    for k, result in zip(sized, found):
        out[k] = result
    for k, b in enumerate(parsed):
        if b == "min":
            try:
                out[k] = solver.minimum_peak(
                    problem, time_limit=time_limit, verbose=verbose, solver=milp_solver, start_plan=start
                )
            except ValueError as exc:
                out[k] = exc
    for result in out:  # (kept unless a kept one is as fast at no higher peak)
        found = getattr(result, "lowest", None) if isinstance(result, Exception) else result
        if found is not None:
            fastest_found.remember(problem, found)  # (a later `solve` starts from it)
    return [r if isinstance(r, Exception) else _with_problem_meta(problem, r) for r in out]


def _with_problem_meta(problem: Problem, schedule: Schedule) -> Schedule:
    """The schedule with its problem's metadata (model, device, versions) and its budget as a
    fraction of the no-recompute peak."""
    plain = no_recompute_peak(problem)
    info = dict(problem.meta)
    info.update(schedule.meta)
    info.update(
        no_recompute_peak_bytes=plain,
        budget_fraction=round(schedule.budget_bytes / plain, 4) if schedule.budget_bytes else None,
    )
    return dataclasses.replace(schedule, meta=info)
