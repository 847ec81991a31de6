"""monet_opt.memory: the peak-memory meter."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from monet_opt.memory import PeakMemory, infer_device, measure_peak, track_peak

sys.path.insert(0, str(Path(__file__).parent))
import models as M  # noqa: E402

MB4 = 4 * 2**20
N4 = MB4 // 4  # float32 elements in 4 MiB


def _close(got: int, want: int, rel: float = 0.02) -> bool:
    return abs(got - want) <= rel * want


def test_known_allocations_with_a_free_in_between():
    def fn():
        a = torch.ones(N4)
        b = torch.ones(N4)
        del a
        c = torch.ones(N4)
        return b, c

    m = measure_peak(fn)
    assert isinstance(m, PeakMemory)
    assert m.device == "cpu" and m.method == "cpu-profiler-alloc-events"
    assert _close(m.peak_bytes, 2 * MB4), m
    assert _close(m.retained_bytes, 2 * MB4), m
    b, c = m.result
    assert b.numel() == N4 and c.numel() == N4


def test_known_allocations_all_live():
    def fn():
        a = torch.ones(N4)
        b = torch.ones(N4)
        c = torch.ones(N4)
        return (a + 0).sum() + b.sum() + c.sum()  # a + 0: a 4th transient 4 MiB

    m = measure_peak(fn)
    assert _close(m.peak_bytes, 4 * MB4), m
    assert m.retained_bytes < 1024  # only the scalar result survives


def test_live_before_is_not_counted():
    big = torch.ones(4 * N4)  # 16 MiB alive before the call

    def fn(t):
        return t * 2  # one new 16 MiB tensor

    m = measure_peak(fn, big)
    assert _close(m.peak_bytes, 4 * MB4), m
    assert m.baseline_bytes == 0


def test_context_manager_form():
    with track_peak("cpu") as m:
        x = torch.empty(N4)
        y = torch.empty(N4)
        del x
    assert _close(m.peak_bytes, 2 * MB4)
    assert _close(m.retained_bytes, MB4)
    assert m.result is None
    del y


def test_exception_still_fills_the_result():
    with pytest.raises(ValueError):
        with track_peak("cpu") as m:
            keep = torch.empty(N4)
            raise ValueError("boom")
    assert _close(m.peak_bytes, MB4)
    del keep


def test_kernel_workspace_is_seen():
    # A convolution's peak includes more than its output (oneDNN scratch / im2col),
    # or at least the output: never less.
    conv = torch.nn.Conv2d(16, 32, 3, padding=1)
    x = torch.randn(4, 16, 32, 32)
    with torch.no_grad():
        m = measure_peak(conv, x)
    out_bytes = m.result.numel() * m.result.element_size()
    assert m.peak_bytes >= out_bytes


def test_training_step_peak_exceeds_forward_only():
    model, x = M.resnet18(batch=2, size=64)

    def step():
        out = model(x)
        out.sum().backward()

    def forward():
        with torch.no_grad():
            return model(x)

    step()  # warm up (lazy allocations, oneDNN primitives)
    model.zero_grad(set_to_none=True)
    train = measure_peak(step)
    model.zero_grad(set_to_none=True)
    fwd = measure_peak(forward)
    assert train.peak_bytes > fwd.peak_bytes > 0
    # the step allocates at least the parameter gradients
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    assert train.peak_bytes > param_bytes
    assert train.retained_bytes >= param_bytes  # gradients stay (set_to_none before)


def test_device_inference():
    assert infer_device(torch.nn.Linear(2, 2)) == torch.device("cpu")
    assert infer_device(1, [torch.zeros(1)]) == torch.device("cpu")
    assert infer_device().type == ("cuda" if torch.cuda.is_available() else "cpu")


def test_unknown_device_is_refused():
    with pytest.raises(ValueError, match="meta"):
        with track_peak("meta"):
            pass


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_known_allocations():  # pragma: no cover - no GPU on the CI box
    def fn():
        a = torch.ones(N4, device="cuda")
        b = torch.ones(N4, device="cuda")
        del a
        c = torch.ones(N4, device="cuda")
        return b, c

    m = measure_peak(fn)
    assert m.method == "cuda-allocator-stats"
    assert _close(m.peak_bytes, 2 * MB4)


def test_nested_cpu_measurement_is_refused():
    with track_peak("cpu") as outer:
        x = torch.empty(N4)
        with pytest.raises(RuntimeError, match="already active"):
            with track_peak("cpu"):
                pass
    assert _close(outer.peak_bytes, MB4)  # the outer session is intact
    del x
