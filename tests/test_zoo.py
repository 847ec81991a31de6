"""Shipped schedules: found by model/size/budget, still valid for today's models and tracer."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import solver
from monet_opt.runtime import MonetWrapper
from monet_opt.zoo import ModelSpec, UnknownModel, build_model, load_schedule, shipped_schedules

SHIPPED = shipped_schedules()


def test_some_schedules_are_shipped():
    assert SHIPPED, "schedules/ holds no schedule"
    for path, meta in SHIPPED:
        for key in ("model", "batch", "device", "torch", "date", "measured_peak_bytes", "plain_peak_bytes"):
            assert key in meta, f"{path.name}: meta lacks {key}"
        schedule = solver.Schedule.from_json(path)
        assert schedule.predicted_peak_bytes <= schedule.budget_bytes
        assert meta["measured_peak_bytes"] <= schedule.budget_bytes * 1.0001, (
            f"{path.name}: measured over budget"
        )


def _spec(meta) -> ModelSpec:
    return ModelSpec(
        meta["model"], batch=meta["batch"], image=meta.get("image", 224), seq=meta.get("seq", 128)
    )


# the shipped schedules by model and input shape: one wrap (a trace of the model at full size, 2-12
# s each here) checks every schedule of that model and shape with the same fingerprint
BY_SPEC: dict[ModelSpec, list] = {}
for _path, _meta in SHIPPED:
    BY_SPEC.setdefault(_spec(_meta), []).append(_path)


@pytest.mark.parametrize("spec", list(BY_SPEC), ids=[f"{s.name}_b{s.batch}" for s in BY_SPEC])
def test_shipped_schedules_fit_their_model(spec):
    """The fingerprint still matches what today's tracer makes of the model (no training step):
    a wrap with a schedule of this model and shape; every other schedule of it either has that
    same fingerprint or is wrapped too."""
    checked: set[str] = set()
    for path in BY_SPEC[spec]:
        fingerprint = solver.Schedule.from_json(path).fingerprint
        if fingerprint not in checked:
            MonetWrapper(spec.build(), path, example_inputs=spec.example_inputs())
            checked.add(fingerprint)


def test_shortcut_takes_the_batch_and_image_of_the_input_and_never_a_larger_budget():
    from monet_opt.zoo import load_schedule_by_shortcut

    got = load_schedule_by_shortcut("resnet50@0.5", (8, 3, 224, 224))
    assert (got.meta["batch"], got.meta["image"], got.meta["budget_fraction"]) == (8, 224, 0.5)
    got = load_schedule_by_shortcut("resnet50@0.5", (16, 3, 224, 224))
    assert got.meta["batch"] == 16
    with pytest.warns(UserWarning, match="using 0.4"):
        got = load_schedule_by_shortcut("resnet50@0.42", (8, 3, 224, 224))
    assert got.meta["budget_fraction"] == 0.4
    with pytest.raises(FileNotFoundError, match="shipped budgets: 0.33"):
        load_schedule_by_shortcut("resnet50@0.2", (8, 3, 224, 224))
    for bad in ("resnet50@half", "resnet50@0.5:x3", "resnet50@1.5"):
        with pytest.raises(ValueError, match="bad schedule shortcut"):
            load_schedule_by_shortcut(bad, (8, 3, 224, 224))


def test_load_schedule_nearest_budget_and_errors():
    path, meta = SHIPPED[0]
    got = load_schedule(
        meta["model"], batch=meta["batch"], image=meta.get("image"), budget=meta["budget_fraction"]
    )
    assert got.meta["budget_fraction"] == meta["budget_fraction"]
    with pytest.raises(FileNotFoundError, match="shipped"):
        load_schedule("resnet18", batch=3, image=17, budget=0.5)


def test_unknown_model_is_a_clear_error():
    with pytest.raises(UnknownModel, match="unknown model"):
        build_model("resnet_does_not_exist")
    with pytest.raises(UnknownModel, match="cannot import"):
        build_model("no_such_package.models:make")
    assert isinstance(build_model("resnet18"), torch.nn.Module)
    with pytest.raises(UnknownModel, match="timm has no model"):
        build_model("timm/no_such_net")
    with pytest.raises(UnknownModel, match="gpt2-medium"):
        build_model("hf/no_such_lm")


def test_timm_and_hugging_face_names_build_random_models():
    net = build_model("timm/convnext_atto", image=32)
    assert net(torch.randn(1, 3, 32, 32)).shape == (1, 1000)
    lm = build_model("hf/gpt2")  # GPT-2 small from the library's default configuration
    assert sum(p.numel() for p in lm.parameters()) > 100e6
    spec = ModelSpec("hf/gpt2", batch=2, seq=16)
    (ids,) = spec.example_inputs()
    assert ids.dtype == torch.int64 and "seq 16" in spec.describe()
    with torch.no_grad():
        assert lm.eval()(ids).dim() == 0  # the loss, with the ids as labels


def test_a_channels_last_spec_builds_and_records_a_channels_last_model():
    """`--channels-last` (ModelSpec.channels_last): weights and inputs channels_last, recorded in
    the metadata `monet-opt bench FILE` rebuilds the model from; a shipped (contiguous) schedule
    does not wrap it."""
    from monet_opt.bench import spec_of

    spec = ModelSpec("resnet18", batch=2, image=32, channels_last=True)
    model, (x,) = spec.build(), spec.example_inputs()
    assert model.conv1.weight.is_contiguous(memory_format=torch.channels_last)
    assert not model.conv1.weight.is_contiguous()
    assert x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous()
    assert "channels_last" in spec.describe()
    assert spec_of(SimpleNamespace(meta=spec.meta())) == spec
    assert spec_of(SimpleNamespace(meta=ModelSpec("resnet18", batch=2).meta())).channels_last is False
