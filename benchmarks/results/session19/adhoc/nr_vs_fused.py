import copy
import statistics
from pathlib import Path

import torch

import solver
from monet_opt.bench import interleaved_samples, paired_ratio
from monet_opt.malloc import keep_freed_memory
from monet_opt.runtime import MonetWrapper
from monet_opt.step_in_backward import fuse_into_backward, optimizer_factory
from monet_opt.zoo import ModelSpec
from solver.baselines import no_recompute

keep_freed_memory()
D = str(Path(__file__).resolve().parents[1] / "frontier_refine" / "schedules") + "/"
P = solver.Problem.from_json(D + "resnet50_adam_0.3333_refined_problem.json")
spec = ModelSpec("resnet50", batch=8, image=224)
torch.manual_seed(0)
model = spec.build().train()
inputs = spec.example_inputs()
fused = copy.deepcopy(model)
fuse_into_backward(fused, optimizer_factory("adam"))
w = MonetWrapper(copy.deepcopy(model), no_recompute(P), example_inputs=inputs, optimizer="adam")
a, b = interleaved_samples(fused, w, inputs, 9)
print(
    f"adam: fused {statistics.median(a):.3f} wrapped-nr {statistics.median(b):.3f} paired {paired_ratio(a, b)}"
)
P0 = solver.Problem.from_json(D + "resnet50_problem.json")
w0 = MonetWrapper(copy.deepcopy(model), no_recompute(P0), example_inputs=inputs)
a, b = interleaved_samples(model, w0, inputs, 9)
print(
    f"plain: plain {statistics.median(a):.3f} wrapped-nr {statistics.median(b):.3f} paired {paired_ratio(a, b)}"
)
