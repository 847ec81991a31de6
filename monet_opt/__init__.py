"""monet-opt: fit a PyTorch training step into a memory budget at the least slowdown.

import monet_opt
problem, schedule = monet_opt.solve_model(model, example_inputs, budget=0.5)
wrapped = monet_opt.MonetWrapper(model, schedule, input_shape=example_inputs.shape)
loss = criterion(wrapped(x), y); loss.backward()
"""

from monet_opt.graph import OpGraph, OpNode, TraceError, trace
from monet_opt.memory import PeakMemory, measure_peak
from monet_opt.pipeline import parse_budget, solve_model
from monet_opt.profile import build_problem
from monet_opt.runtime import InputShapeMismatch, MonetWrapper
from monet_opt.zoo import build_model, load_schedule

__all__ = [
    "InputShapeMismatch",
    "MonetWrapper",
    "OpGraph",
    "OpNode",
    "PeakMemory",
    "TraceError",
    "build_model",
    "build_problem",
    "load_schedule",
    "measure_peak",
    "parse_budget",
    "solve_model",
    "trace",
]
