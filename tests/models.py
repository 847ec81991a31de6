"""Small test models: a GPT-style transformer and torchvision models at test sizes.

Every factory returns ``(model, example_input)``; weights are random (weights=None),
never downloaded.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import torchvision
from torch import nn


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int, dropout: float) -> None:
        super().__init__()
        assert n_embd % n_head == 0
        self.n_head = n_head
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)
        self.resid_dropout = nn.Dropout(dropout)
        self.dropout = dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(C, dim=2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, n_embd: int, dropout: float) -> None:
        super().__init__()
        self.c_fc = nn.Linear(n_embd, 4 * n_embd)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * n_embd, n_embd)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int, dropout: float) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head, dropout)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = MLP(n_embd, dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        x = x + self.mlp(self.ln_2(x))
        return x


class GPT(nn.Module):
    """nanoGPT-shaped model: token + position embeddings, n_layer blocks, LM head."""

    def __init__(
        self,
        vocab_size: int = 128,
        block_size: int = 32,
        n_layer: int = 2,
        n_head: int = 4,
        n_embd: int = 64,
        dropout: float = 0.1,
    ) -> None:
        super().__init__()
        self.block_size = block_size
        self.wte = nn.Embedding(vocab_size, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd)
        self.drop = nn.Dropout(dropout)
        self.h = nn.ModuleList([Block(n_embd, n_head, dropout) for _ in range(n_layer)])
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        for p in self.parameters():
            if p.dim() >= 2:
                nn.init.normal_(p, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.size(1)
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def gpt(batch: int = 2, seq: int = 32, **kw) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model = GPT(block_size=max(seq, kw.pop("block_size", seq)), **kw)
    idx = torch.randint(0, model.wte.num_embeddings, (batch, seq))
    return model, idx


def _image(batch: int, size: int) -> torch.Tensor:
    return torch.randn(batch, 3, size, size)


def resnet18(batch: int = 2, size: int = 64) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return torchvision.models.resnet18(weights=None), _image(batch, size)


def resnet50(batch: int = 2, size: int = 64) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return torchvision.models.resnet50(weights=None), _image(batch, size)


def vgg11(batch: int = 2, size: int = 32) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return torchvision.models.vgg11(weights=None), _image(batch, size)


def googlenet(batch: int = 2, size: int = 64) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model = torchvision.models.googlenet(weights=None, aux_logits=False, init_weights=False)
    return model, _image(batch, size)


def mobilenet_v2(batch: int = 2, size: int = 32) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return torchvision.models.mobilenet_v2(weights=None), _image(batch, size)


def vit(batch: int = 2, size: int = 32) -> tuple[nn.Module, torch.Tensor]:
    """torchvision ViT-B/16 at image_size=32 (2x2 patches of 16)."""
    torch.manual_seed(0)
    return torchvision.models.vit_b_16(weights=None, image_size=size), _image(batch, size)


class WithEncoderLayer(nn.Module):
    """A torch.nn.TransformerEncoderLayer between two linears."""

    def __init__(self, d: int = 32) -> None:
        super().__init__()
        self.inp = nn.Linear(16, d)
        self.enc = nn.TransformerEncoderLayer(d_model=d, nhead=4, dim_feedforward=64, batch_first=True)
        self.out = nn.Linear(d, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.enc(torch.relu(self.inp(x))))


def with_encoder_layer(batch: int = 2, seq: int = 8) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return WithEncoderLayer(), torch.randn(batch, seq, 16)


class DataDependent(nn.Module):
    """Data-dependent control flow in the root forward: untraceable."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        if h.sum() > 0:
            h = self.b(h)
        return h


class Gate(nn.Module):
    """Data-dependent control flow inside a submodule."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:
            return self.lin(x)
        return x


class WithGate(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.pre = nn.Linear(8, 8)
        self.gate = Gate()
        self.post = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.post(torch.relu(self.gate(self.pre(x))))


TORCHVISION = {
    "resnet18": resnet18,
    "resnet50": resnet50,
    "vgg11": vgg11,
    "googlenet": googlenet,
    "mobilenet_v2": mobilenet_v2,
    "vit_b_16": vit,
}

ALL = {**TORCHVISION, "gpt": gpt}


class _BasicBlock(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(width, width, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU()
        self.conv2 = nn.Conv2d(width, width, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.relu(self.bn2(self.conv2(self.relu(self.bn1(self.conv1(x))))) + x)


class NarrowResNet(nn.Module):
    """Residual blocks of few channels at full resolution: activations, not parameters, make the
    peak (as in real training at real sizes, unlike torchvision models at test sizes)."""

    def __init__(self, width: int = 16, blocks: int = 4, classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU()
        )
        self.blocks = nn.Sequential(*[_BasicBlock(width) for _ in range(blocks)])
        self.head = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.stem(x)).mean(dim=(2, 3)))


def narrow_resnet(batch: int = 8, size: int = 32, **kw) -> tuple[nn.Module, torch.Tensor]:
    return NarrowResNet(**kw), _image(batch, size)
