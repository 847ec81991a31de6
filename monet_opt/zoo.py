"""Named models and the schedules shipped in `schedules/`.

A model name is a torchvision classification model (`resnet50`, `vgg16`, ...),
a built-in (`gpt`), or `package.module:factory` for a user's own model (the
factory is called with no arguments and returns an nn.Module).
"""

from __future__ import annotations

import importlib
import json
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from solver.schedule import Schedule

SCHEDULES_DIR = Path(__file__).resolve().parent.parent / "schedules"
TOKEN_MODELS = {"gpt"}


class UnknownModel(ValueError):
    pass


@dataclass(frozen=True)
class ModelSpec:
    name: str
    batch: int
    image: int = 224
    seq: int = 128

    def build(self) -> nn.Module:
        return build_model(self.name, image=self.image)

    def example_inputs(self, device: torch.device | str = "cpu") -> tuple[torch.Tensor, ...]:
        if self.name in TOKEN_MODELS:
            return (torch.randint(0, 512, (self.batch, self.seq), device=device),)
        return (torch.randn(self.batch, 3, self.image, self.image, device=device),)

    def meta(self) -> dict:
        """What a problem's and its schedules' metadata record of the model, so that
        `monet-opt bench FILE` can rebuild it."""
        return {
            "model": self.name,
            "batch": self.batch,
            "image": self.image,
            "seq": self.seq,
            "model_summary": self.describe(),
        }

    def describe(self) -> str:
        size = f"seq {self.seq}" if self.name in TOKEN_MODELS else f"image {self.image}x{self.image}"
        return f"{self.name}, batch {self.batch}, {size}"


def build_model(name: str, image: int = 224) -> nn.Module:
    """Build a model by name with random weights (never downloads anything)."""
    torch.manual_seed(0)
    if name == "gpt":
        from monet_opt.models import GPT

        return GPT()
    if ":" in name:
        module_name, factory = name.split(":", 1)
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            raise UnknownModel(f"cannot import {module_name!r} for model {name!r}: {exc}") from exc
        if not hasattr(module, factory):
            raise UnknownModel(f"module {module_name!r} has no factory {factory!r}")
        return getattr(module, factory)()
    import torchvision.models as tvm

    names = set(tvm.list_models(module=tvm))
    if name not in names:
        raise UnknownModel(
            f"unknown model {name!r}: use a torchvision classification model "
            f"(e.g. resnet18, resnet50, vgg16, mobilenet_v2, googlenet, vit_b_16), 'gpt', "
            "or 'package.module:factory'"
        )
    kwargs: dict = {"weights": None}
    if name == "googlenet" or name.startswith("inception"):
        kwargs.update(aux_logits=False, init_weights=False)
    if name.startswith("vit_"):
        kwargs["image_size"] = image
    return tvm.get_model(name, **kwargs)


# -- shipped schedules ----------------------------------------------------------------
def shipped_schedules() -> list[tuple[Path, dict]]:
    out = []
    for path in sorted(SCHEDULES_DIR.glob("*.json")):
        try:
            meta = json.loads(path.read_text()).get("meta", {})
        except (OSError, ValueError):
            continue
        out.append((path, meta))
    return out


def load_schedule(
    model: str, batch: int, image: int | None = None, budget: float = 0.5, seq: int | None = None
) -> Schedule:
    """The shipped schedule for (model, batch, image/seq) whose budget fraction is nearest."""
    matches = []
    for path, meta in shipped_schedules():
        if meta.get("model") != model or meta.get("batch") != batch:
            continue
        if image is not None and meta.get("image") not in (None, image):
            continue
        if seq is not None and meta.get("seq") not in (None, seq):
            continue
        matches.append((abs(float(meta.get("budget_fraction", 1.0)) - budget), path))
    if not matches:
        have = ", ".join(
            f"{m.get('model')}@{m.get('budget_fraction')} (batch {m.get('batch')}, image {m.get('image')})"
            for _, m in shipped_schedules()
        )
        raise FileNotFoundError(
            f"no shipped schedule for {model} batch {batch} image {image}; shipped: {have or 'none'}. "
            f"Make one with: monet-opt solve {model} --batch {batch} --image {image} --budget {budget} -o FILE.json"
        )
    schedule = Schedule.from_json(min(matches)[1])
    warn_if_other_device(schedule)
    return schedule


def load_schedule_by_shortcut(text: str) -> Schedule:
    """'resnet50@0.5' or 'resnet50@0.5:b8:i224' -> the nearest shipped schedule."""
    if "@" not in text:
        raise FileNotFoundError(f"schedule file not found: {text}")
    model, rest = text.split("@", 1)
    parts = rest.split(":")
    budget = float(parts[0])
    batch, image = None, None
    for p in parts[1:]:
        if p.startswith("b"):
            batch = int(p[1:])
        elif p.startswith("i"):
            image = int(p[1:])
    candidates = [m for _, m in shipped_schedules() if m.get("model") == model]
    if batch is None and candidates:
        batch = candidates[0].get("batch")
    return load_schedule(model, batch=batch or 0, image=image, budget=budget)


def warn_if_other_device(schedule: Schedule) -> None:
    from monet_opt.profile import device_fingerprint

    made_on = schedule.meta.get("device")
    here = device_fingerprint(torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    if made_on and made_on.split(":")[0] != here.split(":")[0]:
        warnings.warn(
            f"this schedule's costs were measured on {made_on}, not on this device ({here}); "
            "it runs correctly but its time and memory predictions may not hold here. Solve again for best results.",
            stacklevel=3,
        )
