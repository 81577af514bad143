"""Checkpoint loading: foreign layouts, head replacement, and files that must be refused."""
import os
from pathlib import Path

import pytest
import torch
from fill import deterministic_input, deterministic_state_dict
from safetensors.torch import load_file, save_file

import models
from models import WeightsError, load_weights

REFERENCE = load_file(Path(__file__).parent / "reference" / "timm_reference.safetensors")


def timm_weights(name: str, **kwargs) -> dict[str, torch.Tensor]:
    with torch.device("meta"):
        model = models.create_model(name, **kwargs)
    return deterministic_state_dict({k: tuple(v.shape) for k, v in model.state_dict().items()})


def logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(deterministic_input(2, model.spec.img_size))


def test_official_swin_release_layout_loads(tmp_path):
    """Microsoft's files: downsample at the end of a stage, `head`, and the index/mask buffers saved."""
    name = "swin_tiny_patch4_window7_224"
    timm_sd = timm_weights(name)
    buffers = dict(models.create_model(name).named_buffers())  # the release files keep two kinds of them
    official = {}
    for k, v in timm_sd.items():
        if ".downsample." in k:
            stage = int(k.split(".")[1])
            k = k.replace(f"layers.{stage}.", f"layers.{stage - 1}.", 1)
        official[k.replace("head.fc.", "head.")] = v
    official.update({k: v for k, v in buffers.items() if k.endswith(("relative_position_index", "attn_mask"))})
    assert "layers.0.downsample.reduction.weight" in official and "head.weight" in official
    torch.save({"model": official}, tmp_path / "swin_tiny_patch4_window7_224.pth")

    model = load_weights(models.create_model(name), tmp_path / "swin_tiny_patch4_window7_224.pth")
    torch.testing.assert_close(logits(model), REFERENCE[name], atol=1e-4, rtol=0)


def test_official_deit_file_and_ddp_prefix_load(tmp_path):
    name = "deit_tiny_distilled_patch16_224"
    torch.save({"model": timm_weights(name)}, tmp_path / "deit.pth")
    torch.save({"state_dict": {f"module.{k}": v for k, v in timm_weights(name).items()}}, tmp_path / "ddp.pt")
    for file in ("deit.pth", "ddp.pt"):
        model = load_weights(models.create_model(name), tmp_path / file)
        torch.testing.assert_close(logits(model), REFERENCE[name], atol=1e-4, rtol=0)


def test_wrong_architecture_names_the_first_mismatching_key(tmp_path):
    save_file(timm_weights("deit_small_patch16_224"), tmp_path / "small.safetensors")
    with pytest.raises(WeightsError, match=r"does not fit deit_tiny_patch16_224: 'cls_token' has shape \[1, 1, 384\]"):
        load_weights(models.create_model("deit_tiny_patch16_224"), tmp_path / "small.safetensors")


def test_a_vits_weights_start_a_distilled_deit_its_distillation_token_as_cls(tmp_path):
    """How the embedded shapes-deit began: the distillation token, its position and its head are [CLS]'s copies."""
    save_file(timm_weights("deit_tiny_patch16_224"), tmp_path / "tiny.safetensors")
    deit = load_weights(models.create_model("deit_tiny_distilled_patch16_224"), tmp_path / "tiny.safetensors")
    vit = load_weights(models.create_model("deit_tiny_patch16_224"), tmp_path / "tiny.safetensors")
    assert torch.equal(deit.dist_token, vit.cls_token) and torch.equal(deit.cls_token, vit.cls_token)
    assert torch.equal(deit.pos_embed[:, :2], vit.pos_embed[:, :1].expand(-1, 2, -1))
    assert torch.equal(deit.pos_embed[:, 2:], vit.pos_embed[:, 1:])
    assert torch.equal(deit.head_dist.weight, vit.head.weight) and torch.equal(deit.head_dist.bias, vit.head.bias)


def test_other_class_count_needs_replace_head(tmp_path):
    save_file(timm_weights("deit_tiny_patch16_224"), tmp_path / "in1k.safetensors")
    with pytest.raises(WeightsError, match="1000 classes, the model 7; pass --replace-head"):
        load_weights(models.create_model("deit_tiny_patch16_224", num_classes=7), tmp_path / "in1k.safetensors")

    model = models.create_model("deit_tiny_patch16_224", num_classes=7)
    head_before = model.head.weight.clone()
    load_weights(model, tmp_path / "in1k.safetensors", replace_head=True)
    assert torch.equal(model.head.weight, head_before)
    torch.testing.assert_close(model.blocks[3].mlp.fc1.weight,
                               timm_weights("deit_tiny_patch16_224")["blocks.3.mlp.fc1.weight"])


def test_non_strict_keeps_missing_keys_but_checks_shapes(tmp_path):
    headless = {k: v for k, v in timm_weights("swin_micro_patch4_window6_96").items() if not k.startswith("head.")}
    save_file(headless, tmp_path / "headless.safetensors")
    with pytest.raises(WeightsError, match="missing key 'head.fc.weight'"):
        load_weights(models.create_model("swin_micro_patch4_window6_96"), tmp_path / "headless.safetensors")
    model = models.create_model("swin_micro_patch4_window6_96")
    initial_head = model.head.fc.weight.detach().clone()
    load_weights(model, tmp_path / "headless.safetensors", strict=False)
    assert torch.equal(model.head.fc.weight, initial_head) and torch.equal(model.norm.weight, headless["norm.weight"])
    save_file({**headless, "norm.weight": torch.ones(3)}, tmp_path / "misfit.safetensors")
    with pytest.raises(WeightsError, match="'norm.weight' has shape"):
        load_weights(model, tmp_path / "misfit.safetensors", strict=False)


@pytest.mark.parametrize("suffix", [".pth", ".safetensors"])
def test_truncated_file_is_a_clear_error(tmp_path, suffix):
    path = tmp_path / f"model{suffix}"
    weights = timm_weights("vit_micro_patch8_96")
    torch.save(weights, path) if suffix == ".pth" else save_file(weights, path)
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(WeightsError, match="not a readable checkpoint"):
        load_weights(models.create_model("vit_micro_patch8_96"), path)


class _Payload:
    """Unpickling this would create a directory: the proof that code ran."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.mkdir, (str(self.marker),)


def test_pickle_with_code_is_refused_and_never_runs(tmp_path):
    marker = tmp_path / "code-ran"
    torch.save({"model": {"cls_token": torch.zeros(1)}, "extra": _Payload(marker)}, tmp_path / "evil.pth")
    with pytest.raises(WeightsError, match="refused, it holds pickled objects other than tensors"):
        load_weights(models.create_model("vit_micro_patch8_96"), tmp_path / "evil.pth")
    assert not marker.exists()


def test_missing_file_and_non_state_dict(tmp_path):
    with pytest.raises(WeightsError, match="no such file"):
        load_weights(models.create_model("vit_micro_patch8_96"), tmp_path / "absent.pth")
    torch.save([1, 2, 3], tmp_path / "list.pth")
    with pytest.raises(WeightsError, match="not a state dict"):
        load_weights(models.create_model("vit_micro_patch8_96"), tmp_path / "list.pth")


def test_swin_bias_table_is_resized_for_another_window(tmp_path):
    weights = timm_weights("swin_micro_patch4_window6_96")
    # each head's table one constant (its number): any interpolation keeps a constant, a mix-up of heads does not
    heads = {k: torch.arange(1.0, v.shape[1] + 1).expand_as(v).contiguous() for k, v in weights.items()
             if k.endswith("relative_position_bias_table")}
    save_file({**weights, **heads}, tmp_path / "w6.safetensors")
    model = models.create_model("swin_micro_patch4_window6_96", window_size=4)
    load_weights(model, tmp_path / "w6.safetensors")
    tables = {k: v for k, v in model.state_dict().items() if k in heads}
    assert tables.keys() == heads.keys()
    assert tables["layers.0.blocks.0.attn.relative_position_bias_table"].shape == (49, 2)
    for table in tables.values():
        torch.testing.assert_close(table, torch.arange(1.0, table.shape[1] + 1).expand(49, -1), atol=1e-5, rtol=0)
    assert torch.isfinite(logits(model)).all()
