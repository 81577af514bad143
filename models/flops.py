"""Analytic multiply-accumulates per image, what the ViT/DeiT/Swin papers report as "GFLOPs".

Counted: the patch embedding, attention (projections and the two attention matmuls), MLPs, patch merging
and classifier heads. Not counted: norms, softmax, GELU, additions (a few percent at most).
"""
import torch
from torch import nn

from .registry import create_model
from .swin_transformer import SwinTransformer
from .vision_transformer import VisionTransformer


def attention_macs(tokens: int, dim: int) -> int:
    """Multi-head self-attention over N tokens of C channels: 4NC^2 (q, k, v, out) + 2N^2C (QK^T, AV)."""
    return 4 * tokens * dim * dim + 2 * tokens * tokens * dim


def window_attention_macs(tokens: int, dim: int, window: int) -> int:
    """Swin's window attention with M x M windows: 4NC^2 + 2M^2NC, linear in N."""
    return 4 * tokens * dim * dim + 2 * window * window * tokens * dim


def mlp_macs(tokens: int, dim: int, hidden: int) -> int:
    return 2 * tokens * dim * hidden


def _patch_embed_macs(model: nn.Module) -> int:
    proj = model.patch_embed.proj
    kernel = proj.kernel_size[0] * proj.kernel_size[1]
    return model.patch_embed.num_patches * proj.in_channels * kernel * proj.out_channels


def _vit_macs(model: VisionTransformer) -> int:
    tokens, dim = model.pos_embed.shape[1], model.embed_dim
    blocks = sum(attention_macs(tokens, dim) + mlp_macs(tokens, dim, b.mlp.fc1.out_features) for b in model.blocks)
    heads = dim * model.num_classes * (1 if model.head_dist is None else 2)
    return _patch_embed_macs(model) + blocks + heads


def _swin_macs(model: SwinTransformer) -> int:
    total = _patch_embed_macs(model)
    for stage in model.layers:
        (h, w), dim = stage.resolution, stage.blocks[0].norm1.normalized_shape[0]
        if not isinstance(stage.downsample, nn.Identity):
            total += h * w * stage.downsample.reduction.in_features * dim
        for block in stage.blocks:
            m = block.window
            padded = -(-h // m) * m * (-(-w // m) * m)  # windows cover the padded grid
            total += window_attention_macs(padded, dim, m) + mlp_macs(h * w, dim, block.mlp.fc1.out_features)
    return total + model.num_features * model.num_classes


def flops(name_or_model: str | nn.Module, img_size: int | None = None) -> float:
    """GMACs per image for a registry name (at its own or the given image size) or a built model."""
    if isinstance(name_or_model, str):
        with torch.device("meta"):  # the structure is all that is needed: allocate nothing
            model = create_model(name_or_model, img_size=img_size)
    elif img_size is not None:
        raise ValueError("img_size applies to a model name; a built model has its own")
    else:
        model = name_or_model
    if isinstance(model, VisionTransformer):
        return _vit_macs(model) / 1e9
    if isinstance(model, SwinTransformer):
        return _swin_macs(model) / 1e9
    raise TypeError(f"no FLOP formula for {type(model).__name__}")
