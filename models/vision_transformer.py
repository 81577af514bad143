"""Vision Transformer (ViT) and DeiT, including the distilled DeiT.

- ViT: "An Image is Worth 16x16 Words", Dosovitskiy et al. 2020, https://arxiv.org/abs/2010.11929
- DeiT: "Training data-efficient image transformers & distillation through attention", Touvron et al. 2020,
  https://arxiv.org/abs/2012.12877

The image is cut into p x p patches, each projected to a D-dim token; a learnable [CLS] token (and, for the
distilled DeiT, a distillation token) is prepended, a learnable position embedding added, and the sequence goes
through pre-norm blocks (LayerNorm -> multi-head self-attention -> residual, LayerNorm -> MLP -> residual).
The classifier reads the final [CLS] token; the distilled DeiT also has a head on the distillation token and
averages the two heads' logits at inference.

Parameter names and shapes are timm's, so timm and official DeiT checkpoints load without renaming.
"""
import math

import torch
import torch.nn.functional as F
from torch import nn

from .layers import DropPath, Mlp, PatchEmbed, init_weights


class Attention(nn.Module):
    """Multi-head self-attention with a packed qkv projection: softmax(Q K^T / sqrt(d)) V per head."""

    def __init__(self, dim: int, num_heads: int, qkv_bias: bool = True, attn_drop: float = 0.0, proj_drop: float = 0.0):
        super().__init__()
        if dim % num_heads:
            raise ValueError(f"embed dim {dim} is not divisible by {num_heads} heads")
        self.num_heads = num_heads
        self.attn_drop = attn_drop
        self.qkv = nn.Linear(dim, dim * 3, bias=qkv_bias)
        self.proj = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(proj_drop)

    def forward(self, x: torch.Tensor, query_rows: int = 0) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """[B, N, C] -> [B, N, C]. With query_rows = r > 0, also returns the attention probabilities of the
        first r tokens' queries, [B, heads, r, N], computed beside the fused kernel: O(r N d) per head."""
        B, N, C = x.shape
        qkv = self.qkv(x).reshape(B, N, 3, self.num_heads, C // self.num_heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)  # each [B, heads, N, head_dim]
        x = F.scaled_dot_product_attention(q, k, v, dropout_p=self.attn_drop if self.training else 0.0)
        x = self.proj_drop(self.proj(x.transpose(1, 2).reshape(B, N, C)))
        if not query_rows:
            return x
        scores = (q[:, :, :query_rows] * q.shape[-1] ** -0.5) @ k.transpose(-2, -1)
        return x, scores.softmax(dim=-1)


class Block(nn.Module):
    """Pre-norm transformer encoder block."""

    def __init__(self, dim: int, num_heads: int, mlp_ratio: float = 4.0, qkv_bias: bool = True,
                 drop: float = 0.0, attn_drop: float = 0.0, drop_path: float = 0.0, norm_eps: float = 1e-6):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=norm_eps)
        self.attn = Attention(dim, num_heads, qkv_bias=qkv_bias, attn_drop=attn_drop, proj_drop=drop)
        self.norm2 = nn.LayerNorm(dim, eps=norm_eps)
        self.mlp = Mlp(dim, int(dim * mlp_ratio), drop=drop)
        self.drop_path = DropPath(drop_path)

    def forward(self, x: torch.Tensor, query_rows: int = 0) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """With query_rows > 0 also returns those rows' attention probabilities (see Attention)."""
        attn = self.attn(self.norm1(x), query_rows)
        attn, probs = attn if query_rows else (attn, None)
        x = x + self.drop_path(attn)
        x = x + self.drop_path(self.mlp(self.norm2(x)))
        return (x, probs) if query_rows else x


class VisionTransformer(nn.Module):
    """ViT / DeiT classifier; `distilled=True` adds DeiT's distillation token and second head, and with
    `dist_head=False` the token alone: the classifier reads [CLS] only (transformers' DeiTForImageClassification,
    what fine-tuning a DeiT there gives). `norm_eps` is every LayerNorm's (timm 1e-6, transformers 1e-12)."""

    def __init__(
        self,
        img_size: int = 224,
        patch_size: int = 16,
        in_chans: int = 3,
        num_classes: int = 1000,
        embed_dim: int = 768,
        depth: int = 12,
        num_heads: int = 12,
        mlp_ratio: float = 4.0,
        qkv_bias: bool = True,
        distilled: bool = False,
        dist_head: bool = True,
        norm_eps: float = 1e-6,
        drop_rate: float = 0.0,
        attn_drop_rate: float = 0.0,
        drop_path_rate: float = 0.0,
    ):
        super().__init__()
        self.num_classes = num_classes
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.distilled = distilled
        self.num_prefix_tokens = 2 if distilled else 1
        # When set (and training), the distilled model returns both heads' logits for the distillation loss.
        self.distilled_training = False

        self.patch_embed = PatchEmbed(img_size, patch_size, in_chans, embed_dim)
        num_tokens = self.patch_embed.num_patches + self.num_prefix_tokens
        self.cls_token = nn.Parameter(torch.zeros(1, 1, embed_dim))
        self.pos_embed = nn.Parameter(torch.zeros(1, num_tokens, embed_dim))
        self.dist_token = nn.Parameter(torch.zeros(1, 1, embed_dim)) if distilled else None
        self.pos_drop = nn.Dropout(drop_rate)
        rates = [drop_path_rate * i / max(depth - 1, 1) for i in range(depth)]  # stochastic depth grows with depth
        self.blocks = nn.Sequential(*[
            Block(embed_dim, num_heads, mlp_ratio, qkv_bias, drop_rate, attn_drop_rate, rates[i], norm_eps)
            for i in range(depth)
        ])
        self.norm = nn.LayerNorm(embed_dim, eps=norm_eps)
        self.head_drop = nn.Dropout(drop_rate)
        self.head = nn.Linear(embed_dim, num_classes)
        self.head_dist = nn.Linear(embed_dim, num_classes) if distilled and dist_head else None
        self._init_weights()

    def _init_weights(self) -> None:
        for p in (self.pos_embed, self.cls_token, self.dist_token):
            if p is not None:
                nn.init.trunc_normal_(p, std=0.02)
        self.apply(init_weights)

    def no_weight_decay(self) -> set[str]:
        return {"pos_embed", "cls_token", "dist_token"}

    def reset_classifier(self, num_classes: int) -> None:
        self.num_classes = num_classes
        self.head = nn.Linear(self.embed_dim, num_classes)
        init_weights(self.head)
        if self.head_dist is not None:
            self.head_dist = nn.Linear(self.embed_dim, num_classes)
            init_weights(self.head_dist)

    def _embed(self, x: torch.Tensor) -> torch.Tensor:
        """[B, 3, H, W] -> tokens [B, prefix + patches, D] with position embeddings; [CLS] (and dist) first."""
        x = self.patch_embed(x)
        prefix = [self.cls_token] if self.dist_token is None else [self.cls_token, self.dist_token]
        x = torch.cat([t.expand(x.shape[0], -1, -1) for t in prefix] + [x], dim=1)
        return self.pos_drop(x + self.pos_embed)

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        """[B, 3, H, W] -> normalised tokens [B, prefix + patches, D]."""
        return self.norm(self.blocks(self._embed(x)))

    def forward_head(self, x: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        logits = self.head(self.head_drop(x[:, 0]))
        if self.head_dist is None:
            return logits
        logits_dist = self.head_dist(self.head_drop(x[:, 1]))
        if self.distilled_training and self.training:
            return logits, logits_dist
        return (logits + logits_dist) / 2

    def forward(self, x: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        return self.forward_head(self.forward_features(x))

    def forward_with_attention(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits and the last block's attention rows of the prefix tokens over the patches,
        [B, heads, prefix, patches]: [CLS] (and the distillation token) looking at the image."""
        x, rows = self.blocks[-1](self.blocks[:-1](self._embed(x)), query_rows=self.num_prefix_tokens)
        return self.forward_head(self.norm(x)), rows[..., self.num_prefix_tokens:]

    def attention_probabilities(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Every block's full attention probabilities [B, heads, N, N], computed explicitly (for rollout)."""
        x, probs = self._embed(x), []
        for block in self.blocks:
            x, p = block(x, query_rows=x.shape[1])
            probs.append(p)
        return probs


def resample_pos_embed(pos_embed: torch.Tensor, grid_size: tuple[int, int], num_prefix_tokens: int) -> torch.Tensor:
    """Resize a square grid of position embeddings to `grid_size` (bicubic, as timm does); prefix tokens kept."""
    prefix, grid = pos_embed[:, :num_prefix_tokens], pos_embed[:, num_prefix_tokens:]
    old = math.isqrt(grid.shape[1])
    if old * old != grid.shape[1]:
        raise ValueError(f"position embedding of {grid.shape[1]} patch tokens is not a square grid")
    grid = grid.float().reshape(1, old, old, -1).permute(0, 3, 1, 2)
    grid = F.interpolate(grid, size=grid_size, mode="bicubic", antialias=True, align_corners=False)
    grid = grid.permute(0, 2, 3, 1).reshape(1, grid_size[0] * grid_size[1], -1).to(pos_embed.dtype)
    return torch.cat([prefix, grid], dim=1)


def checkpoint_filter_fn(state_dict: dict[str, torch.Tensor], model: VisionTransformer) -> dict[str, torch.Tensor]:
    """Adapt a timm / official DeiT state dict to `model`: resize the position embedding to its grid."""
    out = dict(state_dict)
    pos = out.get("pos_embed")
    prefix = 2 if "dist_token" in out else 1  # the file's own prefix tokens, whatever the model has
    if pos is not None and pos.ndim == 3 and pos.shape[1] - prefix != model.patch_embed.num_patches:
        out["pos_embed"] = resample_pos_embed(pos, model.patch_embed.grid_size, prefix)
    return out
