"""Session 59 probe: schedules run with the in-place batch-norm backward's new form (sums from the
kept tensor) and with the x_hat form it replaced (`norm._fast_source` patched to refuse), beside
fused plain PyTorch, in alternating rounds of one process.

python benchmarks/results/session59/ab.py ROUNDS SCHEDULE.json [SCHEDULE.json ...]
"""

import copy
import statistics
import sys

import torch

from monet_opt.bench import paired_ratio, spec_of, timed_step
from monet_opt.malloc import keep_freed_memory
from monet_opt.ops import norm
from monet_opt.runtime import MonetWrapper
from monet_opt.step_in_backward import fuse_into_backward, optimizer_factory
from solver.schedule import Schedule


def main() -> None:
    keep_freed_memory()
    fast_source = norm._fast_source
    rounds = int(sys.argv[1])
    scheds = [Schedule.from_json(p) for p in sys.argv[2:]]
    spec = spec_of(scheds[0])
    base = spec.build().train()
    inputs = spec.example_inputs(torch.device("cpu"))
    opt = scheds[0].meta["step_in_backward"]["optimizer"]
    plain = copy.deepcopy(base)
    fuse_into_backward(plain, optimizer_factory(opt))
    runs = [("plain", plain, True)]
    for k, s in enumerate(scheds):
        w = MonetWrapper(copy.deepcopy(base), s, example_inputs=inputs, optimizer=opt)
        runs += [(f"s{k} new", w, True), (f"s{k} old", w, False)]
    times: dict[str, list[float]] = {name: [] for name, _, _ in runs}
    for r in range(rounds):
        for name, model, fast in runs if r % 2 == 0 else runs[::-1]:
            norm._fast_source = fast_source if fast else (lambda *a: False)
            timed_step(model, inputs)
            times[name].append(timed_step(model, inputs))
    norm._fast_source = fast_source
    for name, ts in times.items():
        med, q1, q3 = paired_ratio(times["plain"], ts)
        print(
            f"{name:10s} median {statistics.median(ts) * 1e3:7.1f} ms  vs plain {100 * (med - 1):+5.1f}% "
            f"({100 * (q1 - 1):+.1f} .. {100 * (q3 - 1):+.1f})"
        )


if __name__ == "__main__":
    main()
