"""A small CNN on scikit-learn's bundled 8x8 digits: no download, trains in seconds on a CPU."""

from __future__ import annotations

import logging
import warnings

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.utilities import rank_zero_only
from torch import nn
from torch.utils.data import DataLoader, TensorDataset, random_split
from torchmetrics.classification import MulticlassAccuracy

# The demo shows what lightning_hooks prints: Lightning's own notices (the accelerators it found, tips about other
# products) and torch's deprecation notes from Lightning's code are left out here, in the example, not the library.
logging.getLogger("lightning.pytorch.utilities.rank_zero").setLevel(logging.WARNING)
warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)` is deprecated")


class DigitsDataModule(pl.LightningDataModule):
    """The 1,797 digits of ``sklearn.datasets.load_digits`` as ``(N, 1, 8, 8)`` images in [0, 1].

    Args:
        batch_size: Samples per batch.
        val_fraction: Share of the samples held out for validation.
        seed: Seed of the train/validation split.
    """

    def __init__(self, batch_size: int = 64, val_fraction: float = 0.2, seed: int = 0) -> None:
        super().__init__()
        self.batch_size, self.val_fraction, self.seed = batch_size, val_fraction, seed

    def setup(self, stage: str) -> None:
        try:
            from sklearn.datasets import load_digits
        except ImportError as err:  # pragma: no cover - depends on the environment
            raise ImportError("DigitsDataModule needs scikit-learn: pip install 'lightning-hooks[examples]'") from err
        digits = load_digits()
        images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
        dataset = TensorDataset(images, torch.tensor(digits.target, dtype=torch.long))
        n_val = int(len(dataset) * self.val_fraction)
        generator = torch.Generator().manual_seed(self.seed)
        self.train_set, self.val_set = random_split(dataset, [len(dataset) - n_val, n_val], generator=generator)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=256)


class DigitsCNN(pl.LightningModule):
    """Two convolutions, a pooling layer and two linear layers with a leaky ReLU between them; about 40k parameters.

    Args:
        lr: Adam's learning rate.
        channels: Channels of the first convolution (the second has twice as many).
    """

    def __init__(self, lr: float = 0.003, channels: int = 16) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.features = nn.Sequential(
            nn.Conv2d(1, channels, 3, padding=1),
            nn.BatchNorm2d(channels),
            nn.ReLU(),
            nn.Conv2d(channels, 2 * channels, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
        )
        # LeakyReLU, not ReLU: with a ReLU here about 40 % of the 64 hidden units were zero for a whole batch
        # (HealthMonitor's dead_units), so they got no gradient from it.
        self.classifier = nn.Sequential(
            nn.Flatten(), nn.Linear(2 * channels * 4 * 4, 64), nn.LeakyReLU(0.01), nn.Linear(64, 10)
        )
        self.val_acc = MulticlassAccuracy(num_classes=10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        logits = self(x)
        self.val_acc(logits, y)
        self.log("val_loss", F.cross_entropy(logits, y))
        self.log("val_acc", self.val_acc, prog_bar=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=self.hparams.lr)

    def on_fit_end(self) -> None:
        acc = self.trainer.callback_metrics.get("val_acc")
        if acc is not None:
            _report(f"final validation accuracy: {float(acc):.3f}")


@rank_zero_only
def _report(text: str) -> None:
    print(text, flush=True)
