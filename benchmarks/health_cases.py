"""The corpus HealthMonitor is measured on: healthy runs of the architectures users bring, and buggy programs
of the kinds the literature collects, each with its fixed twin.

Every :class:`Case` is one short fit. Its ground truth (``symptom``, ``layer``, ``measurable_step``) is
written here, from what the program does, before any detector has looked at it; ``benchmarks/health.py``
runs the cases and scores the detectors against it.

Healthy runs build Hugging Face ``transformers`` models from small configs with random weights (decoder
LMs, a mixture of experts, encoders, encoder-decoders, vision and audio models), LoRA adapters from
``peft``, the examples' models, and small CNNs and MLPs, crossed with SGD with momentum, Adam and AdamW,
with and without a linear warm-up, in fp32, ``bf16-mixed`` and fp16 with a ``GradScaler``. The language models
learn to count by a stride, the classifiers a synthetic or scikit-learn task, so their loss falls.

Buggy programs are ports of the classic ones (missing normalisation, saturating or dying activations,
learning rates, NaN from a log or a division, a graph cut, a double softmax, a bad batch); each exists
as its bug and as its fix, under every seed.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any, Literal

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_hooks import HealthMonitor

__all__ = [
    "SYMPTOMS",
    "Case",
    "CorpusModule",
    "Optim",
    "buggy",
    "corpus",
    "healthy",
]

SYMPTOMS: tuple[str, ...] = tuple(HealthMonitor().checks)
"""What a buggy program's ground truth may name: HealthMonitor's checks (``checks=None`` is all of them)."""

Built = tuple[pl.LightningModule, pl.LightningDataModule | None]
Builder = Callable[[], Built]

VOCAB = 32
"""Vocabulary of every token model (0 pad, 1 begin, 2 separator / end; 3 and up are content)."""


@dataclass(frozen=True)
class Optim:
    """An optimizer as a user writes it: ``kind`` at ``lr``, optional momentum and a linear warm-up of
    ``warmup`` steps (``LambdaLR``, stepped every optimizer step). ``adafactor`` is T5's recipe, transformers'
    ``Adafactor`` setting its own rate (``lr=None``, relative step, warm-up init): ``lr`` is not used."""

    kind: Literal["sgd", "adam", "adamw", "adafactor"]
    lr: float
    momentum: float = 0.0
    warmup: int = 0

    def __str__(self) -> str:
        if self.kind == "adafactor":
            return "Adafactor (lr=None, relative step)"
        name = {"sgd": "SGD", "adam": "Adam", "adamw": "AdamW"}[self.kind]
        said = [f"{name} {self.lr:g}"]
        if self.momentum:
            said.append(f"momentum {self.momentum:g}")
        if self.warmup:
            said.append(f"warm-up {self.warmup}")
        return ", ".join(said)

    def build(self, groups: list[dict[str, Any]]) -> Any:
        """The optimizer over ``groups``, with its warm-up schedule in the form ``configure_optimizers`` returns."""
        if self.kind == "sgd":
            optimizer: torch.optim.Optimizer = torch.optim.SGD(groups, lr=self.lr, momentum=self.momentum)
        elif self.kind == "adafactor":
            from transformers.optimization import Adafactor

            optimizer = Adafactor(groups, lr=None, relative_step=True, warmup_init=True, scale_parameter=True)
        else:
            optimizer = (torch.optim.Adam if self.kind == "adam" else torch.optim.AdamW)(groups, lr=self.lr)
        if not self.warmup:
            return optimizer
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, LinearWarmup(self.warmup))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


class LinearWarmup:
    """``LambdaLR``'s factor: rises linearly to 1 over ``steps`` optimizer steps."""

    def __init__(self, steps: int) -> None:
        self.steps = steps

    def __call__(self, step: int) -> float:
        return min(1.0, (step + 1) / self.steps)


@dataclass(frozen=True)
class Case:
    """One fit of the corpus and its ground truth.

    ``symptom`` is ``None`` for a healthy run or a fixed twin; for a buggy program it is the check that
    must find it (``also``: other checks that name the same problem as well), ``layer`` the qualified
    module name (relative to the LightningModule) where it starts, ``None`` when no single layer is to
    blame, and ``measurable_step`` the first optimizer step where it can be measured. ``twin`` names a
    buggy program's fixed twin.
    """

    name: str
    family: str
    build: Builder = field(repr=False, compare=False)
    steps: int
    optimizer: str
    precision: str = "32-true"
    seed: int = 0
    symptom: str | None = None
    layer: str | None = None
    measurable_step: int | None = None
    twin: str | None = None
    also: tuple[str, ...] = ()

    @property
    def program(self) -> str:
        """The name without its seed: a buggy program and its twin under every seed share it."""
        return self.name.rsplit(" #", 1)[0]


# ----------------------------------------------------------------------------------------------- modules


class CorpusModule(pl.LightningModule):
    """A LightningModule whose ``training_step`` returns the loss and, where there is one, the batch accuracy
    (``{"loss", "accuracy"}``: the reference detectors read the accuracy from the step's outputs).

    ``fast`` names a submodule whose parameters get ``fast_factor`` times the learning rate (a group of their own).
    """

    def __init__(self, optim: Optim, fast: str | None = None, fast_factor: float = 100.0) -> None:
        super().__init__()
        self.optim, self.fast, self.fast_factor = optim, fast, fast_factor

    def loss_and_accuracy(self, batch: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        raise NotImplementedError

    def regression_targets(self, batch: Any) -> torch.Tensor | None:
        """The targets of a regression batch (``None`` for classification)."""
        return None

    def training_step(self, batch: Any, batch_idx: int) -> dict[str, torch.Tensor]:
        loss, accuracy = self.loss_and_accuracy(batch)
        return {"loss": loss} if accuracy is None else {"loss": loss, "accuracy": accuracy.detach()}

    def configure_optimizers(self) -> Any:
        trainable = [(n, p) for n, p in self.named_parameters() if p.requires_grad]
        fast = [p for n, p in trainable if self.fast is not None and n.startswith(f"{self.fast}.")]
        slow = [p for _, p in trainable if all(p is not q for q in fast)]
        fast_group = [{"params": fast, "lr": self.optim.lr * self.fast_factor}] if fast else []
        return self.optim.build([{"params": slow}, *fast_group])


def accuracy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    kept = targets != -100
    return (logits.argmax(-1)[kept] == targets[kept]).float().mean()


class Net(CorpusModule):
    """``net`` on ``(x, y)`` batches with ``loss``: cross-entropy, mean squared error, or binary cross-entropy
    on probabilities or (``bce_logits``) on logits. ``loss_from_item`` rebuilds the loss from ``loss.item()`` (the
    graph is lost)."""

    def __init__(
        self,
        net: nn.Sequential,
        optim: Optim,
        loss: Literal["ce", "mse", "bce", "bce_logits"] = "ce",
        loss_from_item: bool = False,
        fast: str | None = None,
        fast_factor: float = 100.0,
    ) -> None:
        super().__init__(optim, fast=fast, fast_factor=fast_factor)
        self.net, self.loss, self.loss_from_item = net, loss, loss_from_item

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def loss_and_accuracy(self, batch: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        x, y = batch
        out = self(x)
        if self.loss == "mse":
            loss, acc = F.mse_loss(out.float(), y), None
        elif self.loss == "bce":
            loss = F.binary_cross_entropy(out.float(), y)
            acc = ((out > 0.5).float() == y).float().mean()
        elif self.loss == "bce_logits":
            loss = F.binary_cross_entropy_with_logits(out.float(), y)
            acc = ((out > 0).float() == y).float().mean()
        else:
            loss, acc = F.cross_entropy(out.float(), y), accuracy(out, y)
        if self.loss_from_item:
            loss = torch.tensor(loss.item(), requires_grad=True)
        return loss, acc

    def regression_targets(self, batch: Any) -> torch.Tensor | None:
        return batch[1] if self.loss == "mse" else None


class CausalLM(CorpusModule):
    """A Hugging Face causal LM (or a ``peft`` model around one) on ``(input_ids, labels)``; the accuracy is
    that of its next-token predictions."""

    def __init__(self, model: nn.Module, optim: Optim) -> None:
        super().__init__(optim)
        self.model = model

    def loss_and_accuracy(self, batch: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        ids, labels = batch
        out = self.model(input_ids=ids, labels=labels)
        return out.loss, accuracy(out.logits[:, :-1], labels[:, 1:])


class HFModel(CorpusModule):
    """A Hugging Face model that takes ``labels`` and computes its own loss: a classifier (``(B, C)`` logits)
    or an encoder-decoder (``(B, T, V)`` logits); ``input_name`` is the keyword of its input."""

    def __init__(self, model: nn.Module, optim: Optim, input_name: str) -> None:
        super().__init__(optim)
        self.model, self.input_name = model, input_name

    def loss_and_accuracy(self, batch: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        x, y = batch
        out = self.model(**{self.input_name: x}, labels=y)
        return out.loss, accuracy(out.logits, y)


class Log(nn.Module):
    """``log(x + eps)``: with ``eps=0`` the log of a ReLU's zeros is ``-inf``."""

    def __init__(self, eps: float) -> None:
        super().__init__()
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(x + self.eps)


class Standardize(nn.Module):
    """Each feature standardised over the batch, ``(x - mean) / (std + eps)``: a constant feature is 0 / 0
    without ``eps``."""

    def __init__(self, eps: float) -> None:
        super().__init__()
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x - x.mean(0)) / (x.std(0) + self.eps)


# ------------------------------------------------------------------------------------------------- data


class Tensors(pl.LightningDataModule):
    """Tensors as a training set; ``shuffle=False`` keeps row ``i * batch_size`` in the batch of step ``i``
    (for the first epoch)."""

    def __init__(self, *tensors: torch.Tensor, batch_size: int = 32, shuffle: bool = True) -> None:
        super().__init__()
        self.tensors, self.batch_size, self.shuffle = tensors, batch_size, shuffle

    def train_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(*self.tensors), batch_size=self.batch_size, shuffle=self.shuffle)


CONTENT = VOCAB - 3
"""Content tokens are 3 .. VOCAB - 1."""


def counting(start: torch.Tensor, stride: torch.Tensor, length: int) -> torch.Tensor:
    """Content tokens counting from ``start`` by ``stride`` (both ``(N, 1)``), wrapping around."""
    return 3 + (start + stride * torch.arange(length)) % CONTENT


def counting_tokens(n: int = 1024, length: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal LM data: each sequence counts from a random token by a random stride of 1, 2 or 3; the labels are
    the tokens (the model shifts them)."""
    ids = counting(torch.randint(0, CONTENT, (n, 1)), torch.randint(1, 4, (n, 1)), length)
    return ids, ids.clone()


def token_groups(n: int = 1024, length: int = 16, classes: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """A begin token, then tokens of which about 60 % come from the class' quarter of the vocabulary."""
    label = torch.randint(0, classes, (n,))
    size = CONTENT // classes
    own = 3 + label[:, None] * size + torch.randint(0, size, (n, length))
    ids = torch.where(torch.rand(n, length) < 0.6, own, torch.randint(3, VOCAB, (n, length)))
    ids[:, 0] = 1
    return ids, label


def counting_targets(n: int = 1024, length: int = 12) -> tuple[torch.Tensor, torch.Tensor]:
    """Encoder-decoder data: random source tokens; the target counts from the source's first token by a stride
    the second one sets."""
    source = torch.randint(3, VOCAB, (n, length))
    return source, counting(source[:, :1] - 3, 1 + source[:, 1:2] % 3, length)


def digits(flat: bool = False, size: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """scikit-learn's bundled 8x8 digits, pixels in [0, 16] as the data set has them, ``(N, 1, size, size)``
    or ``(N, 64)``."""
    from sklearn.datasets import load_digits

    data = load_digits()
    images = torch.tensor(data.images, dtype=torch.float32).unsqueeze(1)
    if size != 8:
        images = F.interpolate(images, size=(size, size), mode="bilinear", align_corners=False)
    labels = torch.tensor(data.target, dtype=torch.long)
    return (images.flatten(1) if flat else images), labels


def gaussian_classes(n: int = 4096, width: int = 16, classes: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """Unit Gaussian inputs labelled by a random linear teacher."""
    x = torch.randn(n, width)
    return x, (x @ torch.randn(width, classes)).argmax(1)


def regression(n: int = 2048, width: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """Unit Gaussian inputs, a noisy linear target of unit scale, shape ``(N, 1)``."""
    x = torch.randn(n, width)
    y = x @ torch.randn(width, 1) / math.sqrt(width) + 0.1 * torch.randn(n, 1)
    return x, y


def tones(n: int = 1024, samples: int = 640, classes: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """Raw waveforms in [-1, 1]: a tone whose frequency is the class, with a random phase, in noise."""
    label = torch.randint(0, classes, (n,))
    t = torch.arange(samples).float()
    frequency = 0.02 + 0.03 * label.float()
    wave = 0.5 * torch.sin(2 * math.pi * frequency[:, None] * t + 2 * math.pi * torch.rand(n, 1))
    return (wave + 0.1 * torch.randn(n, samples)).clamp(-1, 1), label


def normalised(wave: torch.Tensor) -> torch.Tensor:
    """Zero mean, unit variance per utterance, as Wav2Vec2's feature extractor makes its input."""
    return (wave - wave.mean(1, keepdim=True)) / (wave.std(1, keepdim=True) + 1e-7)


def spoken_tokens(n: int = 512, words: int = 4, bins: int = 16, frames: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-spectrogram features ``(N, bins, frames)`` of ``words`` tones in a row; the transcript is one token
    per tone (the Whisper recipe: log10 power, floored 8 below the peak, scaled by ``(x + 4) / 4``)."""
    hop = 16
    tone = torch.randint(0, 8, (n, words))
    t = torch.arange(frames * hop // words).float()
    frequency = 0.06 + 0.05 * tone.float()
    wave = torch.sin(2 * math.pi * frequency[..., None] * t).flatten(1) + 0.05 * torch.randn(n, frames * hop)
    spectrum = (
        torch.stft(
            wave, n_fft=2 * bins - 2, hop_length=hop, window=torch.hann_window(2 * bins - 2), return_complex=True
        )
        .abs()
        .pow(2)[..., :frames]
    )
    logs = spectrum.clamp(min=1e-10).log10()
    logs = torch.maximum(logs, logs.amax(dim=(1, 2), keepdim=True) - 8.0)
    return (logs + 4.0) / 4.0, tone + 3


# ------------------------------------------------------------------------------------------ transformers


def _transformers() -> Any:
    import transformers

    transformers.logging.set_verbosity_error()
    return transformers


DECODER = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4}
DECODER_IDS = {"vocab_size": VOCAB, "max_position_embeddings": 64, "pad_token_id": 0, "bos_token_id": 1}


def decoder(family: str) -> nn.Module:
    """A two-layer decoder LM of ``family`` with random weights."""
    t = _transformers()
    if family == "gpt2":
        config = t.GPT2Config(
            vocab_size=VOCAB,
            n_embd=32,
            n_layer=2,
            n_head=2,
            n_positions=32,
            bos_token_id=1,
            eos_token_id=2,
            pad_token_id=0,
        )
        return t.GPT2LMHeadModel(config)
    grouped = {**DECODER, **DECODER_IDS, "num_key_value_heads": 2, "eos_token_id": 2}
    if family == "mixtral":
        return t.MixtralForCausalLM(t.MixtralConfig(**grouped, num_local_experts=4, num_experts_per_tok=2))
    config_class, model_class = {
        "llama": (t.LlamaConfig, t.LlamaForCausalLM),
        "mistral": (t.MistralConfig, t.MistralForCausalLM),
        "qwen2": (t.Qwen2Config, t.Qwen2ForCausalLM),
    }[family]
    return model_class(config_class(**grouped))


def lm(family: str, optim: Optim, lora: bool = False) -> Built:
    """A decoder LM on counting sequences; with ``lora``, its weights frozen and LoRA adapters on every linear layer."""
    model = decoder(family)
    if lora:
        import peft

        model = peft.get_peft_model(model, peft.LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"))
    return CausalLM(model, optim), Tensors(*counting_tokens(), batch_size=16)


def encoder(family: str, optim: Optim) -> Built:
    """A two-layer encoder classifying token sequences."""
    t = _transformers()
    sizes = {
        "vocab_size": VOCAB,
        "hidden_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "intermediate_size": 64,
        "max_position_embeddings": 40,
        "num_labels": 4,
    }
    config = {
        "bert": lambda: t.BertConfig(**sizes),
        "albert": lambda: t.AlbertConfig(embedding_size=16, **sizes),
        "roberta": lambda: t.RobertaConfig(pad_token_id=0, bos_token_id=1, eos_token_id=2, **sizes),
    }[family]()
    model_class = {
        "bert": t.BertForSequenceClassification,
        "albert": t.AlbertForSequenceClassification,
        "roberta": t.RobertaForSequenceClassification,
    }[family]
    return HFModel(model_class(config), optim, "input_ids"), Tensors(*token_groups(), batch_size=32)


def seq2seq(family: str, optim: Optim) -> Built:
    """A two-layer encoder-decoder on :func:`counting_targets`."""
    t = _transformers()
    if family == "t5":
        config = t.T5Config(
            vocab_size=VOCAB,
            d_model=32,
            d_kv=8,
            d_ff=64,
            num_layers=2,
            num_heads=4,
            decoder_start_token_id=0,
            pad_token_id=0,
            eos_token_id=2,
        )
        model = t.T5ForConditionalGeneration(config)
    else:
        config = t.BartConfig(
            vocab_size=VOCAB,
            d_model=32,
            encoder_layers=2,
            decoder_layers=2,
            encoder_attention_heads=2,
            decoder_attention_heads=2,
            encoder_ffn_dim=64,
            decoder_ffn_dim=64,
            max_position_embeddings=40,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
            decoder_start_token_id=2,
            forced_eos_token_id=2,
        )
        model = t.BartForConditionalGeneration(config)
    return HFModel(model, optim, "input_ids"), Tensors(*counting_targets(), batch_size=16)


def vision_model(family: str) -> nn.Module:
    t = _transformers()
    if family == "vit":
        return t.ViTForImageClassification(
            t.ViTConfig(
                image_size=16,
                patch_size=4,
                num_channels=1,
                hidden_size=32,
                num_hidden_layers=2,
                num_attention_heads=2,
                intermediate_size=64,
                num_labels=10,
            )
        )
    if family == "convnext":  # its layer scale starts at 1e-6, as ConvNeXt's does
        config = t.ConvNextConfig(
            num_channels=1, patch_size=2, hidden_sizes=[16, 32], depths=[1, 1], num_stages=2, num_labels=10
        )
        return t.ConvNextForImageClassification(config)
    if family == "swin":
        config = t.SwinConfig(
            image_size=16,
            patch_size=2,
            num_channels=1,
            embed_dim=16,
            depths=[1, 1],
            num_heads=[2, 2],
            window_size=4,
            num_labels=10,
        )
        return t.SwinForImageClassification(config)
    config = t.ResNetConfig(
        num_channels=1,
        embedding_size=16,
        hidden_sizes=[16, 32],
        depths=[1, 1],
        layer_type="basic",
        num_labels=10,
        downsample_in_first_stage=False,
    )
    return t.ResNetForImageClassification(config)


def vision(family: str, optim: Optim, raw_pixels: bool = False) -> Built:
    """A vision model on the digits at 16x16; pixels scaled to [-1, 1], or (``raw_pixels``) left in [0, 255]
    as an 8-bit image holds them."""
    images, labels = digits(size=16)
    pixels = images * (255 / 16)
    pixels = pixels if raw_pixels else (pixels / 255 - 0.5) / 0.5
    return HFModel(vision_model(family), optim, "pixel_values"), Tensors(pixels, labels, batch_size=32)


def wav2vec2(optim: Optim, int16: bool = False) -> Built:
    """Wav2Vec2 classifying raw waveforms: normalised per utterance, or (``int16``) the 16-bit samples as read."""
    t = _transformers()
    config = t.Wav2Vec2Config(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        conv_dim=(16, 16),
        conv_stride=(5, 2),
        conv_kernel=(10, 3),
        num_conv_pos_embeddings=16,
        num_conv_pos_embedding_groups=4,
        mask_time_prob=0.0,
        num_labels=4,
        classifier_proj_size=16,
    )
    wave, labels = tones()
    wave = torch.round(wave * 32767) if int16 else normalised(wave)
    return HFModel(t.Wav2Vec2ForSequenceClassification(config), optim, "input_values"), Tensors(
        wave, labels, batch_size=16
    )


def whisper(optim: Optim) -> Built:
    """Whisper transcribing tones from log-spectrogram features, one token per tone."""
    t = _transformers()
    config = t.WhisperConfig(
        vocab_size=VOCAB,
        num_mel_bins=16,
        d_model=32,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        max_source_positions=16,
        max_target_positions=16,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        decoder_start_token_id=1,
    )
    model = t.WhisperForConditionalGeneration(config)
    return HFModel(model, optim, "input_features"), Tensors(*spoken_tokens(), batch_size=16)


# -------------------------------------------------------------------------------------- small CNNs, MLPs


def mlp(width: int, classes: int, hidden: int = 64, activation: type[nn.Module] = nn.ReLU) -> nn.Sequential:
    return nn.Sequential(
        nn.Linear(width, hidden), activation(), nn.Linear(hidden, hidden), activation(), nn.Linear(hidden, classes)
    )


def digits_mlp(optim: Optim, pixel_scale: float = 1 / 16) -> Built:
    """An MLP on the flattened digits; ``pixel_scale`` multiplies the raw pixels (1/16: into [0, 1])."""
    x, y = digits(flat=True)
    return Net(mlp(64, 10), optim), Tensors(x * pixel_scale, y, batch_size=32)


def lenet(optim: Optim) -> Built:
    """Two convolutions with ReLU and pooling, then a linear classifier, on the digits in [0, 1]."""
    net = nn.Sequential(
        nn.Conv2d(1, 8, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(8, 16, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(16 * 2 * 2, 10),
    )
    x, y = digits()
    return Net(net, optim), Tensors(x / 16, y, batch_size=32)


def sorted_digits(shuffled: bool) -> Built:
    """The digits MLP on the training set sorted by class; unless ``shuffled``, the loader keeps that order, so each
    batch holds one class (a common bug: data read class folder by class folder, ``shuffle`` left at False)."""
    x, y = digits(flat=True)
    kept = torch.argsort(y, stable=True)
    return Net(mlp(64, 10), Optim("adam", 1e-3)), Tensors(x[kept] / 16, y[kept], batch_size=32, shuffle=shuffled)


def regression_mlp(optim: Optim, target_scale: float = 1.0, target_offset: float = 0.0) -> Built:
    """An MLP regressing a linear target; ``target_scale`` and ``target_offset`` put it in other units."""
    x, y = regression()
    net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))
    return Net(net, optim, loss="mse"), Tensors(x, y * target_scale + target_offset, batch_size=32)


def examples_model(name: str) -> Built:
    """A model of ``examples/`` with its own data module and optimizer."""
    from examples.digits import DigitsCNN, DigitsDataModule
    from examples.numnet import NumDataModule, NumNet
    from examples.resnet import DigitsResNet
    from examples.transformer import TinyTransformerLM, TokenDataModule

    made: dict[str, Callable[[], Built]] = {
        "digits-cnn": lambda: (DigitsCNN(), DigitsDataModule(batch_size=32)),
        "digits-resnet": lambda: (DigitsResNet(), DigitsDataModule(batch_size=32)),
        "numnet": lambda: (NumNet(), NumDataModule(batch_size=32)),
        "tiny-transformer": lambda: (TinyTransformerLM(), TokenDataModule(seq_len=16, batch_size=16)),
    }
    return made[name]()


# ----------------------------------------------------------------------------------------- buggy programs


def classes_net(net: nn.Sequential, optim: Optim, **kwargs: Any) -> Built:
    return Net(net, optim, **kwargs), Tensors(*gaussian_classes(), batch_size=32)


def dead_relu(bias: float) -> Built:
    """A ReLU after a linear layer whose bias starts at ``bias`` (-10: every unit is dead from the start)."""
    first = nn.Linear(16, 64)
    with torch.no_grad():
        first.bias.fill_(bias)
    return classes_net(nn.Sequential(first, nn.ReLU(), nn.Linear(64, 4)), Optim("sgd", 0.05, momentum=0.9))


def deep_sigmoid(fixed: bool) -> Built:
    """20 sigmoid layers under SGD; the fix normalises each sigmoid's input (batch normalisation)."""
    layers: list[nn.Module] = []
    for i in range(20):
        layers += [nn.Linear(16 if i == 0 else 32, 32), *([nn.BatchNorm1d(32)] if fixed else []), nn.Sigmoid()]
    return classes_net(nn.Sequential(*layers, nn.Linear(32, 4)), Optim("sgd", 0.1, momentum=0.9))


def log_of_relu(eps: float) -> Built:
    """``log`` of a ReLU's output as a feature: ``eps=0`` takes the log of zero."""
    net = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), Log(eps), nn.Linear(64, 4))
    return classes_net(net, Optim("adam", 1e-3))


def standardize_digits(eps: float) -> Built:
    """The digits standardised per batch in the model; the corner pixels are always 0, so ``eps=0`` divides 0 by 0."""
    x, y = digits(flat=True)
    net = nn.Sequential(Standardize(eps), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
    return Net(net, Optim("sgd", 0.05, momentum=0.9)), Tensors(x, y, batch_size=32)


def nan_record(at_step: int, steps: int, cleaned: bool) -> Built:
    """One record of the data set holds a NaN feature; unshuffled, it is in the batch of ``at_step``.
    Cleaned, the NaN is replaced by 0 before training."""
    x, y = gaussian_classes(n=steps * 32)
    x[at_step * 32 + 5, 3] = 0.0 if cleaned else float("nan")
    return Net(mlp(16, 4), Optim("adam", 1e-3)), Tensors(x, y, batch_size=32, shuffle=False)


def bad_batch(at_step: int, steps: int, fixed: bool) -> Built:
    """The batch of ``at_step`` comes from a shard whose features are in other units (x100); unshuffled."""
    x, y = gaussian_classes(n=steps * 32)
    if not fixed:
        x[at_step * 32 : (at_step + 1) * 32] *= 100.0
    return Net(mlp(16, 4), Optim("adam", 1e-3)), Tensors(x, y, batch_size=32, shuffle=False)


def one_unit_softmax(fixed: bool) -> Built:
    """A binary classifier with one output unit behind a softmax (always 1.0: no gradient); the fix is a sigmoid."""
    x, y = gaussian_classes(classes=2)
    net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1), nn.Sigmoid() if fixed else nn.Softmax(dim=1))
    return Net(net, Optim("adam", 1e-3), loss="bce"), Tensors(x, y.float().unsqueeze(1), batch_size=32)


def loss_from_item(fixed: bool) -> Built:
    """``training_step`` returns ``torch.tensor(loss.item(), requires_grad=True)``: no gradient reaches a weight."""
    return classes_net(mlp(16, 4), Optim("sgd", 0.05, momentum=0.9), loss_from_item=not fixed)


def saturated_tanh(weight_scale: float) -> Built:
    """A tanh after a linear layer whose weights start ``weight_scale`` times PyTorch's default."""
    first = nn.Linear(16, 64)
    with torch.no_grad():
        first.weight.mul_(weight_scale)
    return classes_net(nn.Sequential(first, nn.Tanh(), nn.Linear(64, 4)), Optim("sgd", 0.05, momentum=0.9))


def double_softmax(fixed: bool) -> Built:
    """A softmax layer at the end of a digits MLP whose output goes to ``cross_entropy`` (a softmax again)."""
    x, y = digits(flat=True)
    layers: list[nn.Module] = [nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10)]
    net = nn.Sequential(*layers, *([] if fixed else [nn.Softmax(dim=1)]))
    return Net(net, Optim("adam", 1e-3)), Tensors(x / 16, y, batch_size=32)


def tanh_logits(fixed: bool) -> Built:
    """A tanh at the end of a digits MLP whose output goes to ``cross_entropy``: logits bounded to (-1, 1)."""
    x, y = digits(flat=True)
    layers: list[nn.Module] = [nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10)]
    net = nn.Sequential(*layers, *([] if fixed else [nn.Tanh()]))
    return Net(net, Optim("adam", 1e-3)), Tensors(x / 16, y, batch_size=32)


def sigmoid_logits(fixed: bool) -> Built:
    """A sigmoid at the end of a digits MLP telling the digits 5 to 9 from the others, whose output goes to
    ``binary_cross_entropy_with_logits``: a second sigmoid, every predicted probability in (0.5, 0.73)."""
    x, y = digits(flat=True)
    layers: list[nn.Module] = [nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1)]
    net = nn.Sequential(*layers, *([] if fixed else [nn.Sigmoid()]))
    return Net(net, Optim("adam", 1e-3), loss="bce_logits"), Tensors(x / 16, (y >= 5).float()[:, None], batch_size=32)


def zero_init(fixed: bool) -> Built:
    """A digits MLP whose linear layers start at zero, weights and biases: every hidden unit is zero, the same for
    every input, and stays so."""
    net = mlp(64, 10)
    if not fixed:
        for layer in net:
            if isinstance(layer, nn.Linear):
                nn.init.zeros_(layer.weight)
                nn.init.zeros_(layer.bias)
    x, y = digits(flat=True)
    return Net(net, Optim("sgd", 0.05, momentum=0.9)), Tensors(x / 16, y, batch_size=32)


class HeadOnly(Net):
    """A :class:`Net` whose ``configure_optimizers`` gives the optimizer the last layer's parameters only."""

    def configure_optimizers(self) -> Any:
        return self.optim.build([{"params": list(self.net[-1].parameters())}])


def head_only(fixed: bool) -> Built:
    """A digits MLP whose optimizer was given the head's parameters only: the rest gets gradients, never steps."""
    x, y = digits(flat=True)
    return (Net if fixed else HeadOnly)(mlp(64, 10), Optim("adam", 1e-3)), Tensors(x / 16, y, batch_size=32)


class CutFeatures(Net):
    """A :class:`Net` whose forward detaches the hidden features before the head: the layers before it never learn."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net[2:](self.net[:2](x).detach())


def cut_features(fixed: bool) -> Built:
    """A digits MLP whose hidden features are detached on their way to the head (``.detach()`` in ``forward``): the
    head learns, the first layer runs in every step and never gets a gradient."""
    x, y = digits(flat=True)
    return (Net if fixed else CutFeatures)(mlp(64, 10), Optim("adam", 1e-3)), Tensors(x / 16, y, batch_size=32)


class ManualNet(Net):
    """A :class:`Net` under manual optimization, zeroing ``.grad`` after each step unless ``zero`` is false."""

    def __init__(self, *args: Any, zero: bool = True, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.automatic_optimization, self.zero = False, zero

    def training_step(self, batch: Any, batch_idx: int) -> dict[str, torch.Tensor]:
        optimizer = self.optimizers()
        loss, accuracy = self.loss_and_accuracy(batch)
        self.manual_backward(loss)
        optimizer.step()  # type: ignore[union-attr]
        if self.zero:
            optimizer.zero_grad()  # type: ignore[union-attr]
        return {"loss": loss.detach(), **({} if accuracy is None else {"accuracy": accuracy.detach()})}


def never_zeroed(fixed: bool) -> Built:
    """A digits MLP under manual optimization that never calls ``optimizer.zero_grad()``: each step applies the sum
    of every gradient so far."""
    x, y = digits(flat=True)
    return ManualNet(mlp(64, 10), Optim("adam", 1e-3), zero=fixed), Tensors(x / 16, y, batch_size=32)


class StepDecay(Net):
    """A :class:`Net` under SGD with momentum and ``StepLR(step_size=10, gamma=0.1)``, a schedule that counts epochs,
    stepped every ``interval``."""

    def __init__(self, net: nn.Sequential, interval: str) -> None:
        super().__init__(net, Optim("sgd", 0.05, momentum=0.9))
        self.interval = interval

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.parameters(), lr=self.optim.lr, momentum=self.optim.momentum)
        schedule = torch.optim.lr_scheduler.StepLR(optimizer, step_size=10, gamma=0.1)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": self.interval}}


def epoch_schedule(fixed: bool) -> Built:
    """A digits MLP whose epoch schedule is stepped every batch (``"interval": "step"``): at 1e-4 of its learning rate
    by step 40. Fixed: every epoch (56 batches), as it was written for."""
    x, y = digits(flat=True)
    return StepDecay(mlp(64, 10), "epoch" if fixed else "step"), Tensors(x / 16, y, batch_size=32)


def hot_layer(scale: float) -> Built:
    """The middle layer's weights multiplied by ``scale`` at the start."""
    net = mlp(16, 4)
    middle = net[2]
    assert isinstance(middle, nn.Linear)
    with torch.no_grad():
        middle.weight.mul_(scale)
    return classes_net(net, Optim("adam", 1e-3))


def fast_layer(factor: float) -> Built:
    """SGD at 0.05, the middle layer's parameter group at ``factor`` times that."""
    x, y = gaussian_classes()
    return Net(mlp(16, 4), Optim("sgd", 0.05), fast="net.2", fast_factor=factor), Tensors(x, y, batch_size=32)


def edge_of_stability(multiple: float) -> Built:
    """Full-batch gradient descent on a linear regression at ``multiple`` times the largest stable learning rate
    (``2 / λ_max`` of the loss' Hessian): above 1, the gradient norm grows by ``|1 - 2 multiple|`` every step."""
    x, y = regression(n=32)
    design = torch.cat([x, torch.ones(32, 1)], dim=1)
    top = float(torch.linalg.eigvalsh(2 * design.T @ design / len(x)).max())
    net = nn.Sequential(nn.Linear(8, 1))
    return Net(net, Optim("sgd", multiple * 2 / top), loss="mse"), Tensors(x, y, batch_size=32, shuffle=False)


@dataclass(frozen=True)
class Program:
    """A buggy program, its fixed twin, and the ground truth of the bug (as :class:`Case` names it)."""

    name: str
    family: str
    bug: Builder
    fix: Builder
    optimizer: str
    symptom: str
    layer: str | None
    measurable_step: int
    steps: int = 60
    also: tuple[str, ...] = ()


NAN_STEP, SPIKE_STEP = 30, 50
HEALTHY_STEPS = 100


def programs() -> list[Program]:
    """The buggy programs, with the ground truth as written before any detector ran on them."""
    sgd, sgd_m, adam = Optim("sgd", 0.05), Optim("sgd", 0.05, momentum=0.9), Optim("adam", 1e-3)
    adamw = Optim("adamw", 1e-3, warmup=10)
    # fmt: off
    return [
        Program(
            "unnormalised inputs (digits x1000)", "mlp", partial(digits_mlp, sgd_m, 1000.0), partial(digits_mlp, sgd_m),
            str(sgd_m), symptom="input_scale", layer="net.0", measurable_step=0,
        ),
        Program(
            "digits sorted by class, not shuffled", "mlp", partial(sorted_digits, False), partial(sorted_digits, True),
            str(adam), symptom="input_scale", layer=None, measurable_step=0,
        ),
        Program(
            "unnormalised regression targets (x2e4 + 5e4)", "regression-mlp", partial(regression_mlp, adam, 2e4, 5e4),
            partial(regression_mlp, adam), str(adam), symptom="input_scale", layer=None, measurable_step=0,
        ),
        Program(
            "ViT on raw 0-255 pixels", "vit", partial(vision, "vit", adamw, raw_pixels=True),
            partial(vision, "vit", adamw), str(adamw), symptom="input_scale",
            layer="model.vit.embeddings.patch_embeddings.projection", measurable_step=0,
        ),
        Program(
            "Wav2Vec2 on int16 samples", "wav2vec2", partial(wav2vec2, adamw, int16=True), partial(wav2vec2, adamw),
            str(adamw), symptom="input_scale", layer="model.wav2vec2.feature_extractor.conv_layers.0.conv",
            measurable_step=0,
        ),
        Program(
            "20 sigmoid layers under SGD", "sigmoid-mlp", partial(deep_sigmoid, False), partial(deep_sigmoid, True),
            str(Optim("sgd", 0.1, momentum=0.9)), symptom="vanishing_gradients", layer="net.0", measurable_step=0,
        ),
        Program(
            "ReLU behind a bias of -10", "mlp", partial(dead_relu, -10.0), partial(dead_relu, 0.0), str(sgd_m),
            symptom="dead_units", layer="net.1", measurable_step=0,
        ),
        Program(
            "SGD learning rate x20 on a regression", "regression-mlp", partial(regression_mlp, Optim("sgd", 1.0)),
            partial(regression_mlp, sgd), str(Optim("sgd", 1.0)), symptom="exploding_gradients", layer=None,
            measurable_step=1, also=("nonfinite",),
        ),
        Program(
            "log of a ReLU's zeros", "mlp", partial(log_of_relu, 0.0), partial(log_of_relu, 1.0), str(adam),
            symptom="nonfinite", layer="net.2", measurable_step=0,
        ),
        Program(
            "standardising by a zero std", "mlp", partial(standardize_digits, 0.0), partial(standardize_digits, 1e-5),
            str(sgd_m), symptom="nonfinite", layer="net.0", measurable_step=0,
        ),
        Program(
            f"a NaN record at step {NAN_STEP}", "mlp", partial(nan_record, NAN_STEP, 60, False),
            partial(nan_record, NAN_STEP, 60, True), str(adam), symptom="nonfinite", layer="net.0",
            measurable_step=NAN_STEP,
        ),
        Program(
            "softmax over one output unit", "mlp", partial(one_unit_softmax, False), partial(one_unit_softmax, True),
            str(adam), symptom="no_learning", layer=None, measurable_step=0,
        ),
        Program(
            "loss rebuilt from loss.item()", "mlp", partial(loss_from_item, False), partial(loss_from_item, True),
            str(sgd_m), symptom="no_learning", layer=None, measurable_step=0,
        ),
        Program(
            "tanh behind weights x50", "tanh-mlp", partial(saturated_tanh, 50.0), partial(saturated_tanh, 1.0),
            str(sgd_m), symptom="saturation", layer="net.1", measurable_step=0,
        ),
        Program(
            "softmax output into cross_entropy", "mlp", partial(double_softmax, False), partial(double_softmax, True),
            str(adam), symptom="saturation", layer="net.3", measurable_step=0,
        ),
        Program(
            "tanh on the logits of cross_entropy", "mlp", partial(tanh_logits, False), partial(tanh_logits, True),
            str(adam), symptom="saturation", layer="net.3", measurable_step=0,
        ),
        Program(
            "sigmoid output into binary_cross_entropy_with_logits", "mlp", partial(sigmoid_logits, False),
            partial(sigmoid_logits, True), str(adam), symptom="saturation", layer="net.3", measurable_step=0,
        ),
        Program(
            "all-zero initialisation", "mlp", partial(zero_init, False), partial(zero_init, True), str(sgd_m),
            symptom="dead_units", layer="net.1", measurable_step=0,
        ),
        Program(
            "optimizer given the head's parameters only", "mlp", partial(head_only, False), partial(head_only, True),
            str(adam), symptom="update_ratio", layer="net.0", measurable_step=0,
        ),
        Program(
            "hidden features detached before the head", "mlp", partial(cut_features, False),
            partial(cut_features, True), str(adam), symptom="no_learning", layer="net.0", measurable_step=0,
        ),
        Program(
            "manual optimization without zero_grad", "mlp", partial(never_zeroed, False),
            partial(never_zeroed, True), str(adam), symptom="exploding_gradients", layer=None, measurable_step=1,
        ),
        Program(
            "an epoch schedule stepped every batch", "mlp", partial(epoch_schedule, False),
            partial(epoch_schedule, True), "SGD 0.05, momentum 0.9, StepLR(10, 0.1)", symptom="update_ratio",
            layer=None, measurable_step=40, steps=120,
        ),
        Program(
            "one layer's weights x1e4", "mlp", partial(hot_layer, 1e4), partial(hot_layer, 1.0), str(adam),
            symptom="activation_growth", layer="net.2", measurable_step=0,
        ),
        Program(
            "one parameter group's learning rate x100", "mlp", partial(fast_layer, 100.0), partial(fast_layer, 1.0),
            f"{sgd}, net.2 x100", symptom="update_ratio", layer="net.2", measurable_step=0,
        ),
        Program(
            "full-batch SGD at 1.1x the stable learning rate", "linear-regression", partial(edge_of_stability, 1.1),
            partial(edge_of_stability, 0.5), "SGD 2.2 / λ_max (fixed: 1.0 / λ_max)", symptom="exploding_gradients",
            layer=None, measurable_step=1, steps=80,
        ),
        Program(
            f"a bad batch (x100) at step {SPIKE_STEP}", "mlp", partial(bad_batch, SPIKE_STEP, 70, False),
            partial(bad_batch, SPIKE_STEP, 70, True), str(adam), symptom="loss_spike", layer=None,
            measurable_step=SPIKE_STEP, steps=70,
        ),
    ]
    # fmt: on


def buggy(seeds: int = 2) -> list[Case]:
    """Every buggy program and its fixed twin under seeds ``0 .. seeds - 1``, each program followed by its twin."""
    cases = []
    for p in programs():
        for seed in range(seeds):
            fix = Case(f"fixed: {p.name} #{seed}", p.family, p.fix, p.steps, p.optimizer, seed=seed)
            bug = replace(fix, name=f"{p.name} #{seed}", build=p.bug, symptom=p.symptom, layer=p.layer, twin=fix.name)
            cases += [replace(bug, measurable_step=p.measurable_step, also=p.also), fix]
    return cases


# ----------------------------------------------------------------------------------------------- healthy


def healthy() -> list[Case]:
    """The healthy runs: each architecture under one or two optimizers and precisions."""
    adamw, adamw_flat, adamw_slow = Optim("adamw", 1e-3, warmup=10), Optim("adamw", 1e-3), Optim("adamw", 5e-4)
    adam, sgd_m = Optim("adam", 1e-3), Optim("sgd", 0.05, momentum=0.9)
    fp32, bf16, fp16 = "32-true", "bf16-mixed", "16-mixed"  # fp16: autocast and a GradScaler
    said = {fp32: "fp32", bf16: "bf16", fp16: "fp16"}
    # fmt: off
    runs: list[tuple[str, Callable[[Optim], Built], Optim, str]] = [
        ("gpt2", partial(lm, "gpt2"), adamw, fp32), ("gpt2", partial(lm, "gpt2"), Optim("adamw", 3e-4), bf16),
        ("llama", partial(lm, "llama"), adamw, fp32), ("llama", partial(lm, "llama"), adam, bf16),
        ("mistral", partial(lm, "mistral"), adamw_flat, fp32), ("mistral", partial(lm, "mistral"), adamw, bf16),
        ("qwen2", partial(lm, "qwen2"), adamw, fp32), ("qwen2", partial(lm, "qwen2"), adamw_flat, bf16),
        ("mixtral", partial(lm, "mixtral"), adamw, fp32), ("mixtral", partial(lm, "mixtral"), adamw_flat, bf16),
        ("llama + LoRA", partial(lm, "llama", lora=True), adamw, fp32),
        ("llama + LoRA", partial(lm, "llama", lora=True), adamw_flat, bf16),
        ("bert", partial(encoder, "bert"), adamw, fp32), ("bert", partial(encoder, "bert"), adamw_slow, bf16),
        ("albert", partial(encoder, "albert"), adamw, fp32), ("albert", partial(encoder, "albert"), adam, bf16),
        ("roberta", partial(encoder, "roberta"), adamw_flat, fp32),
        ("roberta", partial(encoder, "roberta"), adamw, bf16),
        ("t5", partial(seq2seq, "t5"), adamw, fp32), ("t5", partial(seq2seq, "t5"), adamw_flat, bf16),
        ("t5", partial(seq2seq, "t5"), Optim("adafactor", 0.0), fp32),
        ("bart", partial(seq2seq, "bart"), adamw, fp32), ("bart", partial(seq2seq, "bart"), adamw_slow, bf16),
        ("vit", partial(vision, "vit"), adamw, fp32), ("vit", partial(vision, "vit"), adamw_slow, bf16),
        ("convnext", partial(vision, "convnext"), adamw_flat, fp32),
        ("convnext", partial(vision, "convnext"), adamw, bf16),
        ("swin", partial(vision, "swin"), adamw, fp32), ("swin", partial(vision, "swin"), adamw_slow, bf16),
        ("resnet", partial(vision, "resnet"), sgd_m, fp32), ("resnet", partial(vision, "resnet"), adamw_flat, bf16),
        ("wav2vec2", wav2vec2, adamw, fp32), ("wav2vec2", wav2vec2, adamw_slow, bf16),
        ("whisper", whisper, adamw, fp32), ("whisper", whisper, adamw_flat, bf16),
        # under SGD, a transformer's attention queries and keys get a small gradient while it is near uniform
        ("bart", partial(seq2seq, "bart"), sgd_m, fp32), ("wav2vec2", wav2vec2, Optim("sgd", 0.01, momentum=0.9), fp32),
        ("whisper", whisper, Optim("sgd", 0.01, momentum=0.9), fp32),
        ("lenet", lenet, sgd_m, fp32), ("lenet", lenet, adamw, bf16),
        ("mlp", digits_mlp, Optim("sgd", 0.1, momentum=0.9), fp32), ("mlp", digits_mlp, adam, bf16),
        ("regression-mlp", regression_mlp, Optim("sgd", 0.05), fp32),
        ("regression-mlp", regression_mlp, Optim("sgd", 0.02, momentum=0.9, warmup=10), fp32),
        # fp16: but for GPT-2's, the GradScaler's first scale is too high for their gradients: it skips the steps that
        # overflow and lowers the scale, as loss scaling does
        ("gpt2", partial(lm, "gpt2"), adamw, fp16), ("albert", partial(encoder, "albert"), adamw, fp16),
        ("vit", partial(vision, "vit"), adamw, fp16), ("convnext", partial(vision, "convnext"), adamw_flat, fp16),
        ("swin", partial(vision, "swin"), adamw, fp16), ("lenet", lenet, sgd_m, fp16),
    ]
    examples = [
        ("digits-cnn", "Adam 0.01"), ("digits-resnet", "SGD 0.05, momentum 0.9"),
        ("tiny-transformer", "AdamW 0.001"), ("numnet", "Adam 0.01"),
    ]
    # fmt: on
    cases = [
        Case(
            f"{family}, {optim}, {said[precision]}",
            family,
            partial(make, optim),
            HEALTHY_STEPS,
            str(optim),
            precision,
        )
        for family, make, optim, precision in runs
    ]
    return cases + [
        Case(
            f"{family} (examples/), {optim}, fp32",
            family,
            partial(examples_model, family),
            HEALTHY_STEPS,
            f"{optim} (the example's)",
        )
        for family, optim in examples
    ]


def corpus(seeds: int = 2) -> list[Case]:
    """Every case: the healthy runs, then each buggy program and its fixed twin under ``seeds`` seeds."""
    return healthy() + buggy(seeds)


def quick() -> list[Case]:
    """A handful of cases for a smoke run: two healthy runs (one of them a transformers model), one buggy
    program and its twin."""
    named = {c.name: c for c in healthy()}
    pair = [c for c in buggy(1) if c.program.endswith("ReLU behind a bias of -10")]
    return [named["mlp, Adam 0.001, bf16"], named["llama, AdamW 0.001, warm-up 10, fp32"], *pair]


def families(cases: list[Case]) -> Iterator[str]:
    """The architecture families of ``cases``, each once, in order."""
    yield from dict.fromkeys(c.family for c in cases)
