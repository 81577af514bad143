from pathlib import Path

import pytest
import torch

import models

PUBLISHED_PARAMS = {
    "deit_tiny_patch16_224": 5_717_416,
    "deit_tiny_distilled_patch16_224": 5_910_800,
    "deit_small_patch16_224": 22_050_664,
    "vit_base_patch16_224": 86_567_656,
    "swin_tiny_patch4_window7_224": 28_288_354,
}
# GMACs as the DeiT, ViT and Swin papers report them ("GFLOPs").
PUBLISHED_GMACS = {
    "deit_tiny_patch16_224": 1.3,
    "deit_small_patch16_224": 4.6,
    "vit_base_patch16_224": 17.6,
    "swin_tiny_patch4_window7_224": 4.5,
    "swin_small_patch4_window7_224": 8.7,
    "swin_base_patch4_window7_224": 15.4,
}


def test_registry_knows_the_named_models():
    names = set(models.list_models())
    for size in ("tiny", "small", "base"):
        assert {f"vit_{size}_patch16_224", f"deit_{size}_patch16_224", f"deit_{size}_distilled_patch16_224",
                f"swin_{size}_patch4_window7_224"} <= names
    assert models.get_spec("vit_base_patch16_fer_112").task == "expression"
    with pytest.raises(KeyError, match="unknown model 'vit_huge'.*deit_base_patch16_224"):
        models.create_model("vit_huge")


@pytest.mark.parametrize("name,count", PUBLISHED_PARAMS.items())
def test_parameter_counts_are_the_published_ones(name, count):
    with torch.device("meta"):
        model = models.create_model(name)
    assert sum(p.numel() for p in model.parameters()) == count


@pytest.mark.parametrize("name,gmacs", PUBLISHED_GMACS.items())
def test_flops_match_the_papers(name, gmacs):
    assert models.flops(name) == pytest.approx(gmacs, rel=0.05)


def test_flops_follow_the_formulas():
    # ViT-B/16 at 224: 12 blocks of 4NC^2 + 2N^2C + 8NC^2 (N = 197, C = 768), patch embedding and head.
    n, c = 197, 768
    expected = 12 * (12 * n * c * c + 2 * n * n * c) + 196 * 3 * 16 * 16 * c + c * 1000
    assert models.flops("vit_base_patch16_224") == pytest.approx(expected / 1e9, rel=1e-9)
    # Window attention is linear in N: doubling the image side ~quadruples Swin's cost, not 16x.
    swin = "swin_tiny_patch4_window7_224"
    assert models.flops(swin, img_size=448) / models.flops(swin) < 4.5
    assert models.flops(models.create_model("vit_micro_patch8_96")) == models.flops("vit_micro_patch8_96")


def test_create_model_overrides_classes_and_size():
    model = models.create_model("deit_tiny_distilled_patch16_224", num_classes=7, img_size=112)
    assert model.spec.num_classes == 7 and model.spec.img_size == 112 and model.spec.labels is None
    assert model.pos_embed.shape == (1, 7 * 7 + 2, 192)
    out = model.eval()(torch.randn(3, 3, 112, 112))
    assert out.shape == (3, 7)


def test_distilled_model_returns_both_heads_only_when_distilling():
    model = models.create_model("deit_micro_distilled_patch8_96").train()
    x = torch.randn(2, 3, 96, 96)
    assert isinstance(model(x), torch.Tensor)
    model.distilled_training = True
    heads, features = model(x), model.forward_features(x)  # no dropout in the micro models: the same features
    assert isinstance(heads, tuple) and len(heads) == 2
    torch.testing.assert_close(heads, (model.head(features[:, 0]), model.head_dist(features[:, 1])))
    model.eval()
    torch.testing.assert_close(model(x), (heads[0] + heads[1]) / 2)


def test_the_shipped_imagenet_labels_are_the_1000_classes_in_index_order():
    labels = (Path(models.__file__).parent / "imagenet_1k_labels.txt").read_text().splitlines()
    assert len(labels) == 1000 and all(labels)
    assert labels[0].startswith("tench") and labels[281] == "tabby, tabby cat" and labels[999].startswith("toilet")
