"""The health checks' pure helpers, on module names laid out as real models lay them out."""

from __future__ import annotations

import pytest

from lightning_hooks.diagnose.checks import scaled_down

CONVNEXT = ["stem", "stages.0.layers.0", "stages.0.layers.0.dwconv", "stages.0.layers.0.pwconv2", "head"]
DINOV2 = ["embed", "layer.0.norm1", "layer.0.attn.qkv", "layer.0.ls1", "layer.0.norm2", "layer.0.mlp.fc1",
          "layer.0.ls2", "norm"]  # fmt: skip
LORA = ["wte", "h.0.attn.c_attn.base_layer", "h.0.attn.c_attn.lora_A.default", "h.0.attn.c_attn.lora_B.default",
        "h.0.attn.c_proj", "lm_head"]  # fmt: skip
ZEROED = ["net.0", "net.2", "net.4"]


@pytest.mark.parametrize(
    ("layers", "zero", "expected"),
    [
        # the block owns its layer scale: the layers inside it
        (CONVNEXT, {"stages.0.layers.0"}, {"stages.0.layers.0.dwconv", "stages.0.layers.0.pwconv2"}),
        # a LayerScale module holds nothing else: the layers of the block around it
        (
            DINOV2,
            {"layer.0.ls1", "layer.0.ls2"},
            {"layer.0.norm1", "layer.0.attn.qkv", "layer.0.norm2", "layer.0.mlp.fc1"},
        ),
        # LoRA's B starts at zero: its A and the frozen base inside the same wrapper
        (LORA, {"h.0.attn.c_attn.lora_B.default"}, {"h.0.attn.c_attn.base_layer", "h.0.attn.c_attn.lora_A.default"}),
        # every weight zero: no module but the root holds another layer, so nothing is scaled down by design
        (ZEROED, set(ZEROED), set()),
        (CONVNEXT, set(), set()),
    ],
    ids=["block-owns-scale", "layer-scale-module", "lora", "all-zero", "none"],
)
def test_the_layers_behind_a_scale_that_starts_at_zero(layers: list[str], zero: set[str], expected: set[str]) -> None:
    assert scaled_down(zero, layers) == expected
