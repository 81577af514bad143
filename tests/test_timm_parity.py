"""Our models against timm: same state-dict layout, same logits for the same weights and input.

The reference logits were recorded from timm itself by tests/reference/make_timm_reference.py.
"""
import json
from pathlib import Path

import pytest
import torch
from cases import CASES, case_id
from fill import deterministic_input, deterministic_state_dict
from safetensors.torch import load_file, save_file

import models

REF = Path(__file__).parent / "reference"
LOGITS = load_file(REF / "timm_reference.safetensors")
KEYS = json.loads((REF / "timm_keys.json").read_text())


def _shapes(model: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_state_dict_layout_is_timms(case):
    with torch.device("meta"):
        model = models.create_model(case["ours"], **case.get("kwargs", {}))
    assert [[k, list(s)] for k, s in _shapes(model).items()] == KEYS[case_id(case)]


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_logits_match_timm(case, tmp_path):
    model = models.create_model(case["ours"], **case.get("kwargs", {})).eval()
    source = case.get("source_img_size")
    weights_model = models.create_model(case["ours"], img_size=source) if source else model
    path = tmp_path / "weights.safetensors"
    save_file(deterministic_state_dict(_shapes(weights_model)), path)
    models.load_weights(model, path, strict=True)
    with torch.no_grad():
        logits = model(deterministic_input(2, model.spec.img_size))
    reference = LOGITS[case_id(case)]
    assert logits.shape == reference.shape
    torch.testing.assert_close(logits, reference, atol=1e-4, rtol=0)
