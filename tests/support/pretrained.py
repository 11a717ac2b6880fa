"""Third-party architectures for the tests: transformers' and peft's models, built from small configs with random
weights (nothing is downloaded)."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

THIRD_PARTY = ["gpt2", "llama", "mixtral", "t5", "vit", "whisper", "lora", "bert", "resnet", "segformer"]


class Pretrained(pl.LightningModule):
    """A transformers model (or a peft one) from a small config, trained with AdamW on ``loss(net, x)`` in batches
    of 8 of ``x``."""

    def __init__(self, net: nn.Module, x: torch.Tensor, loss: Any) -> None:
        super().__init__()
        self.net, self.x, self.loss = net, x, loss

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss: torch.Tensor = self.loss(self.net, batch[0])
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-3)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(self.x), batch_size=8)


def language_model_loss(net: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    return net(input_ids=tokens, labels=tokens).loss


def image_classes(net: nn.Module, images: torch.Tensor) -> torch.Tensor:
    """Cross-entropy against which of the first two channels' means are positive (4 classes)."""
    labels = (images[:, 0].mean((1, 2)) > 0).long() + 2 * (images[:, 1].mean((1, 2)) > 0).long()
    return F.cross_entropy(net(pixel_values=images).logits, labels)


def third_party(kind: str) -> pl.LightningModule:
    """A third-party architecture (transformers, peft), built from a small config with random weights."""
    transformers = pytest.importorskip("transformers")
    tokens = torch.randint(0, 64, (32, 12), generator=torch.Generator().manual_seed(1))
    small = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2}
    heads = {"num_attention_heads": 4, "num_key_value_heads": 2}
    gpt2 = {"vocab_size": 64, "n_embd": 32, "n_layer": 2, "n_head": 2, "n_positions": 32}
    if kind == "gpt2":
        return Pretrained(transformers.GPT2LMHeadModel(transformers.GPT2Config(**gpt2)), tokens, language_model_loss)
    if kind == "llama":
        net = transformers.LlamaForCausalLM(transformers.LlamaConfig(**small, **heads))
        return Pretrained(net, tokens, language_model_loss)
    if kind == "mixtral":
        config = transformers.MixtralConfig(**small, **heads, num_local_experts=4, num_experts_per_tok=2)
        return Pretrained(transformers.MixtralForCausalLM(config), tokens, language_model_loss)
    if kind == "t5":
        config = transformers.T5Config(
            vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, decoder_start_token_id=0
        )
        return Pretrained(transformers.T5ForConditionalGeneration(config), tokens, language_model_loss)
    if kind == "vit":
        vit = {"image_size": 16, "patch_size": 4, "num_attention_heads": 2, "num_labels": 3}
        config = transformers.ViTConfig(**vit, hidden_size=32, num_hidden_layers=2, intermediate_size=64)
        images = torch.randn(32, 3, 16, 16)
        return Pretrained(
            transformers.ViTForImageClassification(config), images, lambda net, x: net(pixel_values=x).logits.sum()
        )
    if kind == "whisper":  # its positional embeddings are frozen
        layers = {"encoder_layers": 1, "decoder_layers": 1, "encoder_attention_heads": 2, "decoder_attention_heads": 2}
        sizes = {"d_model": 32, "encoder_ffn_dim": 64, "decoder_ffn_dim": 64, "num_mel_bins": 8, "vocab_size": 64}
        positions = {"max_source_positions": 8, "max_target_positions": 16, "pad_token_id": 0}
        config = transformers.WhisperConfig(**layers, **sizes, **positions, decoder_start_token_id=1)

        def speech(net: nn.Module, features: torch.Tensor) -> torch.Tensor:
            decoder = torch.ones(len(features), 4, dtype=torch.long, device=features.device)
            return net(input_features=features, decoder_input_ids=decoder).logits.square().mean()

        return Pretrained(transformers.WhisperForConditionalGeneration(config), torch.randn(32, 8, 16), speech)
    if kind == "bert":  # its attention dropout is applied by the attention kernel: the module never runs
        encoder = {"num_attention_heads": 2, "max_position_embeddings": 32}
        return Pretrained(
            transformers.BertForMaskedLM(transformers.BertConfig(**small, **encoder)), tokens, language_model_loss
        )
    images = torch.randn(32, 3, 16, 16, generator=torch.Generator().manual_seed(1))
    if kind == "resnet":  # BatchNorm, and an nn.Identity shortcut beside its first block
        config = transformers.ResNetConfig(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], num_labels=4)
        return Pretrained(transformers.ResNetForImageClassification(config), images, image_classes)
    if kind == "segformer":  # one dropout module called after two layers of different widths
        config = transformers.SegformerConfig(
            num_encoder_blocks=2, depths=[1, 1], sr_ratios=[2, 1], hidden_sizes=[16, 32], num_attention_heads=[1, 2],
            patch_sizes=[7, 3], strides=[4, 2], decoder_hidden_size=32, num_labels=4,
        )  # fmt: skip
        return Pretrained(transformers.SegformerForImageClassification(config), images, image_classes)
    peft = pytest.importorskip("peft")  # LoRA: the base model frozen, adapters on attention
    net = peft.get_peft_model(
        transformers.GPT2LMHeadModel(transformers.GPT2Config(**gpt2)), peft.LoraConfig(r=4, target_modules=["c_attn"])
    )
    return Pretrained(net, tokens, language_model_loss)
