"""Full-size exports with random weights pass the gate (slow: `make test-slow`)."""
import json

import pytest

from export.__main__ import main as export_main


FULL_SIZE = [("deit_tiny_patch16_224", 12), ("deit_small_patch16_224", 12), ("vit_base_patch16_224", 12),
             ("swin_tiny_patch4_window7_224", 12)]
# LayerNorms after a residual sum, fused with it in fp16: 2 a block but the first (after the position embedding),
# Swin also not the first of each of its 4 stages but its 3 patch mergings' instead; plus the final norm
SKIP_LAYER_NORMS = {"deit_tiny_patch16_224": 24, "deit_small_patch16_224": 24, "vit_base_patch16_224": 24,
                    "swin_tiny_patch4_window7_224": 24}


@pytest.mark.slow
@pytest.mark.parametrize("name,blocks", FULL_SIZE)
def test_full_size_random_init_export_passes_the_gate(tmp_path, name, blocks):
    export_main([name, "--random-init", "--out", str(tmp_path), "--no-explain"])
    m = json.loads((tmp_path / name / "manifest.json").read_text())
    assert m["op_counts"]["Attention"] == blocks
    assert m["parity"]["logits_max_abs_diff"] <= 1e-4 and m["parity"]["top1_agreement"] == 1.0


@pytest.mark.slow
@pytest.mark.parametrize("name,blocks", FULL_SIZE)
def test_full_size_random_init_exports_in_fp16(tmp_path, name, blocks):
    """On CUDA where it starts, else on the CPU provider; near-tie random logits pass by their error."""
    export_main([name, "--random-init", "--precision", "fp16", "--out", str(tmp_path), "--no-explain"])
    m = json.loads((tmp_path / f"{name}-fp16" / "manifest.json").read_text())
    fp16 = m["parity"]["fp16"]
    assert fp16["top1_agreement"] >= 0.99 or fp16["logits_relative_error"] <= 0.05
    assert m["op_counts"]["com.microsoft:SkipLayerNormalization"] == SKIP_LAYER_NORMS[name]
    assert m["op_counts"]["com.microsoft:BiasGelu"] == blocks
    assert m["parity"]["fused_fp32"]["logits_max_abs_diff"] <= 1e-4
    assert m["op_counts"]["com.microsoft:MultiHeadAttention"] == blocks - 1
