"""A small ``nn.TransformerEncoder`` language model on synthetic tokens (made, not downloaded)."""

from __future__ import annotations

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class TokenDataModule(pl.LightningDataModule):
    """Random token sequences whose next token is a fixed function of the current one.

    Args:
        vocab: Vocabulary size.
        seq_len: Tokens per sequence.
        n: Sequences in the training set.
        batch_size: Sequences per batch.
        seed: Seed of the generator.
    """

    def __init__(self, vocab: int = 64, seq_len: int = 32, n: int = 2048, batch_size: int = 32, seed: int = 0) -> None:
        super().__init__()
        self.vocab, self.seq_len, self.n, self.batch_size, self.seed = vocab, seq_len, n, batch_size, seed

    def setup(self, stage: str) -> None:
        generator = torch.Generator().manual_seed(self.seed)
        start = torch.randint(0, self.vocab, (self.n, 1), generator=generator)
        steps = torch.arange(self.seq_len + 1).unsqueeze(0)
        tokens = (start * 7 + steps * 3) % self.vocab
        self.train_set = TensorDataset(tokens[:, :-1], tokens[:, 1:])

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True)


class TokenLM(pl.LightningModule):
    """Next-token cross-entropy on :class:`TokenDataModule` batches, AdamW at ``hparams.lr``."""

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        tokens, targets = batch
        loss = F.cross_entropy(self(tokens).flatten(0, 1), targets.flatten())
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)


class TinyTransformerLM(TokenLM):
    """Embedding, a two-layer ``nn.TransformerEncoder`` with a causal mask, and a linear head.

    Args:
        vocab: Vocabulary size.
        d_model: Width of the model.
        nhead: Attention heads.
        layers: Encoder layers.
        lr: AdamW's learning rate.
    """

    def __init__(self, vocab: int = 64, d_model: int = 64, nhead: int = 4, layers: int = 2, lr: float = 1e-3) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.embed = nn.Embedding(vocab, d_model)
        layer = nn.TransformerEncoderLayer(d_model, nhead, dim_feedforward=2 * d_model, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d_model, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(tokens.shape[1], device=tokens.device)
        return self.head(self.encoder(self.embed(tokens), mask=mask, is_causal=True))
