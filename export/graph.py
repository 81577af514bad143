"""ONNX graphs of a model: dynamo export at opset 23 with a dynamic batch axis, and what is in them.

The main graph outputs the logits, what attention maps need, computed beside the fused attention, and the
embedding (`embeddings` [B, D], the pre-logits feature the classifier reads: models' `forward_head(pre_logits=True)`;
a model without a classifier, num_classes 0, outputs it first and no logits):
  ViT/DeiT: `cls_attention` [B, heads, patches], the last block's [CLS] row over the patches (the distilled
            DeiT adds `dist_attention`, the distillation token's row);
  Swin:     `attention` [B, heads, H*W], the attention each last-stage token receives in the last block,
            averaged over its window's queries.
  CNNs:     the logits alone (no attention to show).
The explain graph outputs every block's full attention probabilities (`attention_0` ...) for rollout. The relevance
graph (models/relevance.py) takes `images` and a `target` weight vector over the classes per image (a row of zeros:
the image's top label) and outputs the logits and the class-specific `relevance` [B, rows, grid cells]. A whole
CLIP's text graph takes token ids and outputs the texts' embeddings (TextGraph).

Both take two inputs: `images`, uint8 [B1, H, W, 3] pixels that the graph cuts into patches and normalises with
the model's mean/std itself, the normalisation folded into the patch embedding's weights (so the host sends a
quarter of the bytes and does no float work per pixel), and `pixel_values`, float32 [B2, 3, H, W] already
normalised (for clients that preprocess themselves, the KServe v2 FP32 input). Both are plain graph inputs,
which every run feeds (what session.get_inputs() lists, and what IOBinding binds); either may have batch 0. The
outputs hold B1 + B2 rows, the images' first.
"""
import collections
import copy
import logging
import warnings
from pathlib import Path

import onnx
import onnx_ir as ir
import torch
from torch import nn

from models.layers import PatchEmbed
from models.relevance import relevance
from models.swin_transformer import SwinTransformer, WindowAttention
from models.text_transformer import TextTransformer
from models.vision_transformer import VisionTransformer

OPSET = 23
IMAGES, TENSOR = "images", "pixel_values"
TARGET, RELEVANCE = "target", "relevance"  # the relevance graph's own input and output
INPUT_IDS, TEXT_EMBEDS = "input_ids", "text_embeds"  # a whole CLIP's text graph
EMBEDDINGS = "embeddings"  # the pre-logits feature, un-normalised (the service normalises it where asked)
FUSED_ATTENTION = {"Attention", "com.microsoft:MultiHeadAttention", "com.microsoft:Attention"}


def normalisation(mean: tuple[float, ...], std: tuple[float, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """(x / 255 - mean) / std as one multiply-add, x * scale + shift: the per-channel (scale, shift)."""
    mean, std = torch.tensor(mean), torch.tensor(std)
    return 1 / (255 * std), -mean / std


class ImageInput(nn.Module):
    """uint8 [B1, H, W, 3] images and float [B2, 3, H, W] normalised pixels -> the model's input [B1 + B2, ...]
    (the PyTorch reference's; the exported form takes patches, `PatchInput`)."""

    def __init__(self, mean: tuple[float, ...], std: tuple[float, ...]):
        super().__init__()
        scale, shift = normalisation(mean, std)
        self.register_buffer("scale", scale.view(1, 3, 1, 1))
        self.register_buffer("shift", shift.view(1, 3, 1, 1))

    def forward(self, images: torch.Tensor, pixel_values: torch.Tensor) -> torch.Tensor:
        x = images.permute(0, 3, 1, 2).float() * self.scale + self.shift  # transposed while still 1 byte a pixel
        return torch.cat([x, pixel_values])


class PatchInput(nn.Module):
    """The same two inputs -> the patches of each, each p x p patch's pixels as one row in (row, column, channel)
    order: (the images' bytes as floats [B1, H/p * W/p, p * p * 3], the normalised pixels [B2, ...]), what
    `MatMulPatchEmbed` multiplies (it normalises the images' patches as it does). The patches are in row-major
    grid order, or in the grid positions `order` (Swin's merge order), gathered while the images are still bytes.

    The images are cut into patches straight from NHWC while still 1 byte a pixel: one transpose of the bytes,
    where an NCHW model input costs a transpose of the bytes into NCHW and another of the floats into patches
    (on an H100 the first alone took 8% of DeiT-Ti's fp16 time at batch 256; cut from NHWC, DeiT-Ti ran 1.08x,
    DeiT-S 1.05x)."""

    def __init__(self, patch: int, order: torch.Tensor | None):
        super().__init__()
        self.patch = patch
        self.register_buffer("order", order, persistent=False)

    def forward(self, images: torch.Tensor, pixel_values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        p = self.patch
        b, h, w, c = images.shape
        rows = ((h // p) * (w // p), p * p * c)
        x = images.reshape(b, h // p, p, w // p, p, c).permute(0, 1, 3, 2, 4, 5).reshape(b, *rows)
        y = pixel_values.reshape(-1, c, h // p, p, w // p, p).permute(0, 2, 4, 3, 5, 1).reshape(-1, *rows)
        if self.order is not None:
            x, y = x.index_select(1, self.order), y.index_select(1, self.order)
        return x.float(), y


class MatMulPatchEmbed(nn.Module):
    """PatchEmbed's strided Conv as what it computes, each patch's pixels times one matrix: the form GPU GEMMs
    run fastest (on an H100 the Conv took 36% of DeiT-S's fp16 time, all the network's MatMuls together 27%).
    Takes the two inputs' patches `PatchInput` cuts.

    The images' normalisation, x * scale + shift per channel, comes before a linear map, so it is folded into
    their own copy of the weights: (x * scale + shift) @ W + b = x @ (scale W) + (shift @ W + b). No pass over
    the pixels is left but the cast, and the two inputs meet (concatenated) as embeddings, which for ViT/DeiT
    are narrower than the patches."""

    def __init__(self, embed: PatchEmbed, mean: tuple[float, ...], std: tuple[float, ...]):
        super().__init__()
        conv = embed.proj
        self.patch = conv.kernel_size[0]
        weight = conv.weight.detach().permute(0, 2, 3, 1).flatten(1).t().double()  # rows in the patches' order
        scale, shift = (v.double().repeat(self.patch ** 2) for v in normalisation(mean, std))  # channel fastest
        bias = (conv.bias.detach() if conv.bias is not None else torch.zeros(conv.out_channels)).double()  # CLIP: none

        def frozen(t: torch.Tensor) -> nn.Parameter:
            return nn.Parameter(t.float().contiguous(), requires_grad=False)

        self.weight, self.bias = frozen(weight), frozen(bias)
        self.image_weight, self.image_bias = frozen(scale[:, None] * weight), frozen(shift @ weight + bias)
        self.norm = embed.norm
        self.order = embed.order  # the patches' order, in which `PatchInput` cuts them

    def forward(self, patches: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """(image patches, pixel patches) -> token rows [B1 + B2, H/p * W/p, D], as PatchEmbed."""
        images, pixels = patches
        return self.norm(torch.cat([images @ self.image_weight + self.image_bias, pixels @ self.weight + self.bias]))


class QBiasWindowAttention(WindowAttention):
    """Swin's window attention with only q's share of the packed projection's bias, added to q after its gather:
    a pass over C values a token where the bias Add was one over 3C.

    k's bias adds q . b_k to every score in a query's row, which the softmax cancels; v's adds b_v to every
    output, since each row of probabilities sums to 1, so the output projection's bias takes it: W_o b_v + b_o
    (computed in float64). The padding token stays consistent: its k and v lose the same biases as every other.
    """

    def __init__(self, attn: WindowAttention):
        heads, dim = attn.num_heads, attn.qkv.in_features
        super().__init__(dim, heads, attn.window, attn.resolution, attn.shift, attn.order, qkv_bias=False)
        bias = attn.qkv.bias if attn.qkv.bias is not None else torch.zeros(3 * dim)
        q_bias, _, v_bias = bias.detach().double().chunk(3)
        with torch.no_grad():
            self.relative_position_bias_table.copy_(attn.relative_position_bias_table)
            self.qkv.weight.copy_(attn.qkv.weight)
            self.proj.weight.copy_(attn.proj.weight)
            self.proj.bias.copy_(attn.proj.weight.double() @ v_bias + attn.proj.bias.double())
        self.register_buffer("q_bias", q_bias.float().view(heads, 1, dim // heads), persistent=False)

    def heads(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = super().heads(x)
        B, n, d = q.shape[0], self.window * self.window, q.shape[-1]
        return (q.view(B, -1, self.num_heads, n, d) + self.q_bias).view(B, -1, d), k, v


def has_attention(model: nn.Module) -> bool:
    """A transformer, whose attention the graphs output; not a CNN."""
    return isinstance(model, (VisionTransformer, SwinTransformer))


def export_form(model: nn.Module) -> nn.Module:
    """A copy of the model as it is exported (the patch embedding a MatMul; Swin's attention with q's bias only);
    the original stays the parity gate's reference, so the gate proves the rewrites too. A CNN is exported as
    it is."""
    exported = copy.deepcopy(model)
    if not has_attention(model):
        return exported
    exported.patch_embed = MatMulPatchEmbed(exported.patch_embed, model.spec.mean, model.spec.std)
    if isinstance(exported, SwinTransformer):
        for block in (b for stage in exported.layers for b in stage.blocks):
            block.attn = QBiasWindowAttention(block.attn)
    return exported


def input_module(model: nn.Module) -> nn.Module:
    """The graph's two inputs -> what the model's patch embedding takes: patches for the exported form, NCHW
    pixels for the reference."""
    if isinstance(getattr(model, "patch_embed", None), MatMulPatchEmbed):
        return PatchInput(model.patch_embed.patch, model.patch_embed.order)
    return ImageInput(model.spec.mean, model.spec.std)


def is_embedding_model(model: nn.Module) -> bool:
    """A transformer without a classifier (num_classes 0): its graph outputs the embedding and no logits."""
    return has_attention(model) and not model.num_classes


class MainGraph(nn.Module):
    input_names = [IMAGES, TENSOR]

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model.eval()
        self.input = input_module(model)

    @property
    def output_names(self) -> list[str]:
        if not has_attention(self.model):
            return ["logits"]
        if isinstance(self.model, SwinTransformer):
            attention = ["attention"]
        else:
            attention = ["cls_attention", "dist_attention"] if self.model.distilled else ["cls_attention"]
        return [EMBEDDINGS, *attention] if is_embedding_model(self.model) else ["logits", *attention, EMBEDDINGS]

    def forward(self, images: torch.Tensor, pixel_values: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if not has_attention(self.model):
            return (self.model(self.input(images, pixel_values)),)
        tokens, attention = self.model.features_with_attention(self.input(images, pixel_values))
        attention = [attention] if isinstance(self.model, SwinTransformer) else attention.unbind(dim=2)  # per token
        embedding = self.model.forward_head(tokens, pre_logits=True)
        if is_embedding_model(self.model):
            return embedding, *attention
        return self.model.forward_head(tokens), *attention, embedding


class ExplainGraph(nn.Module):
    input_names = [IMAGES, TENSOR]

    def __init__(self, model: VisionTransformer):
        super().__init__()
        self.model = model.eval()
        self.input = input_module(model)

    @property
    def output_names(self) -> list[str]:
        return [f"attention_{i}" for i in range(len(self.model.blocks))]

    def forward(self, images: torch.Tensor, pixel_values: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(self.model.attention_probabilities(self.input(images, pixel_values)))


class RelevanceGraph(nn.Module):
    """uint8 images [B, H, W, 3] and targets [B, classes] -> (logits, relevance): the model's class-specific map,
    its backward written out as forward operations (models/relevance.py). The images alone, one batch axis: the
    service keeps every map's image as uint8 (AttentionResult.image)."""

    input_names = [IMAGES, TARGET]
    output_names = ["logits", RELEVANCE]

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model.eval()
        self.input = input_module(model)

    def forward(self, images: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        none = torch.zeros(0, 3, images.shape[1], images.shape[2])
        return relevance(self.model, self.input(images, none), target)


class TextGraph(nn.Module):
    """int64 token ids [B, L] (L at most the context length, padded after the end-of-text token) -> the texts'
    embeddings [B, D] (CLIP's text_embeds, not normalised): a whole CLIP's text tower (models.text_transformer)."""

    input_names = [INPUT_IDS]
    output_names = [TEXT_EMBEDS]

    def __init__(self, model: TextTransformer):
        super().__init__()
        self.model = model.eval()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids)


def export_text_graph(module: TextGraph, path: Path) -> onnx.ModelProto:
    """The text graph at `path`, its batch and its token count dynamic (a batch is padded to its longest text)."""
    quiet_exporter()
    tokens = torch.export.Dim("tokens", min=2, max=module.model.context_length)
    example = (torch.full((2, 3), 1, dtype=torch.int64),)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        program = torch.onnx.export(
            module, example, dynamo=True, opset_version=OPSET, input_names=module.input_names,
            output_names=module.output_names, verbose=False,
            dynamic_shapes={INPUT_IDS: {0: torch.export.Dim("batch", min=1, max=4096), 1: tokens}})
    return save_graph(program.model, path)


def quiet_exporter() -> None:
    """The exporter warns about every torchvision op it cannot register; torchvision is not used here."""
    logging.getLogger("torch.onnx._internal.exporter._registration").setLevel(logging.ERROR)


def export_program(module: MainGraph | ExplainGraph | RelevanceGraph, img_size: int, batch: int | None = None
                   ) -> ir.Model:
    """`module` as an ONNX graph in memory, its intermediate shapes in PyTorch's symbols (one name per batch
    expression throughout, which the fusions in `export.fusion` match on).

    `batch`: every shape fixed instead, for that many images and no float pixels, so that no shape arithmetic
    is left in the graph (CUDA graph capture needs every node on the GPU; bench/gpu.py measures it).
    """
    quiet_exporter()
    if isinstance(module, RelevanceGraph):
        classes = module.model.num_classes
        example = (torch.zeros(2, img_size, img_size, 3, dtype=torch.uint8), torch.zeros(2, classes))
        rows = torch.export.Dim("batch", min=1, max=4096)
        batches = {IMAGES: {0: rows}, TARGET: {0: rows}}
    elif batch is None:
        # batch 2 each, so that neither axis is specialised to 0 or 1; the graph runs with either at 0
        example = (torch.zeros(2, img_size, img_size, 3, dtype=torch.uint8), torch.randn(2, 3, img_size, img_size))
        batches = {IMAGES: {0: torch.export.Dim("images_batch", min=1, max=4096)},
                   TENSOR: {0: torch.export.Dim("tensor_batch", min=1, max=4096)}}
    else:
        example = (torch.zeros(batch, img_size, img_size, 3, dtype=torch.uint8), torch.zeros(0, 3, img_size, img_size))
        batches = None
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        program = torch.onnx.export(
            module, example, dynamo=True, opset_version=OPSET, input_names=module.input_names,
            output_names=module.output_names, dynamic_shapes=batches, verbose=False)
    return program.model


def save_graph(graph: ir.Model, path: Path) -> onnx.ModelProto:
    """Write `graph` as a single self-contained .onnx file (weights inline: the file travels alone)."""
    proto = ir.to_proto(graph)
    # The exporter can leave stale intermediate shapes that make ONNX shape inference fail later.
    del proto.graph.value_info[:]
    # The exporter's metadata holds this machine's source paths and line numbers, and sets in no fixed order:
    # without it the same export writes the same bytes wherever it runs
    del proto.graph.metadata_props[:]
    for node in [*proto.graph.node, *(n for f in proto.functions for n in f.node)]:
        del node.metadata_props[:]
    onnx.save_model(proto, path)
    return proto


def export_graph(module: MainGraph | ExplainGraph | RelevanceGraph, img_size: int, path: Path) -> onnx.ModelProto:
    """Export `module` to a single self-contained .onnx file at `path` and return the graph."""
    return save_graph(export_program(module, img_size), path)


def op_counts(proto: onnx.ModelProto) -> dict[str, int]:
    """Node counts by op type, "domain:Op" outside the default domain."""
    names = (f"{n.domain}:{n.op_type}" if n.domain not in ("", "ai.onnx") else n.op_type for n in proto.graph.node)
    return dict(sorted(collections.Counter(names).items()))


def fused_attention_count(counts: dict[str, int]) -> int:
    return sum(v for k, v in counts.items() if k in FUSED_ATTENTION)


def unfused_attention(proto: onnx.ModelProto) -> list[str]:
    """Softmax nodes between two MatMuls (scores -> softmax -> weighted sum): attention left unfused.

    Element-wise steps between the score MatMul and the Softmax (scale, bias, mask) are looked through.
    """
    producer = {out: n for n in proto.graph.node for out in n.output}
    consumers = collections.defaultdict(list)
    for n in proto.graph.node:
        for name in n.input:
            consumers[name].append(n)
    passthrough = {"Add", "Mul", "Div", "Where", "Cast", "Reshape"}

    def from_matmul(name: str, depth: int = 0) -> bool:
        node = producer.get(name)
        if node is None or depth > 4:
            return False
        return node.op_type == "MatMul" or (node.op_type in passthrough and any(
            from_matmul(i, depth + 1) for i in node.input))

    # the weighted sum takes the probabilities as its left operand (a mean over the queries, as the maps' outputs
    # take, is a constant row times them)
    return [n.name for n in proto.graph.node if n.op_type == "Softmax" and from_matmul(n.input[0])
            and any(c.op_type == "MatMul" and c.input[0] == n.output[0] for c in consumers[n.output[0]])]


def expected_attention_blocks(model: nn.Module) -> int:
    if not has_attention(model):
        return 0
    if isinstance(model, SwinTransformer):
        return sum(len(stage.blocks) for stage in model.layers)
    return len(model.blocks) + (model.attn_pool is not None)  # attention pooling's query, SigLIP's head
