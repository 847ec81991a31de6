"""Built-in models: a small GPT-style transformer (the test and demo model), and `TokenLogits` /
`TokenLoss`, the wrappers that make a Hugging Face language model traceable."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class CausalSelfAttention(nn.Module):
    def __init__(self, dim: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.drop = nn.Dropout(dropout)
        self.dropout = dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q = q.view(b, t, self.heads, c // self.heads).transpose(1, 2)
        k = k.view(b, t, self.heads, c // self.heads).transpose(1, 2)
        v = v.view(b, t, self.heads, c // self.heads).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(b, t, c)
        return self.drop(self.proj(y))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = CausalSelfAttention(dim, heads, dropout)
        self.ln2 = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, 4 * dim)
        self.act = nn.GELU()
        self.out = nn.Linear(4 * dim, dim)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.drop(self.out(self.act(self.fc(self.ln2(x)))))


class GPT(nn.Module):
    """A GPT-2-style decoder: token + position embeddings, pre-norm blocks, tied-free head."""

    def __init__(
        self,
        vocab: int = 512,
        dim: int = 128,
        heads: int = 4,
        layers: int = 2,
        max_seq: int = 256,
        dropout: float = 0.1,
    ) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(max_seq, dim)
        self.blocks = nn.Sequential(*[Block(dim, heads, dropout) for _ in range(layers)])
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        for p in self.parameters():
            if p.dim() > 1:
                nn.init.normal_(p, std=0.02 / math.sqrt(layers))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos.weight[: idx.shape[1]]
        return self.head(self.ln(self.blocks(x)))


class TokenLogits(nn.Module):
    """A Hugging Face language model as a module from token ids to logits, as `monet_opt.trace`
    needs it: the model's own forward takes **kwargs and returns a ModelOutput with a cache.
    `TokenLogits(transformers.GPT2LMHeadModel(config))`; put a loss inside a module of your own
    the same way for long vocabularies (README: "put the loss inside")."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=ids, use_cache=False).logits


class TokenLoss(TokenLogits):
    """A Hugging Face language model as a module from token ids to its training loss (the ids are
    the labels: next-token loss for a causal model, the masked-LM loss over every token for BERT).
    A scalar output: nothing of the logits' size waits for the wrapper's backward to end."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=ids, labels=ids, use_cache=False).loss
