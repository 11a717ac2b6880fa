"""A 24-layer BERT-style encoder language model, written out by hand (random weights, no download).

At the default size it has 484 parameter tensors and 349 modules: the size of model whose
per-tensor costs and whose shape table the library has to keep small.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from examples.transformer import TokenLM


class SelfAttention(nn.Module):
    """Causal multi-head self-attention with a LayerNorm on queries and keys."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.query, self.key, self.value = nn.Linear(width, width), nn.Linear(width, width), nn.Linear(width, width)
        self.query_norm, self.key_norm = nn.LayerNorm(width // heads), nn.LayerNorm(width // heads)
        self.output = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        def split(t: torch.Tensor) -> torch.Tensor:
            return t.unflatten(-1, (self.heads, -1)).transpose(1, 2)

        q, k = self.query_norm(split(self.query(x))), self.key_norm(split(self.key(x)))
        mixed = F.scaled_dot_product_attention(q, k, split(self.value(x)), is_causal=True)
        return self.output(mixed.transpose(1, 2).flatten(-2))


class EncoderLayer(nn.Module):
    """Pre-norm block: ``x + attention(norm(x))``, then ``x + mlp(norm(x))``."""

    def __init__(self, width: int, heads: int, hidden: int) -> None:
        super().__init__()
        self.attention_norm = nn.LayerNorm(width)
        self.attention = SelfAttention(width, heads)
        self.mlp_norm = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, hidden), nn.GELU(), nn.Linear(hidden, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class EncoderLM(TokenLM):
    """Token and position embeddings, ``layers`` encoder layers, a final norm and a linear head.

    Args:
        vocab: Vocabulary size.
        width: Width of the model.
        heads: Attention heads.
        layers: Encoder layers.
        seq_len: Longest sequence (positions embedded).
        lr: AdamW's learning rate.
    """

    def __init__(
        self, vocab: int = 64, width: int = 32, heads: int = 2, layers: int = 24, seq_len: int = 32, lr: float = 1e-3
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.tokens = nn.Embedding(vocab, width)
        self.positions = nn.Embedding(seq_len, width)
        self.layers = nn.ModuleList(EncoderLayer(width, heads, 2 * width) for _ in range(layers))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tokens(tokens) + self.positions(torch.arange(tokens.shape[1], device=tokens.device))
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))
