"""Class-specific relevance (models/relevance.py): the written-out backward equals autograd's, each rule as published.

References: the model's own forward with its attention probabilities on the graph (scaled_dot_product_attention
replaced by its explicit form, the probabilities recorded), torch.autograd.grad for the gradients, and the rule as
its paper states it: Chefer et al. 2021's R = I, R += mean_h(max(dA * A, 0)) R for ViT and DeiT; Grad-CAM on the
final-norm tokens for Swin; the class channels before the pool (CAM) for mini-Xception.
"""
from unittest import mock

import pytest
import torch
import torch.nn.functional as F

from models import create_model
from models.mini_xception import MiniXception
from models.relevance import relevance, relevance_of

TOLERANCE = 1e-4  # of the map's largest value


def recording_attention(store: list):
    """scaled_dot_product_attention written out, each call's probabilities kept (and their gradient retained)."""
    def sdpa(q, k, v, attn_mask=None, dropout_p=0.0, **_):
        scores = (q * q.shape[-1] ** -0.5) @ k.transpose(-2, -1)
        probs = (scores if attn_mask is None else scores + attn_mask).softmax(-1)
        probs.retain_grad()
        store.append(probs)
        return probs @ v
    return sdpa


def chefer_reference(model, x: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Chefer et al. 2021 as published, by autograd, for a ViT/DeiT: (logits, [B, class tokens, patches])."""
    probs = []
    with mock.patch.object(F, "scaled_dot_product_attention", recording_attention(probs)), torch.enable_grad():
        logits = model(x)
        target = torch.where(target.abs().sum(-1, keepdim=True) == 0,
                             F.one_hot(logits.argmax(-1), logits.shape[-1]).float(), target)
        grads = torch.autograd.grad((logits * target).sum(), probs)
    n = probs[0].shape[-1]
    r = torch.eye(n).expand(x.shape[0], n, n)
    for a, g in zip(probs, grads):
        r = r + (g * a).clamp(min=0).mean(dim=1) @ r
    return logits.detach(), r[:, :model.num_class_tokens, model.num_prefix_tokens:].detach()


def gradcam_reference(model, x: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Grad-CAM on Swin's final-norm tokens (pytorch-grad-cam's recipe): weights the mean gradient per channel."""
    with torch.enable_grad():
        tokens = model.norm(model.layers(model.patch_embed(x))).detach().requires_grad_()
        logits = model.head(tokens)
        target = torch.where(target.abs().sum(-1, keepdim=True) == 0,
                             F.one_hot(logits.argmax(-1), logits.shape[-1]).float(), target)
        (grad,) = torch.autograd.grad((logits * target).sum(), tokens)
    weights = grad.mean(dim=1, keepdim=True)
    return logits.detach(), (weights * tokens).sum(-1).clamp(min=0).unsqueeze(1).detach()


def cam_reference(model: MiniXception, x: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """CAM as the forward computes it: the head convolution's output (a forward hook), the target's channels."""
    seen = []
    handle = model.head.register_forward_hook(lambda module, args, out: seen.append(out))
    with torch.no_grad():
        logits = model(x)
    handle.remove()
    target = torch.where(target.abs().sum(-1, keepdim=True) == 0,
                         F.one_hot(logits.argmax(-1), logits.shape[-1]).float(), target)
    return logits, torch.einsum("bc,bchw->bhw", target, seen[0]).flatten(1).unsqueeze(1)


def reference(model, x, target):
    if isinstance(model, MiniXception):
        return cam_reference(model, x, target)
    return chefer_reference(model, x, target) if hasattr(model, "blocks") else gradcam_reference(model, x, target)


def assert_maps_equal(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.shape == want.shape
    scale = want.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12)
    worst = float(((got - want).abs() / scale).max())
    assert worst < TOLERANCE, worst


def mixed_targets(batch: int, classes: int) -> torch.Tensor:
    """A batch's targets, every row different: one-hot labels, a row of zeros (the top label) and a weight vector."""
    target = F.one_hot(torch.arange(batch) % classes, classes).float()
    target[1] = 0
    target[2] = torch.linspace(-1, 1, classes)
    return target


MODELS = {
    "vit": ("vit_micro_patch8_96", {}),
    "deit": ("deit_micro_distilled_patch8_96", {}),
    "vit_layerscale_registers_quickgelu": ("vit_micro_patch8_96",
                                           {"init_values": 0.5, "reg_tokens": 2, "act_layer": "quick_gelu",
                                            "pre_norm": True}),
    "swin": ("swin_micro_patch4_window6_96", {}),
    "mini_xception": ("mini_xception_fer2013_64", {}),
}


@pytest.mark.parametrize("name", MODELS)
def test_relevance_equals_autograd_at_batch_1_and_in_a_mixed_batch(name):
    arch, overrides = MODELS[name]
    torch.manual_seed(0)
    model = create_model(arch, num_classes=6, **overrides).eval()
    for p in model.parameters():  # weights far from their init, so that no path is near zero
        p.data.add_(torch.randn_like(p) * 0.05)
    size = model.spec.img_size
    x = torch.randn(5, 3, size, size)
    target = mixed_targets(5, 6)
    with torch.no_grad():
        logits, maps = relevance(model, x, target)
        alone_logits, alone = relevance(model, x[:1], target[:1])
    want_logits, want = reference(model, x, target)
    torch.testing.assert_close(logits, want_logits, atol=1e-5, rtol=1e-4)
    assert_maps_equal(maps, want)
    assert_maps_equal(alone, want[:1])
    rule, grid, rows = relevance_of(model)
    assert maps.shape[1:] == (rows, grid[0] * grid[1])


@pytest.mark.parametrize("name", ["vit", "deit", "swin", "mini_xception"])
def test_the_map_depends_on_the_label(name):
    arch, overrides = MODELS[name]
    torch.manual_seed(1)
    model = create_model(arch, num_classes=6, **overrides).eval()
    x = torch.randn(1, 3, model.spec.img_size, model.spec.img_size).expand(6, -1, -1, -1)
    with torch.no_grad():
        _, maps = relevance(model, x, torch.eye(6))
    maps = maps / maps.amax(dim=-1, keepdim=True).clamp(min=1e-12)
    assert min(float((maps[i] - maps[j]).abs().max()) for i in range(6) for j in range(i)) > 1e-3


def test_an_embedding_model_has_no_relevance():
    model = create_model("vit_micro_patch8_96", num_classes=0)
    assert relevance_of(model) is None
    with pytest.raises(ValueError, match="no classes"):
        relevance(model, torch.zeros(1, 3, 96, 96), torch.zeros(1, 0))
