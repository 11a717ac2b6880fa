"""Small models that behave like real ones, for running every callback on.

Each is a LightningModule classifying made-up data. ``run(x)`` is what ``training_step`` calls,
so a test can repeat exactly the forward that a training step makes; ``probe`` names a module
whose first output tensor a test checks against an independent computation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, TensorDataset

from examples.resnet import Block


class ZooModule(pl.LightningModule):
    input_shape: tuple[int, ...] = (4,)
    classes = 3
    probe = ""
    call_kwargs: ClassVar[dict[str, Any]] = {}

    def __init__(self, n: int = 32, batch_size: int = 8, lr: float = 0.05) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, *self.input_shape, generator=generator)
        self.y = torch.randint(0, self.classes, (n,), generator=generator)
        self.batch_size, self.lr = batch_size, lr

    def run(self, x: torch.Tensor) -> Any:
        return self(x, **self.call_kwargs)

    def logits(self, out: Any) -> torch.Tensor:
        return out

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self.logits(self.run(x)), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=self.lr)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(self.x, self.y), batch_size=self.batch_size)


class MaskedClasses(ZooModule):
    """An MLP whose ``mask`` module fills two classes of each sample, never its label, with ``fill``: the way a policy
    masks invalid actions (``-inf``, the dtype's lowest value) before a softmax that makes them 0."""

    classes = 5

    def __init__(self, fill: float, **kwargs: Any) -> None:
        super().__init__(n=64, **kwargs)
        self.body = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, self.classes))
        self.mask = Fill(fill)
        self.invalid = (
            F.one_hot((self.y + 1) % self.classes, self.classes) + F.one_hot((self.y + 3) % self.classes, self.classes)
            > 0
        )

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y, invalid = batch
        return F.cross_entropy(self.mask(self.body(x), invalid), y)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(self.x, self.y, self.invalid), batch_size=self.batch_size)


class Fill(nn.Module):
    def __init__(self, value: float) -> None:
        super().__init__()
        self.value = value

    def forward(self, x: torch.Tensor, where: torch.Tensor) -> torch.Tensor:
        return x.masked_fill(where, self.value)


class ResNetish(ZooModule):
    input_shape = (1, 8, 8)
    probe = "layer1.0.conv1"

    def __init__(self, inplace: bool = True, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.stem = nn.Sequential(
            nn.Conv2d(1, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4), nn.ReLU(inplace=inplace)
        )
        self.layer1 = nn.Sequential(Block(4), Block(4))  # in-place ReLU, residual +=, one ReLU used twice
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(4, self.classes)
        if not inplace:
            for block in self.layer1:
                block.relu.inplace = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(self.pool(self.layer1(self.stem(x))), 1))


class LSTMNet(ZooModule):
    """``nn.LSTM`` returns ``(output, (h, c))``; a GRU after it returns ``(output, h)``."""

    input_shape = (5, 4)
    probe = "lstm"

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.lstm = nn.LSTM(4, 6, batch_first=True)
        self.gru = nn.GRU(6, 6, batch_first=True)
        self.head = nn.Linear(6, self.classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.lstm(x)
        out, _ = self.gru(out)
        return self.head(out[:, -1])


class PackedLSTMNet(ZooModule):
    """Variable-length sequences through ``nn.LSTM`` as a ``PackedSequence``."""

    input_shape = (5, 4)
    probe = "head"

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.lstm = nn.LSTM(4, 6, batch_first=True)
        self.head = nn.Linear(6, self.classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lengths = torch.arange(x.shape[0]) % x.shape[1] + 1
        packed = nn.utils.rnn.pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False)
        _, (h, _) = self.lstm(packed)
        return self.head(h[-1])


class AttentionNet(ZooModule):
    """``nn.MultiheadAttention(need_weights=False)`` returns ``(output, None)``."""

    input_shape = (6, 8)
    probe = "attn"

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True)
        self.head = nn.Linear(8, self.classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, weights = self.attn(x, x, x, need_weights=False)
        assert weights is None
        return self.head(out.mean(dim=1))


class TransformerNet(ZooModule):
    """A ``nn.TransformerEncoder`` (its layers' fast path is off while any of their modules has a hook)."""

    input_shape = (6, 8)
    probe = "encoder"

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        layer = nn.TransformerEncoderLayer(8, 2, dim_feedforward=16, batch_first=True, dropout=0.0)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(8, self.classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(x).mean(dim=1))


class Scale(nn.Module):
    def forward(self, x: torch.Tensor, *, factor: float, bias: torch.Tensor | None = None) -> torch.Tensor:
        return x * factor if bias is None else x * factor + bias


class KwargsDictNet(ZooModule):
    """Keyword-only arguments in, a dict with a ``None`` out."""

    probe = "scale"
    call_kwargs: ClassVar[dict[str, Any]] = {"temperature": 2.0}

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.fc = nn.Linear(4, 6)
        self.scale = Scale()
        self.head = nn.Linear(6, self.classes)

    def forward(self, x: torch.Tensor, *, temperature: float) -> dict[str, Any]:
        h = self.scale(self.fc(x), factor=1 / temperature, bias=None)
        return {"logits": self.head(h), "aux": None}

    def logits(self, out: Any) -> torch.Tensor:
        return out["logits"]


@dataclass
class Prediction:
    logits: torch.Tensor
    features: torch.Tensor


class Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 6)

    def forward(self, x: torch.Tensor) -> Prediction:
        features = torch.tanh(self.fc(x))
        return Prediction(features[:, :3], features)


class DataclassNet(ZooModule):
    probe = "encoder"

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.encoder = Encoder()

    def forward(self, x: torch.Tensor) -> Prediction:
        return self.encoder(x)

    def logits(self, out: Any) -> torch.Tensor:
        return out.logits


class Mixed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, int, None]:
        return self.fc(x), x.shape[0], None


class TupleNet(ZooModule):
    """A module returning ``(tensor, int, None)``."""

    probe = "mixed"

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.mixed = Mixed()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mixed(x)[0]


class FrozenNet(ZooModule):
    """A frozen backbone whose output needs no grad, a ``torch.no_grad`` block, and tied weights."""

    probe = "proj"

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.backbone = nn.Sequential(nn.Linear(4, 6), nn.Tanh())
        self.backbone.requires_grad_(False)
        self.stats = nn.Linear(6, 6)
        self.proj = nn.Linear(6, 6)
        self.proj_again = nn.Linear(6, 6)
        self.proj_again.weight = self.proj.weight  # tied: one tensor, two modules
        self.head = nn.Linear(6, self.classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.backbone(x)
        with torch.no_grad():
            h = h + 0 * self.stats(h)
        return self.head(self.proj_again(torch.relu(self.proj(h))))


class CheckpointNet(ZooModule):
    """Activation checkpointing (non-reentrant): backward re-runs the block's forward."""

    probe = "block.0"

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.block = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU())
        self.head = nn.Linear(8, self.classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(checkpoint(self.block, x, use_reentrant=False))


class SparseEmbeddingNet(ZooModule):
    """An embedding whose gradient is a sparse tensor (``sparse=True``), then a linear layer."""

    probe = "proj"

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.x = torch.randint(0, 10, (len(self.x), 3), generator=torch.Generator().manual_seed(1))
        self.embed = nn.Embedding(10, 4, sparse=True)
        self.proj = nn.Linear(12, self.classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.embed(x).flatten(1))


class SpectralMix(nn.Module):
    """Each Fourier mode of the input times its own complex weight: a complex parameter and a complex output."""

    def __init__(self, modes: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(modes, dtype=torch.cfloat, generator=torch.Generator().manual_seed(2)))

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return z * self.weight


class SpectralNet(ZooModule):
    """A complex weight on the input's Fourier modes (as in Fourier neural operators), then a linear layer on their
    real and imaginary parts."""

    input_shape = (8,)
    probe = "head"

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.mix = SpectralMix(5)
        self.head = nn.Linear(10, self.classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.view_as_real(self.mix(torch.fft.rfft(x))).flatten(1))


ZOO: list[type[ZooModule]] = [
    ResNetish,
    LSTMNet,
    PackedLSTMNet,
    AttentionNet,
    TransformerNet,
    KwargsDictNet,
    DataclassNet,
    TupleNet,
    FrozenNet,
    CheckpointNet,
    SparseEmbeddingNet,
    SpectralNet,
]
