"""Session 55 probe: two schedules of one model, A and B, timed against each other in alternating
rounds in one process (`monet_opt.bench.interleaved_samples`; freed memory kept), and each against
plain PyTorch the same way. Schedules solved with the optimizer step in the backward run on copies
of the model with that step, against a plain copy with the step fused into its backward.

    python benchmarks/results/session55/ab_schedules.py A.json B.json STEPS
"""

import copy
import sys

import torch

from monet_opt.bench import interleaved_samples, measure_step_peak, paired_ratio, spec_of
from monet_opt.malloc import keep_freed_memory
from monet_opt.runtime import MonetWrapper
from monet_opt.step_in_backward import fuse_into_backward, optimizer_factory
from solver import Schedule

keep_freed_memory()
a_path, b_path, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
A, B = Schedule.from_json(a_path), Schedule.from_json(b_path)
spec = spec_of(A)
torch.manual_seed(0)
model = spec.build().train()
inputs = spec.example_inputs(torch.device("cpu"))
optimizer = A.meta.get("step_in_backward", {}).get("optimizer")
plain = copy.deepcopy(model)
if optimizer is not None:
    fuse_into_backward(plain, optimizer_factory(optimizer))
wa = MonetWrapper(copy.deepcopy(model), A, example_inputs=inputs, optimizer=optimizer)
wb = MonetWrapper(copy.deepcopy(model), B, example_inputs=inputs, optimizer=optimizer)
for name, s, w in (("A", A, wa), ("B", B, wb)):
    made = sum(1 for st in s.stages for x in st.steps if x.op == "make_state")
    print(
        f"{name}: {s.strategy}, predicted {s.predicted_time_s * 1e3:.0f} ms, {s.predicted_peak_bytes / 2**20:.1f} MiB;"
        f" measured peak {measure_step_peak(w, inputs) / 2**20:.1f} MiB; {made} make_state steps",
        flush=True,
    )
ta, tb = interleaved_samples(wa, wb, inputs, steps)
med, q1, q3 = paired_ratio(ta, tb)
print(f"B / A: {med - 1:+.1%} ({q1 - 1:+.1%} .. {q3 - 1:+.1%}), {steps} rounds", flush=True)
for name, w in (("A", wa), ("B", wb)):
    tp, tw = interleaved_samples(plain, w, inputs, steps)
    med, q1, q3 = paired_ratio(tp, tw)
    print(f"{name} / plain: {med - 1:+.1%} ({q1 - 1:+.1%} .. {q3 - 1:+.1%})", flush=True)
