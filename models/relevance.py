"""Class-specific relevance: which patches made the model give a label, computed with forward operations only.

A map of raw attention (the last block's [CLS] row, or rollout) is the same whatever label is asked about. These
depend on the label, through the gradient of its logit. No exporter exports a backward pass (torch.onnx cannot,
torch.export of autograd.grad fails on softmax and matmul with a dynamic batch, ONNX's Gradient op has no runtime),
so the backward is written out here as forward operations, exported like everything else, and proven equal to
autograd in tests/test_relevance.py.

The target is one weight vector over the classes per image, t: the scalar explained is sum_c t_c logit_c (a one-hot t
is one label). A row of zeros asks for the image's own top label.

  ViT / DeiT (`vit_relevance`): Chefer, Gur and Wolf, "Generic Attention-model Explainability for Interpreting
    Bi-Modal and Encoder-Decoder Transformers", ICCV 2021, https://arxiv.org/abs/2103.15679 (its rule for
    self-attention). R = I; at each block, A_bar = mean over heads of max(dA * A, 0), dA the gradient of the target
    with respect to the block's attention probabilities A; R += A_bar R. The map is R's [CLS] (and distillation
    token) row over the patches. Only those rows are wanted, so R is never formed: the rows are carried from the
    last block down, r += r A_bar, O(N^2) a block where R costs O(N^3).
  Swin (`swin_gradcam`): Grad-CAM (Selvaraju et al. 2017, https://arxiv.org/abs/1610.02391) on the final-norm
    last-stage tokens, pytorch-grad-cam's recipe for transformers (a layer's tokens reshaped to their grid). Chefer's
    rule follows a [CLS] token's row through the layers; Swin has none, its windows see only part of the grid, and
    patch merging changes the token count at every stage, so there is no R to carry. Its classifier averages the
    last tokens, so the gradient at each is t W / L and Grad-CAM's channel weights are that: the map is
    max(y_l . W^T t, 0) / L, each token's own share of the explained logit (less the bias), where positive.
  CNNs ending in a class-channel convolution and a global average (`cnn_cam`, mini-Xception): CAM (Zhou et al.
    2016, https://arxiv.org/abs/1512.04150), the target's channels before the pool, sum_c t_c f_c(x, y); the logit is
    their mean. No gradient needed.
"""
import math

import torch
from torch import nn

from .layers import LayerScale, QuickGELU
from .mini_xception import MiniXception
from .swin_transformer import SwinTransformer
from .vision_transformer import Block, VisionTransformer

RULES = {"vit": "chefer2021", "swin": "gradcam", "cnn": "cam"}  # the manifest's relevance.rule, by family


def target_weights(target: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """[B, classes] weights: each row as given, or where it is all zeros, one-hot at the row's top logit."""
    top = torch.zeros_like(logits).scatter(-1, logits.argmax(-1, keepdim=True), 1.0)
    unset = (target.abs().sum(-1, keepdim=True) == 0).to(logits.dtype)
    return target + unset * top


def layer_norm_backward(x: torch.Tensor, norm: nn.LayerNorm, grad: torch.Tensor) -> torch.Tensor:
    """The gradient at the input x of `norm`, given the gradient at its output."""
    mean = x.mean(-1, keepdim=True)
    centred = x - mean
    rstd = torch.rsqrt((centred * centred).mean(-1, keepdim=True) + norm.eps)
    xhat = centred * rstd
    g = grad * norm.weight
    return rstd * (g - g.mean(-1, keepdim=True) - xhat * (g * xhat).mean(-1, keepdim=True))


def activation_slope(act: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """d act(x) / dx: GELU's erf form, Phi(x) + x phi(x), or QuickGELU's, s + 1.702 x s (1 - s) with s its sigmoid."""
    if isinstance(act, QuickGELU):
        s = torch.sigmoid(1.702 * x)
        return s + 1.702 * x * s * (1 - s)
    if getattr(act, "approximate", "none") != "none":
        raise ValueError("the tanh approximation of GELU has no written-out slope here")
    return 0.5 * (1 + torch.erf(x * math.sqrt(0.5))) + x * torch.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)


def _scale(branch: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A residual branch's LayerScale (timm's gamma) applied, where the block has one."""
    return x * branch.gamma if isinstance(branch, LayerScale) else x


class _Saved:
    """What one block's forward keeps for its backward."""

    def __init__(self, x, probs, v, q, k, x1, pre):
        self.x, self.probs, self.v, self.q, self.k, self.x1, self.pre = x, probs, v, q, k, x1, pre


def _block_forward(block: Block, x: torch.Tensor) -> tuple[torch.Tensor, _Saved]:
    """A pre-norm block's forward with its attention probabilities explicit, and what its backward needs."""
    attn = block.attn
    B, N, C = x.shape
    qkv = attn.qkv(block.norm1(x)).reshape(B, N, 3, attn.num_heads, C // attn.num_heads).permute(2, 0, 3, 1, 4)
    q, k, v = qkv.unbind(0)  # [B, heads, N, d]
    probs = ((q * q.shape[-1] ** -0.5) @ k.transpose(-2, -1)).softmax(dim=-1)
    x1 = x + _scale(block.ls1, attn.proj((probs @ v).transpose(1, 2).reshape(B, N, C)))
    pre = block.mlp.fc1(block.norm2(x1))
    out = x1 + _scale(block.ls2, block.mlp.fc2(block.mlp.act(pre)))
    return out, _Saved(x, probs, v, q, k, x1, pre)


def _block_backward(block: Block, s: _Saved, grad: torch.Tensor, to_input: bool
                    ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Given the gradient at the block's output: the gradient at its attention probabilities [B, heads, N, N] and,
    where `to_input`, at its input."""
    attn = block.attn
    B, N, C = grad.shape
    heads, d = attn.num_heads, C // attn.num_heads
    hidden = (_scale(block.ls2, grad) @ block.mlp.fc2.weight) * activation_slope(block.mlp.act, s.pre)
    g1 = grad + layer_norm_backward(s.x1, block.norm2, hidden @ block.mlp.fc1.weight)  # at x1
    g_heads = (_scale(block.ls1, g1) @ attn.proj.weight).reshape(B, N, heads, d).transpose(1, 2)  # at probs @ v
    g_probs = g_heads @ s.v.transpose(-2, -1)
    if not to_input:
        return g_probs, None
    g_scores = s.probs * (g_probs - (g_probs * s.probs).sum(-1, keepdim=True)) * d ** -0.5  # softmax's, the scale
    g_q, g_k, g_v = g_scores @ s.k, g_scores.transpose(-2, -1) @ s.q, s.probs.transpose(-2, -1) @ g_heads
    g_qkv = torch.stack([g_q, g_k, g_v]).permute(1, 3, 0, 2, 4).reshape(B, N, 3 * C)
    return g_probs, g1 + layer_norm_backward(s.x, block.norm1, g_qkv @ attn.qkv.weight)


def vit_relevance(model: VisionTransformer, x: torch.Tensor, target: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Model input [B, 3, H, W] (or the exported form's patches) and targets [B, classes] -> (logits [B, classes],
    relevance [B, class tokens, patches]: the [CLS] row, and the distillation token's for a distilled DeiT)."""
    if not model.num_classes:
        raise ValueError("an embedding model has no classes to explain")
    h = model._embed(x)
    saved = []
    for block in model.blocks:
        h, s = _block_forward(block, h)
        saved.append(s)
    y = model.norm(h)
    two = model.head_dist is not None
    logits = model.head(y[:, 0]) if not two else (model.head(y[:, 0]) + model.head_dist(y[:, 1])) / 2
    t = target_weights(target, logits)
    # the target's gradient at the final-norm tokens: only the tokens the heads read have one
    T = model.num_class_tokens
    read = [t @ model.head.weight / 2, t @ model.head_dist.weight / 2] if two else [t @ model.head.weight]
    g_y = torch.cat([*(g.unsqueeze(1) for g in read), torch.zeros_like(y[:, len(read):])], dim=1)
    grad = layer_norm_backward(h, model.norm, g_y)
    rows = torch.eye(h.shape[1], dtype=h.dtype)[:T].expand(h.shape[0], T, h.shape[1])  # R's rows, R = I
    for i in reversed(range(len(model.blocks))):
        g_probs, grad = _block_backward(model.blocks[i], saved[i], grad, to_input=i > 0)
        a_bar = (g_probs * saved[i].probs).clamp(min=0).mean(dim=1)  # [B, N, N]
        rows = rows + rows @ a_bar
    return logits, rows[:, :, model.num_prefix_tokens:]


def swin_gradcam(model: SwinTransformer, x: torch.Tensor, target: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (logits, relevance [B, 1, H*W] over the last stage's grid, row-major): Grad-CAM on the final-norm tokens."""
    if not model.num_classes:
        raise ValueError("an embedding model has no classes to explain")
    y = model.norm(model.layers(model.patch_embed(x)))  # [B, L, C], the last stage's rows row-major
    logits = model.head(y)
    weights = target_weights(target, logits) @ model.head.fc.weight / y.shape[1]  # the gradient at every token
    return logits, (y @ weights.unsqueeze(-1)).clamp(min=0).transpose(1, 2)


def cnn_cam(model: MiniXception, x: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (logits, relevance [B, 1, h*w] over the class channels' grid): CAM, the target's channels."""
    feature = model.forward_grey((x * model.luma).sum(dim=1, keepdim=True), class_maps=True)  # [B, classes, h, w]
    logits = feature.flatten(2).mean(-1)
    t = target_weights(target, logits)
    return logits, (t.unsqueeze(1) @ feature.flatten(2))


def relevance_of(model: nn.Module) -> tuple[str, tuple[int, int], int] | None:
    """(rule, grid, rows) of a model's relevance map, or None where it has none (an embedding model, another CNN)."""
    if not getattr(model, "num_classes", 0):
        return None
    if isinstance(model, VisionTransformer):
        return RULES["vit"], tuple(model.patch_embed.grid_size), model.num_class_tokens
    if isinstance(model, SwinTransformer):
        return RULES["swin"], tuple(model.layers[-1].resolution), 1
    if isinstance(model, MiniXception):
        return RULES["cnn"], model.class_grid, 1
    return None


def relevance(model: nn.Module, x: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's own rule (relevance_of): (logits [B, classes], relevance [B, rows, grid cells])."""
    if isinstance(model, VisionTransformer):
        return vit_relevance(model, x, target)
    if isinstance(model, SwinTransformer):
        return swin_gradcam(model, x, target)
    return cnn_cam(model, x, target)
