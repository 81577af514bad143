"""Swin Transformer: "Hierarchical Vision Transformer using Shifted Windows", Liu et al. 2021,
https://arxiv.org/abs/2103.14030

Tokens live on a 2-D grid ([B, H, W, C], channels last). Each block attends only inside non-overlapping
M x M windows, with a learned relative position bias added to the attention scores; every second block
shifts the windows by M/2 with a cyclic roll and masks attention between tokens that the roll brought
together from opposite edges. Between stages, patch merging concatenates each 2 x 2 neighbourhood (4C)
and projects it to 2C, halving the grid. The classifier averages the last stage's tokens.

The residual stream is kept as token rows [B, H*W, C]: each residual sum that feeds a LayerNorm is then the
[batch, sequence, hidden] pattern ONNX Runtime fuses into one kernel (export/fusion.py). The rows are in merge
order (`merge_order`), each 2 x 2 neighbourhood four consecutive rows, so that patch merging is a reshape; only
the last stage's are row-major. The windows (shift and padding included) never exist as tokens: the attention
gathers its q, k and v per window and head straight from the rows' packed projection, and the heads' outputs
straight back into rows (`WindowAttention`), whatever the rows' order.

Parameter names and shapes are timm's (`layers.N.downsample` at the start of a stage, `head.fc`);
`checkpoint_filter_fn` also reads the official release layout (downsample at the end of a stage, `head`,
and the `relative_position_index` / `attn_mask` buffers saved in the file).
"""
import re

import torch
import torch.nn.functional as F
from torch import nn

from .layers import DropPath, Mlp, PatchEmbed, init_weights, row_mean

MASKED = -100.0  # the original implementation's additive mask value; exp(-100) is 0 in float32 softmax


def window_partition(x: torch.Tensor, window: int) -> torch.Tensor:
    """[B, H, W, C] -> [B * windows, window * window, C], windows in row-major order."""
    B, H, W, C = x.shape
    x = x.view(B, H // window, window, W // window, window, C).permute(0, 1, 3, 2, 4, 5)
    return x.reshape(-1, window * window, C)


def relative_position_index(window: int) -> torch.Tensor:
    """[M*M, M*M] index into the (2M-1)^2-row bias table for every (query, key) pair in a window."""
    coords = torch.stack(torch.meshgrid(torch.arange(window), torch.arange(window), indexing="ij")).flatten(1)
    rel = (coords[:, :, None] - coords[:, None, :]).permute(1, 2, 0) + (window - 1)  # shift to start at 0
    return rel[..., 0] * (2 * window - 1) + rel[..., 1]


def grid_rows(order: torch.Tensor) -> torch.Tensor:
    """The inverse of a token order: for each grid position (row-major), its row."""
    rows = torch.empty_like(order)
    rows[order] = torch.arange(len(order))
    return rows


def merge_order(height: int, width: int, merges: int) -> torch.Tensor:
    """[H*W]: the grid position (row-major) of each token row, in an order where every 2 x 2 neighbourhood that
    the next patch merging concatenates is four consecutive rows, in the original's order (0,0), (1,0), (0,1),
    (1,1) as (row, col), and the merged grid again in this order, for `merges` mergings (H and W divisible by
    2**merges). The merging is then a reshape, and the residual sum before it meets its LayerNorm directly.
    No merging: row-major."""
    if merges == 0:
        return torch.arange(height * width)
    coarse = merge_order(height // 2, width // 2, merges - 1)
    row, col = (coarse // (width // 2)).view(-1, 1), (coarse % (width // 2)).view(-1, 1)
    return ((2 * row + torch.tensor([0, 1, 0, 1])) * width + 2 * col + torch.tensor([0, 0, 1, 1])).flatten()


def stage_orders(grids: list[tuple[int, int]]) -> list[torch.Tensor]:
    """Each stage's token order: the merge order over the mergings that follow it without padding (an odd grid
    is padded to even); the last stage's is row-major."""
    merges = [0]
    for height, width in reversed(grids[:-1]):
        merges.insert(0, 0 if height % 2 or width % 2 else merges[0] + 1)
    return [merge_order(h, w, m) for (h, w), m in zip(grids, merges)]


def merge_rows(resolution: tuple[int, int], order_in: torch.Tensor, order_out: torch.Tensor) -> torch.Tensor:
    """[H'*W' * 4]: for each token of the halved grid (rows in `order_out`), the rows (in `order_in`) of its 2 x 2
    neighbourhood, in the original's order; H*W, an extra zero row, where the grid is padded to even."""
    height, width = resolution
    grid = torch.full((height + height % 2, width + width % 2), height * width)
    grid[:height, :width] = grid_rows(order_in).view(height, width)
    neighbours = grid.view(grid.shape[0] // 2, 2, grid.shape[1] // 2, 2).permute(0, 2, 3, 1).reshape(-1, 4)
    return neighbours[order_out].flatten()


def window_order(height: int, width: int, window: int, shift: int,
                 order: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Where the cyclic shift, the padding and the window partition put each token, as two index lists: for each
    window position (windows in row-major order, M*M tokens each) the row it reads in a [B, H*W (+1), C] token
    list whose rows are the grid positions `order`, padding reading the extra zero row H*W; and for each row,
    the window position it ends up at.
    """
    padded = (-(-height // window) * window, -(-width // window) * window)
    rows = grid_rows(order).view(1, height, width, 1)
    if shift:
        rows = torch.roll(rows, shifts=(-shift, -shift), dims=(1, 2))
    rows = F.pad(rows, (0, 0, 0, padded[1] - width, 0, padded[0] - height), value=height * width)
    to_windows = window_partition(rows, window).flatten()
    to_rows = torch.empty(height * width + 1, dtype=torch.long)  # the last slot takes the padding's positions
    to_rows[to_windows] = torch.arange(len(to_windows))
    return to_windows, to_rows[:-1]


def head_rows(to_windows: torch.Tensor, heads: int, window: int) -> torch.Tensor:
    """[3, windows * heads * M*M]: for q, k and v, the row each (window, head, window position) reads when the
    packed projection of the token rows [B, T, 3 * heads * d] is viewed as [B, T * 3 * heads, d]."""
    tokens = to_windows.view(-1, 1, window * window)
    part, head = torch.arange(3).view(3, 1, 1, 1), torch.arange(heads).view(1, 1, heads, 1)
    return ((tokens * 3 + part) * heads + head).flatten(1)


def token_rows(to_rows: torch.Tensor, heads: int, window: int) -> torch.Tensor:
    """[H*W * heads]: for each token row and head, the row it reads in the heads' outputs [B, windows, heads,
    M*M, d] viewed as [B, windows * heads * M*M, d] (so that [B, H*W, heads * d] comes out)."""
    n = window * window
    position, head = to_rows.view(-1, 1), torch.arange(heads).view(1, heads)
    return ((position // n * heads + head) * n + position % n).flatten()


def shifted_window_mask(height: int, width: int, window: int, shift: int) -> torch.Tensor:
    """[windows, M*M, M*M] additive mask: 0 where two tokens came from the same region before the roll."""
    region = torch.zeros(1, height, width, 1)
    bounds = (slice(0, -window), slice(-window, -shift), slice(-shift, None))
    for i, (h, w) in enumerate((h, w) for h in bounds for w in bounds):
        region[:, h, w, :] = i
    region = window_partition(region, window).squeeze(-1)  # [windows, M*M]
    same = region[:, None, :] == region[:, :, None]
    return torch.zeros(same.shape).masked_fill(~same, MASKED)


class WindowAttention(nn.Module):
    """Multi-head self-attention inside the (shifted) windows of an H x W token grid, with a relative position
    bias per head, on token rows [B, H*W, C] whose grid positions are `order`.

    The windows never exist as tokens: q, k and v are each one Gather (`head_rows`) from the packed projection
    of the token rows, straight into [windows, heads, M*M, d] with the shift and padding, and the heads' outputs
    one Gather (`token_rows`) back into token rows. The window partition, the q/k/v transpose and split and the
    heads' transpose back were five passes over the activations in the exported graph; these are two.
    """

    def __init__(self, dim: int, num_heads: int, window: int, resolution: tuple[int, int], shift: int,
                 order: torch.Tensor, qkv_bias: bool = True, attn_drop: float = 0.0, proj_drop: float = 0.0):
        super().__init__()
        self.num_heads = num_heads
        self.window = window
        self.shift = shift
        self.order = order  # the geometry (window, resolution, shift, order) builds variants (export's)
        self.attn_drop = attn_drop
        self.relative_position_bias_table = nn.Parameter(torch.zeros((2 * window - 1) ** 2, num_heads))
        self.register_buffer("relative_position_index", relative_position_index(window), persistent=False)
        self.qkv = nn.Linear(dim, dim * 3, bias=qkv_bias)
        self.proj = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(proj_drop)
        nn.init.trunc_normal_(self.relative_position_bias_table, std=0.02)
        padded = [-(-r // window) * window for r in resolution]  # a grid not divisible by M is padded
        self.padded = padded != list(resolution)
        self.resolution = resolution
        mask = shifted_window_mask(padded[0], padded[1], window, shift) if shift else None
        self.register_buffer("attn_mask", mask, persistent=False)
        to_windows, to_rows = window_order(*resolution, window, shift, order)
        for name, index in zip(("q_rows", "k_rows", "v_rows"), head_rows(to_windows, num_heads, window)):
            self.register_buffer(name, index, persistent=False)  # each its own constant in the graph
        self.register_buffer("token_rows", token_rows(to_rows, num_heads, window), persistent=False)

    def relative_position_bias(self) -> torch.Tensor:
        """[heads, M*M, M*M]"""
        n = self.window * self.window
        bias = self.relative_position_bias_table[self.relative_position_index.view(-1)].view(n, n, -1)
        return bias.permute(2, 0, 1)

    def heads(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Token rows [B, H*W, C] -> q, k and v of every window and head, each [B, windows * heads * M*M, d]."""
        B, _, C = x.shape
        if self.padded:
            x = F.pad(x, (0, 0, 0, 1))  # the zero token that padding reads, projected as the original's are
        rows = self.qkv(x).view(B, -1, C // self.num_heads)
        return tuple(rows.index_select(1, index) for index in (self.q_rows, self.k_rows, self.v_rows))

    def forward(self, x: torch.Tensor, received: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Token rows [B, H*W, C] -> the same, attended and projected.

        With `received`, also returns the attention each token receives, averaged over its window's queries,
        [B, H*W, heads] (rows as x's), computed beside the fused kernel.
        """
        B, L, C = x.shape
        heads, n, d = self.num_heads, self.window * self.window, C // self.num_heads
        bias = self.relative_position_bias().unsqueeze(0)  # [1, heads, N, N]
        if self.attn_mask is None:
            shape = (-1, heads, n, d)
        else:
            # Windows folded into the head axis, [B, windows * heads, N, N]: the per-window mask then broadcasts
            # over the batch as one constant instead of being expanded to a [B * windows, heads, N, N] copy
            # and added in every block at run time.
            windows = self.attn_mask.shape[0]
            bias = (bias + self.attn_mask.unsqueeze(1)).reshape(1, windows * heads, n, n)
            shape = (-1, windows * heads, n, d)
        q, k, v = (t.view(shape) for t in self.heads(x))
        dropout = self.attn_drop if self.training else 0.0
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, dropout_p=dropout)
        out = self.proj_drop(self.proj(out.reshape(B, -1, d).index_select(1, self.token_rows).view(B, L, C)))
        if not received:
            return out
        probs = ((q * d ** -0.5) @ k.transpose(-2, -1) + bias).softmax(dim=-1)
        got = row_mean(probs).reshape(B, -1).index_select(1, self.token_rows)
        return out, got.view(B, L, heads)


class SwinTransformerBlock(nn.Module):
    """(Shifted) window attention and MLP, each pre-norm with a residual, on the token rows of an H x W grid
    (grid positions `order`)."""

    def __init__(self, dim: int, resolution: tuple[int, int], order: torch.Tensor, num_heads: int, window: int,
                 shift: int, mlp_ratio: float = 4.0, qkv_bias: bool = True, drop: float = 0.0, attn_drop: float = 0.0,
                 drop_path: float = 0.0):
        super().__init__()
        # A stage no larger than the window is one window, and shifting it would change nothing.
        if min(resolution) <= window:
            window, shift = min(resolution), 0
        self.window = window
        self.norm1 = nn.LayerNorm(dim)
        self.attn = WindowAttention(dim, num_heads, window, resolution, shift, order, qkv_bias, attn_drop, drop)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = Mlp(dim, int(dim * mlp_ratio), drop=drop)
        self.drop_path = DropPath(drop_path)

    def forward(self, x: torch.Tensor, received: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Token rows [B, H*W, C] -> the same. With `received`, also returns the attention each token receives in
        its window, [B, H*W, heads]."""
        attn = self.attn(self.norm1(x), received)
        attn, got = attn if received else (attn, None)
        x = x + self.drop_path(attn)
        x = x + self.drop_path(self.mlp(self.norm2(x)))
        return (x, got) if received else x


class PatchMerging(nn.Module):
    """Token rows of an H x W grid [B, H*W, C] -> of the H/2 x W/2 grid [B, H*W/4, 2C]: concatenate each 2 x 2
    neighbourhood, LayerNorm, project. The rows before are in `order_in`, after in `order_out` (grid positions).

    An even grid's rows arrive in merge order (`merge_order`), each neighbourhood four consecutive rows: the
    merging is a reshape, where [B, H, W, C] grids took a transpose. An odd grid is padded with zero tokens and
    its neighbourhoods gathered (`merge_rows`).
    """

    def __init__(self, dim: int, resolution: tuple[int, int], order_in: torch.Tensor, order_out: torch.Tensor):
        super().__init__()
        self.norm = nn.LayerNorm(4 * dim)
        self.reduction = nn.Linear(4 * dim, 2 * dim, bias=False)
        padded = resolution[0] % 2 or resolution[1] % 2
        rows = merge_rows(resolution, order_in, order_out) if padded else None
        self.register_buffer("rows", rows, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, _, C = x.shape
        if self.rows is not None:
            x = F.pad(x, (0, 0, 0, 1)).index_select(1, self.rows)  # padding reads the zero row
        return self.reduction(self.norm(x.reshape(B, -1, 4 * C)))


class SwinTransformerStage(nn.Module):
    """Optional patch merging (from the previous stage's grid and order, `merged_from`), then `depth` blocks
    alternating regular and shifted windows, on token rows of an H x W grid whose positions are `order`."""

    def __init__(self, dim: int, resolution: tuple[int, int], order: torch.Tensor, depth: int, num_heads: int,
                 window: int, merged_from: tuple[tuple[int, int], torch.Tensor] | None, mlp_ratio: float,
                 qkv_bias: bool, drop: float, attn_drop: float, drop_path: list[float]):
        super().__init__()
        self.downsample = PatchMerging(dim // 2, *merged_from, order) if merged_from else nn.Identity()
        self.resolution = resolution
        self.blocks = nn.Sequential(*[
            SwinTransformerBlock(dim, resolution, order, num_heads, window, shift=0 if i % 2 == 0 else window // 2,
                                 mlp_ratio=mlp_ratio, qkv_bias=qkv_bias, drop=drop, attn_drop=attn_drop,
                                 drop_path=drop_path[i])
            for i in range(depth)
        ])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Token rows of the previous stage (or the patch embedding) -> this stage's."""
        return self.blocks(self.downsample(x))


class ClassifierHead(nn.Module):
    """Global average pool over the token grid, then a linear classifier (`head.fc`, as in timm)."""

    def __init__(self, in_features: int, num_classes: int, drop: float = 0.0):
        super().__init__()
        self.drop = nn.Dropout(drop)
        self.fc = nn.Linear(in_features, num_classes) if num_classes else nn.Identity()  # 0: an embedding model

    def forward(self, x: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        """[B, H, W, C] or token rows [B, H*W, C] -> logits, or with `pre_logits` the pooled tokens (the embedding,
        timm's pre-logits feature)."""
        pooled = row_mean(x.flatten(1, -2))
        return pooled if pre_logits else self.fc(self.drop(pooled))


class SwinTransformer(nn.Module):
    def __init__(
        self,
        img_size: int = 224,
        patch_size: int = 4,
        in_chans: int = 3,
        num_classes: int = 1000,
        embed_dim: int = 96,
        depths: tuple[int, ...] = (2, 2, 6, 2),
        num_heads: tuple[int, ...] = (3, 6, 12, 24),
        window_size: int = 7,
        mlp_ratio: float = 4.0,
        qkv_bias: bool = True,
        drop_rate: float = 0.0,
        attn_drop_rate: float = 0.0,
        drop_path_rate: float = 0.0,
    ):
        super().__init__()
        self.num_classes = num_classes
        self.window_size = window_size
        grids = [(img_size // patch_size,) * 2]
        for _ in depths[1:]:
            grids.append(((grids[-1][0] + 1) // 2, (grids[-1][1] + 1) // 2))
        orders = stage_orders(grids)
        self.patch_embed = PatchEmbed(img_size, patch_size, in_chans, embed_dim, norm=True, order=orders[0])
        rates = [drop_path_rate * i / max(sum(depths) - 1, 1) for i in range(sum(depths))]
        self.layers = nn.Sequential(*[
            SwinTransformerStage(
                embed_dim * 2**i, grids[i], orders[i], depth, num_heads[i], window_size,
                merged_from=(grids[i - 1], orders[i - 1]) if i else None, mlp_ratio=mlp_ratio, qkv_bias=qkv_bias,
                drop=drop_rate, attn_drop=attn_drop_rate, drop_path=rates[sum(depths[:i]):sum(depths[:i + 1])])
            for i, depth in enumerate(depths)])
        self.num_features = embed_dim * 2 ** (len(depths) - 1)
        self.norm = nn.LayerNorm(self.num_features)
        self.head = ClassifierHead(self.num_features, num_classes, drop_rate)
        self.apply(init_weights)

    def no_weight_decay(self) -> set[str]:
        return {n for n, _ in self.named_parameters() if "relative_position_bias_table" in n}

    def reset_classifier(self, num_classes: int) -> None:
        self.num_classes = num_classes
        self.head.fc = nn.Linear(self.num_features, num_classes)
        init_weights(self.head.fc)

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        """[B, 3, H, W] -> normalised last-stage tokens [B, H/32, W/32, C] (the last stage's rows are row-major)."""
        x = self.norm(self.layers(self.patch_embed(x)))
        return x.view(x.shape[0], *self.layers[-1].resolution, -1)

    embedding_pooling = "mean of the final-norm last-stage tokens"  # (the manifest's embedding.pooling)

    def forward_head(self, x: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        """Normalised tokens -> logits, or with `pre_logits` the embedding: their mean (ClassifierHead)."""
        return self.head(x, pre_logits)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.forward_features(x))

    def features_with_attention(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Normalised last-stage token rows [B, H*W, C] and, from the last block, the attention each last-stage
        token receives averaged over the queries of its window, [B, heads, H*W] (row-major grid).

        Swin has no [CLS] token; the classifier averages the last stage's tokens, and in standard configs
        that stage is a single window, so this is how much the average query attends to each token.
        """
        last = self.layers[-1]
        x = last.blocks[:-1](last.downsample(self.layers[:-1](self.patch_embed(x))))
        x, received = last.blocks[-1](x, received=True)
        return self.norm(x), received.transpose(1, 2)


def resize_relative_position_bias(table: torch.Tensor, new: int) -> torch.Tensor:
    """Resize a [(2M-1)^2, heads] bias table to [new^2, heads] (bicubic over its (2M-1) x (2M-1) grid)."""
    old = round(table.shape[0] ** 0.5)
    grid = table.float().T.reshape(1, -1, old, old)
    grid = F.interpolate(grid, size=(new, new), mode="bicubic", align_corners=False)
    return grid.reshape(-1, new * new).T.contiguous().to(table.dtype)


def checkpoint_filter_fn(state_dict: dict[str, torch.Tensor], model: SwinTransformer) -> dict[str, torch.Tensor]:
    """Adapt a timm or official-release Swin state dict to `model`.

    The official release puts `downsample` at the end of a stage (timm: start of the next), names the
    classifier `head` (timm: `head.fc`) and saves the `relative_position_index` / `attn_mask` buffers, which
    are recomputed here. Bias tables of another window size are resized.
    """
    official = "layers.0.downsample.reduction.weight" in state_dict
    params = dict(model.named_parameters())
    out = {}
    for k, v in state_dict.items():
        if k.endswith(("relative_position_index", "attn_mask")):
            continue
        if official:
            k = re.sub(r"^layers\.(\d+)\.downsample", lambda m: f"layers.{int(m.group(1)) + 1}.downsample", k)
            k = re.sub(r"^head\.", "head.fc.", k)
        if k.endswith("relative_position_bias_table") and k in params and v.shape != params[k].shape:
            v = resize_relative_position_bias(v, round(params[k].shape[0] ** 0.5))
        out[k] = v
    return out
