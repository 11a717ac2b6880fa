"""NumNet: is the sum of five integers in [0, 6) strictly between 10 and 20?

Its ``forward`` takes the whole batch tuple ``(x, y)`` and returns ``(logits, loss)``, the kind
of nested input and output that a shape table has to show.
"""

from __future__ import annotations

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class NumDataModule(pl.LightningDataModule):
    """Random rows of five integers in [0, 6), labelled 1 iff 10 < sum < 20; made, not downloaded.

    Args:
        n_train: Training rows.
        n_val: Validation rows.
        batch_size: Rows per batch.
        seed: Seed of the generator.
    """

    def __init__(self, n_train: int = 4000, n_val: int = 1000, batch_size: int = 100, seed: int = 0) -> None:
        super().__init__()
        self.n_train, self.n_val, self.batch_size, self.seed = n_train, n_val, batch_size, seed

    def _make(self, n: int, generator: torch.Generator) -> TensorDataset:
        x = torch.randint(0, 6, (n, 5), generator=generator)
        total = x.sum(dim=1)
        return TensorDataset(x, ((total > 10) & (total < 20)).long())

    def setup(self, stage: str) -> None:
        generator = torch.Generator().manual_seed(self.seed)
        self.train_set, self.val_set = self._make(self.n_train, generator), self._make(self.n_val, generator)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.batch_size)


class NumNet(pl.LightningModule):
    """Embed each integer, concatenate, and classify with a small MLP.

    Args:
        embed_dim: Size of each integer's embedding.
        hidden: Width of the hidden layer.
        lr: Adam's learning rate.
    """

    def __init__(self, embed_dim: int = 8, hidden: int = 32, lr: float = 0.01) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.embed = nn.Embedding(6, embed_dim)
        self.mlp = nn.Sequential(nn.Linear(5 * embed_dim, hidden), nn.ReLU(), nn.Linear(hidden, 2))

    def forward(self, batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = batch
        logits = self.mlp(self.embed(x).flatten(1))
        return logits, F.cross_entropy(logits, y)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        _, loss = self(batch)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        logits, loss = self(batch)
        self.log("val_loss", loss)
        self.log("val_acc", (logits.argmax(dim=1) == batch[1]).float().mean(), prog_bar=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=self.hparams.lr)
