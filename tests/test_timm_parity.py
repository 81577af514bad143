"""Our models against timm: same state-dict layout, same logits for the same weights and input.

The reference logits were recorded from timm itself by tests/reference/make_timm_reference.py.
"""
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from cases import CASES, case_id
from fill import deterministic_input, deterministic_state_dict
from safetensors.torch import load_file, save_file

import models
from models.swin_transformer import PatchMerging, stage_orders

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


# the grids of successive stages; odd ones are padded before their merging (not covered by timm's cases above)
@pytest.mark.parametrize("grids", [[(12, 12), (6, 6), (3, 3), (2, 2)], [(5, 7), (3, 4), (2, 2)], [(4, 2), (2, 1)]])
def test_patch_merging_concatenates_each_neighbourhood_as_the_original(grids):
    """Token rows in merge order (a reshape) or padded (a gather): every merging gives the original's
    cat([x0, x1, x2, x3]) of each zero-padded 2 x 2 neighbourhood, in the next stage's row order."""
    orders = stage_orders(grids)
    torch.manual_seed(0)
    x = torch.randn(2, *grids[0], 4)
    rows = x.flatten(1, 2)[:, orders[0]]
    for (grid, order_in), order_out in zip(zip(grids, orders), orders[1:]):
        merging = PatchMerging(x.shape[-1], grid, order_in, order_out)
        padded = F.pad(x, (0, 0, 0, grid[1] % 2, 0, grid[0] % 2))
        neighbours = [padded[:, 0::2, 0::2], padded[:, 1::2, 0::2], padded[:, 0::2, 1::2], padded[:, 1::2, 1::2]]
        with torch.no_grad():
            x, rows = merging.reduction(merging.norm(torch.cat(neighbours, -1))), merging(rows)
        torch.testing.assert_close(rows, x.flatten(1, 2)[:, order_out])
    assert torch.equal(orders[-1], torch.arange(len(orders[-1])))  # the last stage's rows are row-major
