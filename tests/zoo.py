"""Small models that behave like real ones, for running every callback on."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class ZooModule(pl.LightningModule):
    """Classification on made-up data; subclasses define ``net`` and the input shape."""

    input_shape: tuple[int, ...] = (4,)
    classes = 3

    def __init__(self, n: int = 32, batch_size: int = 8, lr: float = 0.05) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, *self.input_shape, generator=generator)
        self.y = torch.randint(0, self.classes, (n,), generator=generator)
        self.batch_size, self.lr = batch_size, lr

    def logits(self, out: Any) -> torch.Tensor:
        return out

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self.logits(self(x)), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(self.x, self.y), batch_size=self.batch_size)


class BasicBlock(nn.Module):
    """Conv-BN-ReLU(inplace)-Conv-BN, ``out += identity``, the same ReLU module used twice."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out += identity
        return self.relu(out)


class ResNetish(ZooModule):
    input_shape = (1, 8, 8)

    def __init__(self, inplace: bool = True, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.stem = nn.Sequential(
            nn.Conv2d(1, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4), nn.ReLU(inplace=inplace)
        )
        self.layer1 = nn.Sequential(BasicBlock(4), BasicBlock(4))
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(4, self.classes)
        if not inplace:
            for block in self.layer1:
                block.relu.inplace = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(self.pool(self.layer1(self.stem(x))), 1))


class LSTMNet(ZooModule):
    """``nn.LSTM`` returns ``(output, (h, c))``."""

    input_shape = (5, 4)

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.lstm = nn.LSTM(4, 6, batch_first=True)
        self.head = nn.Linear(6, self.classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.lstm(x)
        return self.head(out[:, -1])
