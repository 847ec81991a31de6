"""Named models and the schedules shipped in `schedules/`.

A model name is a torchvision classification model (`resnet50`, `vgg16`, ...),
a built-in (`gpt`), a timm model (`timm/convnext_tiny`, `timm/vit_small_patch16_224`), a
Hugging Face language model from its library's default configuration (`hf/gpt2`,
`hf/gpt2-medium`, `hf/bert-base`: token ids in, training loss out, the ids as labels), or
`package.module:factory` for a user's own model (the factory is called with no arguments and
returns an nn.Module). Weights are random; nothing is downloaded.
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
# Hugging Face language models by name: (config class, model class, config overrides)
HF_MODELS = {
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", {}),
    "gpt2-medium": ("GPT2Config", "GPT2LMHeadModel", {"n_embd": 1024, "n_layer": 24, "n_head": 16}),
    "bert-base": ("BertConfig", "BertForMaskedLM", {}),
}
TOKEN_MODELS = {"gpt"} | {f"hf/{k}" for k in HF_MODELS}


class UnknownModel(ValueError):
    pass


@dataclass(frozen=True)
class ModelSpec:
    name: str
    batch: int
    image: int = 224
    seq: int = 128
    # the model's weights and its input images laid out channels_last (as torch recommends for
    # convolutions on GPUs; `monet_opt.input_layout`)
    channels_last: bool = False

    def build(self) -> nn.Module:
        model = build_model(self.name, image=self.image)
        return model.to(memory_format=torch.channels_last) if self.channels_last else model

    def example_inputs(self, device: torch.device | str = "cpu") -> tuple[torch.Tensor, ...]:
        if self.name in TOKEN_MODELS:
            return (torch.randint(0, 512, (self.batch, self.seq), device=device),)
        x = torch.randn(self.batch, 3, self.image, self.image, device=device)
        return (x.contiguous(memory_format=torch.channels_last) if self.channels_last else x,)

    def meta(self) -> dict:
        """What a problem's and its schedules' metadata record of the model, so that
        `monet-opt bench FILE` can rebuild it."""
        return {
            "model": self.name,
            "batch": self.batch,
            "image": self.image,
            "seq": self.seq,
            **({"channels_last": True} if self.channels_last else {}),
            "model_summary": self.describe(),
        }

    def describe(self) -> str:
        size = f"seq {self.seq}" if self.name in TOKEN_MODELS else f"image {self.image}x{self.image}"
        return f"{self.name}, batch {self.batch}, {size}{', channels_last' if self.channels_last else ''}"


def build_model(name: str, image: int = 224) -> nn.Module:
    """Build a model by name with random weights (never downloads anything)."""
    torch.manual_seed(0)
    if name == "gpt":
        from monet_opt.models import GPT

        return GPT()
    if name.startswith("timm/"):
        return _timm_model(name.removeprefix("timm/"), image)
    if name.startswith("hf/"):
        return _hf_model(name.removeprefix("hf/"))
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
            f"'timm/<name>', 'hf/<name>' ({', '.join(HF_MODELS)}) or 'package.module:factory'"
        )
    kwargs: dict = {"weights": None}
    if name == "googlenet" or name.startswith("inception"):
        kwargs.update(aux_logits=False, init_weights=False)
    if name.startswith("vit_"):
        kwargs["image_size"] = image
    return tvm.get_model(name, **kwargs)


def _timm_model(arch: str, image: int) -> nn.Module:
    try:
        import timm
    except ImportError as exc:
        raise UnknownModel(f"model 'timm/{arch}' needs timm: pip install timm") from exc
    if arch not in timm.list_models():
        raise UnknownModel(f"timm has no model {arch!r} (timm.list_models() lists them)")
    kwargs = {"img_size": image} if "vit" in arch or "deit" in arch else {}
    return timm.create_model(arch, pretrained=False, **kwargs)


def _hf_model(key: str) -> nn.Module:
    if key not in HF_MODELS:
        raise UnknownModel(f"unknown Hugging Face model 'hf/{key}': use one of {', '.join(HF_MODELS)}")
    try:
        import transformers
    except ImportError as exc:
        raise UnknownModel(f"model 'hf/{key}' needs transformers: pip install transformers") from exc
    from monet_opt.models import TokenLoss

    config_cls, model_cls, overrides = HF_MODELS[key]
    config = getattr(transformers, config_cls)(**overrides)
    return TokenLoss(getattr(transformers, model_cls)(config))


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
    """The shipped schedule for (model, batch, image/seq) with the largest budget fraction not
    above `budget` (a budget is a memory cap: never one that needs more); a warning when that is
    not `budget` itself."""
    budget = float(budget)
    fractions, fits = [], []
    for path, meta in shipped_schedules():
        if meta.get("model") != model or meta.get("batch") != batch:
            continue
        if image is not None and meta.get("image") not in (None, image):
            continue
        if seq is not None and meta.get("seq") not in (None, seq):
            continue
        fraction = float(meta.get("budget_fraction", 1.0))
        fractions.append(fraction)
        if fraction <= budget + 1e-9:
            fits.append((fraction, path))
    what = (
        f"{model} batch {batch}"
        + (f" image {image}" if image is not None else "")
        + (f" seq {seq}" if seq is not None else "")
    )
    size = f"--image {image}" if image is not None else (f"--seq {seq}" if seq is not None else "")
    make = f"make one with: monet-opt solve {model} --batch {batch} {size} --budget {budget:g} -o FILE.json"
    if not fractions:
        have = ", ".join(
            f"{m.get('model')}@{m.get('budget_fraction')} (batch {m.get('batch')}, "
            + (f"image {m.get('image')})" if m.get("image") is not None else f"seq {m.get('seq')})")
            for _, m in shipped_schedules()
        )
        raise FileNotFoundError(f"no shipped schedule for {what}; shipped: {have or 'none'}. M{make[1:]}")
    if not fits:
        raise FileNotFoundError(
            f"no shipped schedule for {what} at a budget of {budget:g} of plain PyTorch's peak or less "
            f"(shipped budgets: {', '.join(f'{f:g}' for f in sorted(fractions))}); {make}"
        )
    fraction, path = max(fits)
    if abs(fraction - budget) > 1e-9:
        warnings.warn(
            f"no shipped {what} schedule at budget {budget:g}; using {fraction:g}, the largest shipped "
            f"budget below it (less memory, more recomputation); {make}",
            stacklevel=2,
        )
    schedule = Schedule.from_json(path)
    warn_if_other_device(schedule)
    return schedule


def load_schedule_by_shortcut(text: str, input_shape: tuple[int, ...] | None = None) -> Schedule:
    """'resnet50@0.5' or 'resnet50@0.5:b8:i224' -> the shipped schedule (`load_schedule`). Batch
    and image (or sequence length) not given in the text come from `input_shape`, the shape the
    wrapper is made for (batch first; an image's last dimension, a token sequence's second)."""
    if "@" not in text:
        raise FileNotFoundError(f"schedule file not found: {text}")
    model, rest = text.split("@", 1)
    parts = rest.split(":")
    usage = (
        "a shipped-schedule shortcut is MODEL@FRACTION[:bBATCH][:iIMAGE][:sSEQ], e.g. resnet50@0.5:b8:i224"
    )
    try:
        budget = float(parts[0])
        batch = image = seq = None
        for p in parts[1:]:
            if p[:1] == "b":
                batch = int(p[1:])
            elif p[:1] == "i":
                image = int(p[1:])
            elif p[:1] == "s":
                seq = int(p[1:])
            else:
                raise ValueError(p)
    except ValueError:
        raise ValueError(f"bad schedule shortcut {text!r}: {usage}") from None
    if not 0.0 < budget <= 1.0:
        raise ValueError(f"bad schedule shortcut {text!r}: the budget is a fraction in (0, 1]; {usage}")
    if input_shape is not None and len(input_shape) >= 1:
        batch = batch if batch is not None else int(input_shape[0])
        if len(input_shape) == 4 and image is None and seq is None:
            image = int(input_shape[-1])
        elif len(input_shape) == 2 and image is None and seq is None:
            seq = int(input_shape[1])
    if batch is None:
        candidates = [m for _, m in shipped_schedules() if m.get("model") == model]
        batch = candidates[0].get("batch") if candidates else 0
    return load_schedule(model, batch=batch, image=image, budget=budget, seq=seq)


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
