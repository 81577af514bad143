"""Building blocks shared by the ViT/DeiT and Swin model files."""
import torch
from torch import nn


class PatchEmbed(nn.Module):
    """Image to patch tokens, [B, 3, H, W] -> token rows [B, H/p * W/p, D]: the grid in row-major order, or each
    row the grid position `order` gives (Swin's merge order).

    A conv with kernel = stride = patch size is a linear projection of each non-overlapping patch.
    """

    def __init__(self, img_size: int, patch_size: int, in_chans: int, embed_dim: int, norm: bool = False,
                 order: torch.Tensor | None = None, bias: bool = True):
        super().__init__()
        if img_size % patch_size:
            raise ValueError(f"image size {img_size} is not a multiple of the patch size {patch_size}")
        self.grid_size = (img_size // patch_size, img_size // patch_size)
        self.num_patches = self.grid_size[0] * self.grid_size[1]
        self.proj = nn.Conv2d(in_chans, embed_dim, kernel_size=patch_size, stride=patch_size, bias=bias)
        self.norm = nn.LayerNorm(embed_dim) if norm else nn.Identity()
        self.register_buffer("order", order, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.proj(x).flatten(2).transpose(1, 2)
        return self.norm(x if self.order is None else x.index_select(1, self.order))


class QuickGELU(nn.Module):
    """x * sigmoid(1.702 x): OpenAI CLIP's approximation of GELU, which its weights were trained with."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.sigmoid(1.702 * x)


class TanhGELU(nn.GELU):
    """GELU's tanh approximation (transformers' gelu_pytorch_tanh), which SigLIP's weights were trained with."""

    def __init__(self):
        super().__init__(approximate="tanh")


ACTIVATIONS = {"gelu": nn.GELU, "quick_gelu": QuickGELU, "gelu_tanh": TanhGELU}  # timm's names (act_layer)


class Mlp(nn.Module):
    """Transformer feed-forward: Linear -> GELU (erf, or `act_layer` by its name in ACTIVATIONS) -> Linear."""

    def __init__(self, dim: int, hidden_dim: int, drop: float = 0.0, act_layer: str = "gelu"):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden_dim)
        self.act = ACTIVATIONS[act_layer]()
        self.fc2 = nn.Linear(hidden_dim, dim)
        self.drop = nn.Dropout(drop)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.fc2(self.drop(self.act(self.fc1(x)))))


class LayerScale(nn.Module):
    """A learned per-channel scale of a residual branch (CaiT's, DINOv2's), timm's: its `gamma`."""

    def __init__(self, dim: int, init_values: float):
        super().__init__()
        self.gamma = nn.Parameter(torch.full((dim,), float(init_values)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gamma


class DropPath(nn.Module):
    """Stochastic depth: drop a sample's whole residual branch with probability p while training."""

    def __init__(self, p: float = 0.0):
        super().__init__()
        self.p = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.p == 0.0 or not self.training:
            return x
        keep = 1.0 - self.p
        mask = x.new_empty((x.shape[0],) + (1,) * (x.ndim - 1)).bernoulli_(keep)
        return x * mask / keep


def row_mean(x: torch.Tensor) -> torch.Tensor:
    """The mean over the second-last axis, [..., N, D] -> [..., D], as a product with a constant 1/N row.

    Exported to ONNX it is a MatMul, which ONNX Runtime's CUDA provider runs as one GEMM; a ReduceMean over a
    middle axis takes its generic cuDNN path instead (Swin-T fp16 on an H100: ReduceMean 17% of the time).
    """
    n = x.shape[-2]
    return (x.new_full((1, n), 1 / n) @ x).squeeze(-2)


def init_weights(module: nn.Module) -> None:
    """timm's default ViT/Swin init: truncated normal (std 0.02) linear weights, zero biases."""
    if isinstance(module, nn.Linear):
        nn.init.trunc_normal_(module.weight, std=0.02)
        if module.bias is not None:
            nn.init.zeros_(module.bias)
