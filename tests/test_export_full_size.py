"""Full-size exports with random weights pass the gate (slow: `make test-slow`)."""
import json

import pytest

from export.__main__ import main as export_main


@pytest.mark.slow
@pytest.mark.parametrize("name,blocks", [("deit_tiny_patch16_224", 12), ("deit_small_patch16_224", 12),
                                         ("swin_tiny_patch4_window7_224", 12)])
def test_full_size_random_init_export_passes_the_gate(tmp_path, name, blocks):
    export_main([name, "--random-init", "--out", str(tmp_path), "--no-explain"])
    m = json.loads((tmp_path / name / "manifest.json").read_text())
    assert m["op_counts"]["Attention"] == blocks
    assert m["parity"]["logits_max_abs_diff"] <= 1e-4 and m["parity"]["top1_agreement"] == 1.0
