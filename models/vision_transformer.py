"""Vision Transformer (ViT) and DeiT, including the distilled DeiT.

- ViT: "An Image is Worth 16x16 Words", Dosovitskiy et al. 2020, https://arxiv.org/abs/2010.11929
- DeiT: "Training data-efficient image transformers & distillation through attention", Touvron et al. 2020,
  https://arxiv.org/abs/2012.12877

The image is cut into p x p patches, each projected to a D-dim token; a learnable [CLS] token (and, for the
distilled DeiT, a distillation token) is prepended, a learnable position embedding added, and the sequence goes
through pre-norm blocks (LayerNorm -> multi-head self-attention -> residual, LayerNorm -> MLP -> residual).
The classifier reads the final [CLS] token; the distilled DeiT also has a head on the distillation token and
averages the two heads' logits at inference.

Options for embedding models (each off by default, named as timm names them): `init_values` (DINOv2's layer
scale), `reg_tokens` (DINOv2's registers: "Vision Transformers Need Registers", Darcet et al. 2023,
https://arxiv.org/abs/2309.16588), `global_pool="token_avg"` (DINOv2's linear-probe feature), `pre_norm` and
`act_layer="quick_gelu"` (CLIP's image tower: Radford et al. 2021, https://arxiv.org/abs/2103.00020), `proj_dim`
(CLIP's visual projection of the pooled feature), and `class_token=False` with `global_pool="map"` (SigLIP's image
tower: no [CLS], the tokens pooled by a learnt query's attention; Zhai et al. 2023, https://arxiv.org/abs/2303.15343).

Parameter names and shapes are timm's, so timm and official DeiT checkpoints load without renaming.
"""
import math

import torch
import torch.nn.functional as F
from torch import nn

from .layers import DropPath, LayerScale, Mlp, PatchEmbed, init_weights, row_mean


class Attention(nn.Module):
    """Multi-head self-attention with a packed qkv projection: softmax(Q K^T / sqrt(d)) V per head (`causal`: each
    token sees itself and those before it, as a text tower's do)."""

    def __init__(self, dim: int, num_heads: int, qkv_bias: bool = True, attn_drop: float = 0.0, proj_drop: float = 0.0,
                 causal: bool = False):
        super().__init__()
        if dim % num_heads:
            raise ValueError(f"embed dim {dim} is not divisible by {num_heads} heads")
        self.num_heads = num_heads
        self.attn_drop = attn_drop
        self.causal = causal
        self.qkv = nn.Linear(dim, dim * 3, bias=qkv_bias)
        self.proj = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(proj_drop)

    def forward(self, x: torch.Tensor, query_rows: int = 0) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """[B, N, C] -> [B, N, C]. With query_rows = r > 0, also returns the attention probabilities of the
        first r tokens' queries, [B, heads, r, N], computed beside the fused kernel: O(r N d) per head."""
        B, N, C = x.shape
        qkv = self.qkv(x).reshape(B, N, 3, self.num_heads, C // self.num_heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)  # each [B, heads, N, head_dim]
        x = F.scaled_dot_product_attention(q, k, v, dropout_p=self.attn_drop if self.training else 0.0,
                                           is_causal=self.causal)
        x = self.proj_drop(self.proj(x.transpose(1, 2).reshape(B, N, C)))
        if not query_rows:
            return x
        scores = (q[:, :, :query_rows] * q.shape[-1] ** -0.5) @ k.transpose(-2, -1)
        return x, scores.softmax(dim=-1)


class Block(nn.Module):
    """Pre-norm transformer encoder block."""

    def __init__(self, dim: int, num_heads: int, mlp_ratio: float = 4.0, qkv_bias: bool = True,
                 drop: float = 0.0, attn_drop: float = 0.0, drop_path: float = 0.0, norm_eps: float = 1e-6,
                 init_values: float | None = None, act_layer: str = "gelu", causal: bool = False):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=norm_eps)
        self.attn = Attention(dim, num_heads, qkv_bias=qkv_bias, attn_drop=attn_drop, proj_drop=drop, causal=causal)
        self.ls1 = LayerScale(dim, init_values) if init_values else nn.Identity()
        self.norm2 = nn.LayerNorm(dim, eps=norm_eps)
        self.mlp = Mlp(dim, int(dim * mlp_ratio), drop=drop, act_layer=act_layer)
        self.ls2 = LayerScale(dim, init_values) if init_values else nn.Identity()
        self.drop_path = DropPath(drop_path)

    def forward(self, x: torch.Tensor, query_rows: int = 0) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """With query_rows > 0 also returns those rows' attention probabilities (see Attention)."""
        attn = self.attn(self.norm1(x), query_rows)
        attn, probs = attn if query_rows else (attn, None)
        x = x + self.drop_path(self.ls1(attn))
        x = x + self.drop_path(self.ls2(self.mlp(self.norm2(x))))
        return (x, probs) if query_rows else x


# global_pool's choices (the embedding): "token" [CLS], "avg" the patch tokens' mean, both side by side, the pooler,
# or "map" a learnt query's attention (AttentionPool)
POOLINGS = ("token", "avg", "token_avg", "pooler", "map")


class AttentionPool(nn.Module):
    """Multi-head attention pooling (MAP, "Scaling Vision Transformers", Zhai et al. 2021): a learnt query (`latent`)
    attends to the tokens, and an MLP with its residual follows: SigLIP's head, in timm's AttentionPoolLatent names."""

    def __init__(self, dim: int, num_heads: int, mlp_ratio: float, norm_eps: float, act_layer: str):
        super().__init__()
        self.num_heads = num_heads
        self.latent = nn.Parameter(torch.zeros(1, 1, dim))
        self.q = nn.Linear(dim, dim)
        self.kv = nn.Linear(dim, 2 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm = nn.LayerNorm(dim, eps=norm_eps)
        self.mlp = Mlp(dim, int(dim * mlp_ratio), act_layer=act_layer)

    def forward(self, x: torch.Tensor, rows: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Tokens [B, N, D] -> the pooled vector [B, D]; with `rows` also the query's attention probabilities
        [B, heads, 1, N] (computed beside the fused kernel, as Attention's query rows are)."""
        B, N, D = x.shape
        q = self.q(self.latent).reshape(1, 1, self.num_heads, -1).transpose(1, 2).expand(B, -1, -1, -1)
        k, v = self.kv(x).reshape(B, N, 2, self.num_heads, -1).permute(2, 0, 3, 1, 4).unbind(0)
        y = self.proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(B, 1, D))
        y = (y + self.mlp(self.norm(y)))[:, 0]
        if not rows:
            return y
        return y, ((q * q.shape[-1] ** -0.5) @ k.transpose(-2, -1)).softmax(dim=-1)


class VisionTransformer(nn.Module):
    """ViT / DeiT classifier; `distilled=True` adds DeiT's distillation token and second head, and with
    `dist_head=False` the token alone: the classifier reads [CLS] only (transformers' DeiTForImageClassification,
    what fine-tuning a DeiT there gives). `num_classes=0` has no classifier: an embedding model, whose embedding is
    `pool`'s. `norm_eps` is every LayerNorm's (timm 1e-6, transformers 1e-12).

    `init_values`: a LayerScale (`ls1`, `ls2`: timm's `gamma`) on each block's two branches. `reg_tokens`: that many
    register tokens (`reg_token` [1, R, D]) after [CLS] (and the distillation token), without a position embedding, as
    DINOv2 and transformers place them; the position embedding covers [CLS] (and dist) and the patches.
    `global_pool` (the embedding): "token" ([CLS]), "avg" (the mean of the patch tokens, registers left out),
    "token_avg" ([CLS] concatenated with that mean) or "pooler" (transformers' ViT and DeiT pooler, a Linear and a tanh
    on [CLS]: `pooler`). `pre_norm`: a LayerNorm (`norm_pre`) on the embedded tokens and, as in timm, no bias in the
    patch projection. `act_layer`: the MLP's, "gelu" or "quick_gelu". `proj_dim`: a Linear without bias (`proj`) from
    the pooled feature to that size. `class_token=False`: no [CLS] (the position embedding covers the patches alone),
    for an embedding model pooled by `global_pool="map"` (`attn_pool`), whose query's attention is its maps' row."""

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
        init_values: float | None = None,
        reg_tokens: int = 0,
        global_pool: str = "token",
        pre_norm: bool = False,
        act_layer: str = "gelu",
        proj_dim: int = 0,
        class_token: bool = True,
        drop_rate: float = 0.0,
        attn_drop_rate: float = 0.0,
        drop_path_rate: float = 0.0,
    ):
        super().__init__()
        self.num_classes = num_classes
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.distilled = distilled
        if global_pool not in POOLINGS:
            raise ValueError(f"global_pool {global_pool!r}: {', '.join(POOLINGS)} are built")
        self.global_pool = global_pool
        if not class_token and (global_pool != "map" or distilled or num_classes):
            raise ValueError("a model without [CLS] is an embedding model pooled by global_pool='map'")
        # [CLS] (and dist): the tokens with a position embedding
        self.num_class_tokens = (2 if distilled else 1) if class_token else 0
        self.num_prefix_tokens = self.num_class_tokens + reg_tokens
        # When set (and training), the distilled model returns both heads' logits for the distillation loss.
        self.distilled_training = False

        self.patch_embed = PatchEmbed(img_size, patch_size, in_chans, embed_dim, bias=not pre_norm)
        num_tokens = self.patch_embed.num_patches + self.num_class_tokens
        self.cls_token = nn.Parameter(torch.zeros(1, 1, embed_dim)) if class_token else None
        self.pos_embed = nn.Parameter(torch.zeros(1, num_tokens, embed_dim))
        self.dist_token = nn.Parameter(torch.zeros(1, 1, embed_dim)) if distilled else None
        self.reg_token = nn.Parameter(torch.zeros(1, reg_tokens, embed_dim)) if reg_tokens else None
        self.pos_drop = nn.Dropout(drop_rate)
        self.norm_pre = nn.LayerNorm(embed_dim, eps=norm_eps) if pre_norm else nn.Identity()
        rates = [drop_path_rate * i / max(depth - 1, 1) for i in range(depth)]  # stochastic depth grows with depth
        self.blocks = nn.Sequential(*[
            Block(embed_dim, num_heads, mlp_ratio, qkv_bias, drop_rate, attn_drop_rate, rates[i], norm_eps,
                  init_values=init_values, act_layer=act_layer)
            for i in range(depth)
        ])
        self.norm = nn.LayerNorm(embed_dim, eps=norm_eps)
        self.head_drop = nn.Dropout(drop_rate)
        # num_classes 0: no classifier, an embedding model (timm's convention), its output `pool`'s
        self.head = nn.Linear(embed_dim, num_classes) if num_classes else nn.Identity()
        self.head_dist = nn.Linear(embed_dim, num_classes) if distilled and dist_head and num_classes else None
        self.pool_dist = distilled and dist_head  # the embedding averages both tokens, as the two heads do
        pooled = 2 * embed_dim if global_pool == "token_avg" else embed_dim
        self.pooler = nn.Sequential(nn.Linear(embed_dim, embed_dim), nn.Tanh()) if global_pool == "pooler" else None
        self.attn_pool = AttentionPool(embed_dim, num_heads, mlp_ratio, norm_eps, act_layer) \
            if global_pool == "map" else None
        self.proj = nn.Linear(pooled, proj_dim, bias=False) if proj_dim else nn.Identity()
        self._init_weights()

    def _init_weights(self) -> None:
        latent = self.attn_pool.latent if self.attn_pool is not None else None
        for p in (self.pos_embed, self.cls_token, self.dist_token, self.reg_token, latent):
            if p is not None:
                nn.init.trunc_normal_(p, std=0.02)
        self.apply(init_weights)

    def no_weight_decay(self) -> set[str]:
        return {"pos_embed", "cls_token", "dist_token", "reg_token"}

    def reset_classifier(self, num_classes: int) -> None:
        self.num_classes = num_classes
        self.head = nn.Linear(self.embed_dim, num_classes)
        init_weights(self.head)
        if self.head_dist is not None:
            self.head_dist = nn.Linear(self.embed_dim, num_classes)
            init_weights(self.head_dist)

    def _embed(self, x: torch.Tensor) -> torch.Tensor:
        """[B, 3, H, W] -> tokens [B, prefix + patches, D] with position embeddings; [CLS] (and dist) first, then
        the registers (which have none), then the patches."""
        x = self.patch_embed(x)
        prefix = [t for t in (self.cls_token, self.dist_token) if t is not None]
        x = self.pos_drop(torch.cat([t.expand(x.shape[0], -1, -1) for t in prefix] + [x], dim=1) + self.pos_embed)
        if self.reg_token is not None:
            n = self.num_class_tokens
            x = torch.cat([x[:, :n], self.reg_token.expand(x.shape[0], -1, -1), x[:, n:]], dim=1)
        return self.norm_pre(x)

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        """[B, 3, H, W] -> normalised tokens [B, prefix + patches, D]."""
        return self.norm(self.blocks(self._embed(x)))

    def pool(self, x: torch.Tensor) -> torch.Tensor:
        """Normalised tokens -> the embedding, by `global_pool`: for "token" timm's pre-logits feature, the [CLS]
        token, or for a DeiT with both heads the mean of [CLS] and the distillation token (what the two averaged
        heads read); then `proj` where there is one."""
        if self.global_pool == "token_avg":
            feature = torch.cat([x[:, 0], row_mean(x[:, self.num_prefix_tokens:])], dim=-1)
        elif self.global_pool == "avg":
            feature = row_mean(x[:, self.num_prefix_tokens:])
        elif self.global_pool == "pooler":
            feature = self.pooler(x[:, 0])
        elif self.global_pool == "map":
            feature = self.attn_pool(x)
        else:
            feature = (x[:, 0] + x[:, 1]) / 2 if self.pool_dist else x[:, 0]
        return self.proj(feature)

    @property
    def embedding_pooling(self) -> str:
        """What `pool` makes the embedding of (the manifest's embedding.pooling)."""
        if self.global_pool == "token_avg":
            pooling = "final-norm [CLS] token and the mean of the final-norm patch tokens, concatenated"
        elif self.global_pool == "avg":
            pooling = "mean of the final-norm patch tokens"
        elif self.global_pool == "pooler":
            pooling = "the pooler (a linear map and tanh) on the final-norm [CLS] token"
        elif self.global_pool == "map":
            pooling = "attention pooling of the final-norm tokens (a learnt query, then an MLP: SigLIP's head)"
        elif self.pool_dist:
            pooling = "mean of the final-norm [CLS] and distillation tokens"
        else:
            pooling = "final-norm [CLS] token"
        return f"{pooling}, projected (a linear map without bias)" if isinstance(self.proj, nn.Linear) else pooling

    def forward_head(self, x: torch.Tensor, pre_logits: bool = False) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """Normalised tokens -> logits, or with `pre_logits` the embedding the classifier reads (`pool`)."""
        if pre_logits:
            return self.pool(x)
        logits = self.head(self.head_drop(x[:, 0]))
        if self.head_dist is None:
            return logits
        logits_dist = self.head_dist(self.head_drop(x[:, 1]))
        if self.distilled_training and self.training:
            return logits, logits_dist
        return (logits + logits_dist) / 2

    def forward(self, x: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        return self.forward_head(self.forward_features(x))

    def features_with_attention(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Normalised tokens (forward_features) and the last block's attention rows of [CLS] (and the distillation
        token) over the patches, [B, heads, 1 or 2, patches]: the class tokens looking at the image (the registers'
        rows and columns left out). Without [CLS], the row of attention pooling's query (AttentionPool)."""
        if not self.num_class_tokens:
            x = self.forward_features(x)
            return x, self.attn_pool(x, rows=True)[1]
        x, rows = self.blocks[-1](self.blocks[:-1](self._embed(x)), query_rows=self.num_class_tokens)
        return self.norm(x), rows[..., self.num_prefix_tokens:]

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
        out["pos_embed"] = pos = resample_pos_embed(pos, model.patch_embed.grid_size, prefix)
    if model.distilled and prefix == 1 and "cls_token" in out:
        # a ViT's weights start a distilled DeiT: its distillation token, that token's position and its head begin as
        # [CLS]'s (how the embedded shapes-deit was made: docs/attention.md)
        out["dist_token"] = out["cls_token"].clone()
        if pos is not None and pos.ndim == 3:
            out["pos_embed"] = torch.cat([pos[:, :1], pos], dim=1)
        if model.head_dist is not None:
            out.update({f"head_dist.{k}": out[f"head.{k}"].clone() for k in ("weight", "bias") if f"head.{k}" in out})
    return out
