"""ONNX Runtime's fused CUDA kernels written into the fp16 graph.

A pre-norm transformer block is MatMul -> bias Add -> residual Add -> LayerNorm, twice. ONNX Runtime's own
SkipLayerNormFusion never fires on it: the residual sum also feeds the next residual Add, and that fusion
wants it to have one consumer. Left apart, those Adds took 20% of DeiT-S's fp16 time on an H100. Here the
bias, the residual sum and the LayerNorm become one com.microsoft SkipLayerNormalization (its fourth output
carries the sum onward), and the MLP's bias + GELU one BiasGelu, with onnxscript's ORT fusion rules. They match
on shapes, so they run on the graph as exported, whose shapes carry PyTorch's batch symbols. Swin's patch
merging puts a reshape between a stage's last residual sum and its LayerNorm; `SumBeforeRegrouping` moves it
onto the sum's terms first, so that sum fuses too.

The attention's input side is the other memory-bound stretch: the packed q/k/v projection's bias Add, a
[B, N, 3, heads, d] transpose and three slices, and a transpose back after the kernel, each a full pass over
the activations. `PackedQkvAttention` turns all of it, with the projection, into ORT's com.microsoft
Attention (x, packed weights, bias) (DeiT-S/Ti 1.3-1.4x on an H100 against the same graph without it), but
that op still adds the bias in a transposing copy of q, k and v (17% of DeiT-Ti's time). `SeparateQkvAttention`,
tried first, goes further: three projections, k's and v's biases folded away, and com.microsoft
MultiHeadAttention, which reads bias-free q, k and v in place; `PackedQkvAttention` stays as its comparison
(below). Both need the q, k, v and output to have no other use, so the last ViT/DeiT block, whose q and k also
give the [CLS] row, keeps the standard op.

Swin's windowed attention carries an additive mask (relative position bias, plus the shifted windows' mask).
ORT's CUDA kernel for opset-23 Attention with a float mask falls back to an unfused path whose softmax took
half of Swin-T's fp16 GPU time; written out as MatMul, Add, Softmax, MatMul, ORT fuses the Add and Softmax
into its BiasSoftmax kernel and runs the products as batched GEMMs: Swin-T 1.8x (`MaskedAttentionAsMatMuls`;
`AlignedKeys` pads each window's keys to a multiple of 8 before it, where they serve the attention alone).
`WindowAttentionAsMha`, tried first, makes the window attention one com.microsoft MultiHeadAttention over all
windows' heads, with the mask as its attention bias: one fused kernel, no scores written out. It too needs q, k
and v to have no other use, so the last block, whose q and k also give the attention map, is written out.

ONNX Runtime folds a graph's constant subgraphs when it loads it, but with its CPU kernels, which have no fp16 Add
or Pad: in the fp16 graph Swin's masks (the relative position bias plus the shift mask, expanded over the windows
and padded) would be recomputed on every run, 22 Pads and 5 Adds an inference in Swin-T, which count at batch
1. `fold_constant_subgraphs` computes them at export, in fp32 (onnxscript's constant folding), before the fp16
conversion rounds them once.

Where two rewrites compete for the same attention, the newer one is tried first and the older one stays for
what it does not match and as what `bench/gpu.py --ablate` ("without <newer>") measures it against: the newer
ones (MultiHeadAttention for ViT/DeiT and for Swin's windows, the aligned keys) are not yet measured on a GPU.

Only the fp16 graph (the CUDA provider's) is fused: the fp32 graph stays standard ONNX for any runtime (ONNX
Runtime's CPU provider runs it fused 2-14% slower: `bench/export_speed.py --fused`), and the int8 quantizer cannot
type com.microsoft ops' outputs.
"""
import numpy as np
import onnx_ir as ir
from onnx_ir.passes.common import RemoveUnusedNodesPass
from onnxscript.optimizer import fold_constants
from onnxscript.rewriter.ort_fusions.bias_gelu import fuse_bias_gelu
from onnxscript.rewriter.ort_fusions.skip_normalization import fuse_skip_layer_normalization
from onnxscript.rewriter.pattern import MatchResult, RewriteRuleClassBase, RewriteRuleSet


def _constant(value: ir.Value) -> np.ndarray | None:
    return value.const_value.numpy() if value.const_value is not None else None


def _flat_constant(value: ir.Value) -> np.ndarray | None:
    """A constant, or a constant reshaped to 1-D (as the exporter leaves an index too large for it to fold)."""
    node = value.producer()
    if value.const_value is None and node is not None and node.op_type == "Reshape":
        value = node.inputs[0]
    const = _constant(value)
    return None if const is None else const.reshape(-1)


def _ints(value: ir.Value) -> list[int] | None:
    const = _constant(value)
    return None if const is None else const.tolist()


def _plain(attention: ir.Value) -> bool:
    """softmax(q k^T scale + mask) v and nothing more: no causal mask, softcap or other output mode."""
    attrs = attention.producer().attributes
    defaults = ("is_causal", 0), ("softcap", 0.0), ("qk_matmul_output_mode", 0)
    return all(attrs.get(name) is None or attrs[name].value == default for name, default in defaults)


def _const(op, array: np.ndarray) -> ir.Value:
    return op.Constant(value=ir.tensor(np.array(array, order="C")))  # keeps a scalar a scalar


def _typed(value: ir.Value, like: ir.Value, shape: list | None = None) -> ir.Value:
    """`value` given `like`'s type and shape (or `shape`): the rewrites after one match on shapes."""
    value.dtype, value.shape = like.dtype, like.shape if shape is None else ir.Shape(shape)
    return value


def _padded_positions(index: np.ndarray, n: int, length: int) -> np.ndarray:
    """Gather indices [..., n] (a window's positions) -> [..., length], the padding copies of real positions
    (cyclically, so that windows shorter than the padding pad too)."""
    return index[..., np.arange(length) % n]


def _keys_masked_out(op, mask: ir.Value, pad: int) -> ir.Value:
    """The additive mask with `pad` more keys at -inf: a weight of exactly 0 (the mask is made of constants, so
    ONNX Runtime folds this at load)."""
    return op.Pad(mask, _const(op, np.array([0] * 7 + [pad])), _const(op, np.array(-np.inf, mask.dtype.numpy())))


class PackedQkvAttention(RewriteRuleClassBase):
    """x @ Wqkv + b -> [B, N, 3, heads, d] -> q, k, v -> opset-23 Attention -> [B, N, D], as torch exports
    timm's attention, into com.microsoft Attention(x, Wqkv, b)."""

    def pattern(self, op, x, weight, bias, heads_shape, s0, e0, s1, e1, s2, e2, a0, a1, a2, tokens_shape):
        qkv = op.Add(op.MatMul(x, weight), bias)
        heads = op.Transpose(op.Reshape(qkv, heads_shape, _allow_other_attributes=True), perm=[2, 0, 3, 1, 4])
        q = op.Squeeze(op.Slice(heads, s0, e0, a0), a0)
        k = op.Squeeze(op.Slice(heads, s1, e1, a1), a1)
        v = op.Squeeze(op.Slice(heads, s2, e2, a2), a2)
        out = op.Attention(q, k, v, _allow_other_attributes=True, _outputs=["attention"])
        return op.Reshape(op.Transpose(out, perm=[0, 2, 1, 3]), tokens_shape, _allow_other_attributes=True)

    def check(self, context, weight, bias, heads_shape, s0, e0, s1, e1, s2, e2, a0, a1, a2, attention,
              **_) -> MatchResult:
        result = MatchResult()
        w, b, shape = (_constant(v) for v in (weight, bias, heads_shape))
        if w is None or b is None or shape is None or w.ndim != 2 or b.shape != (w.shape[1],) or len(shape) != 5:
            return result.fail("the q, k, v projection and the head shape must be constants")
        if shape[2] != 3 or 3 * shape[3] * shape[4] != w.shape[1]:
            return result.fail("not one projection packing q, k and v")
        if [[_ints(s), _ints(e)] for s, e in ((s0, e0), (s1, e1), (s2, e2))] != [[[0], [1]], [[1], [2]], [[2], [3]]]:
            return result.fail("not q, k, v in their packed order")
        if [_ints(a) for a in (a0, a1, a2)] != [[0]] * 3:
            return result.fail("not cut along the q/k/v axis")
        if not _plain(attention):
            return result.fail("a variant of attention com.microsoft Attention does not compute")
        scale = attention.producer().attributes.get_float("scale", None)
        if scale is not None and not np.isclose(scale, shape[4] ** -0.5):
            return result.fail("a scale other than 1/sqrt(head size)")
        return result

    def rewrite(self, op, x, weight, bias, heads_shape, **_) -> ir.Value:
        heads = int(_constant(heads_shape)[3])
        return op.Attention(x, weight, bias, num_heads=heads, _domain="com.microsoft")


class SeparateQkvAttention(PackedQkvAttention):
    """The same attention with its output projection -> q = x Wq + b_q, k = x Wk, v = x Wv (three GEMMs, no
    bias), com.microsoft MultiHeadAttention(q, k, v), then the projection with b_o + b_v Wo as its bias.

    MultiHeadAttention reads separate q, k and v of [B, N, heads * d] in place when they carry no bias (flash,
    memory-efficient and cuDNN kernels take that layout), where com.microsoft Attention adds the packed bias in
    a transposing copy of all three (AddBiasTransposeQKV: 17% of DeiT-Ti's fp16 time on an H100). k's bias adds
    q . b_k to every score of a query's row, which the softmax cancels; v's adds b_v to every output (each row of
    probabilities sums to 1), which the projection's bias takes. q's stays: one Add over a third of the values.
    """

    def pattern(self, op, x, weight, bias, heads_shape, s0, e0, s1, e1, s2, e2, a0, a1, a2, tokens_shape,
                proj_weight, proj_bias):
        tokens = super().pattern(op, x, weight, bias, heads_shape, s0, e0, s1, e1, s2, e2, a0, a1, a2, tokens_shape)
        return op.Add(op.MatMul(tokens, proj_weight), proj_bias)

    def check(self, context, proj_weight, proj_bias, **matched) -> MatchResult:
        w, b = _constant(proj_weight), _constant(proj_bias)
        if w is None or b is None or w.ndim != 2 or b.shape != (w.shape[1],):
            return MatchResult().fail("the output projection must be constants")
        return super().check(context, **matched)

    def rewrite(self, op, x, weight, bias, heads_shape, proj_weight, proj_bias, **_) -> ir.Value:
        heads = int(_constant(heads_shape)[3])
        (wq, wk, wv), (bq, _, bv) = np.split(_constant(weight), 3, axis=1), np.split(_constant(bias), 3)
        wo = _constant(proj_weight)
        folded = (bv.astype(np.float64) @ wo.astype(np.float64) + _constant(proj_bias)).astype(wo.dtype)

        def constant(array: np.ndarray, part: str) -> ir.Value:
            return op.initializer(ir.tensor(np.ascontiguousarray(array)), name=f"{weight.name}.{part}")

        def like_x(value: ir.Value) -> ir.Value:
            return _typed(value, x)  # every value here is [B, N, D] as x is

        q = like_x(op.Add(like_x(op.MatMul(x, constant(wq, "q"))), constant(bq, "q_bias")))
        k, v = like_x(op.MatMul(x, constant(wk, "k"))), like_x(op.MatMul(x, constant(wv, "v")))
        out = like_x(op.MultiHeadAttention(q, k, v, num_heads=heads, _domain="com.microsoft"))
        return like_x(op.Add(like_x(op.MatMul(out, proj_weight)), constant(folded, "output_bias")))


packed_qkv_attention = RewriteRuleSet([PackedQkvAttention.rule()])
separate_qkv_attention = RewriteRuleSet([SeparateQkvAttention.rule()])


class WindowAttentionAsMha(RewriteRuleClassBase):
    """Swin's window attention, as `QBiasWindowAttention` exports it (q, k and v gathered per window and head
    from the packed projection's rows, q's bias added, the heads' outputs gathered back into token rows), into
    one com.microsoft MultiHeadAttention whose "heads" are every window's heads, with the relative position bias
    and the shifted windows' mask as its attention bias.

    The Gathers lay q, k and v out as [B, M*M, windows * heads * d], the layout the fused kernels read in place,
    each window's M*M positions padded to a multiple of 8 (the fused kernels' alignment for an attention bias;
    the padding keys masked to -inf, the padding queries' rows never gathered back). One kernel then does what
    took a batched product, the bias Add and softmax, and another product, without writing the scores out.
    """

    def pattern(self, op, rows, q_index, q_heads, q_bias, q_shape, k_index, k_shape, v_index, v_shape, mask,
                flat_shape, token_index):
        gathered_q = op.Reshape(op.Gather(rows, q_index, axis=1), q_heads, _allow_other_attributes=True)
        q = op.Reshape(op.Add(gathered_q, q_bias), q_shape, _allow_other_attributes=True)
        k = op.Reshape(op.Gather(rows, k_index, axis=1), k_shape, _allow_other_attributes=True)
        v = op.Reshape(op.Gather(rows, v_index, axis=1), v_shape, _allow_other_attributes=True)
        out = op.Attention(q, k, v, mask, _allow_other_attributes=True, _outputs=["attention"])
        flat = op.Reshape(out, flat_shape, _allow_other_attributes=True)
        return op.Gather(flat, token_index, axis=1, _outputs=["tokens"])

    def check(self, context, q_index, q_bias, k_index, k_shape, v_index, mask, token_index, attention,
              **_) -> MatchResult:
        result = MatchResult()
        indices = [_flat_constant(v) for v in (q_index, k_index, v_index, token_index)]
        bias, dims = _constant(q_bias), _constant(k_shape)
        if any(c is None for c in (*indices, bias, dims)) or bias.ndim != 3 or len(dims) != 4:
            return result.fail("the gathers, q's bias and the head shape must be constants")
        heads, n = bias.shape[0], int(dims[2])
        if any(len(i) % (heads * n) for i in indices[:3]) or mask.shape is None or len(mask.shape) != 4:
            return result.fail("not windows of heads over M*M positions with a 4-D mask")
        if mask.dtype == ir.DataType.BOOL or list(mask.shape)[2:] != [n, n] or mask.shape[0] != 1:
            return result.fail("not an additive mask shared by the batch")
        if not _plain(attention):
            return result.fail("a variant of attention")
        return result

    def rewrite(self, op, rows, q_index, q_bias, k_shape, k_index, v_index, mask, token_index, attention,
                tokens, **_) -> ir.Value:
        bias = _constant(q_bias)
        heads, d, n = bias.shape[0], bias.shape[2], int(_constant(k_shape)[2])
        windows = len(_flat_constant(q_index)) // (heads * n)
        groups, padded = windows * heads, -(-n // 8) * 8

        def constant(array: np.ndarray) -> ir.Value:
            return _const(op, array)

        def mha_layout(index: ir.Value) -> ir.Value:
            """[B, padded, windows * heads * d]: each position's row of every window's heads."""
            rows_of = _padded_positions(_flat_constant(index).reshape(windows, heads, n), n, padded)
            gathered = op.Gather(rows, constant(rows_of.transpose(2, 0, 1).reshape(-1)), axis=1)
            return op.Reshape(gathered, constant(np.array([0, padded, groups * d])))

        q = op.Reshape(mha_layout(q_index), constant(np.array([0, padded, windows, heads, d])))
        q = op.Reshape(op.Add(q, constant(bias.reshape(heads, d))), constant(np.array([0, padded, groups * d])))
        # the mask [1, heads or windows * heads, n, n] for every window's heads; the padding queries' rows at 0
        shared = op.Expand(op.Reshape(mask, constant(np.array([1, -1, heads, n, n]))),
                           constant(np.array([1, windows, heads, n, n])))
        shared = _typed(op.Reshape(shared, constant(np.array([1, groups, n, n]))), mask, [1, groups, n, n])
        wide = _keys_masked_out(op, shared, padded - n)
        wide = op.Pad(wide, constant(np.array([0, 0, 0, 0, 0, 0, padded - n, 0])), constant(np.array(0, np.float32)))
        scale = attention.producer().attributes.get_float("scale", d ** -0.5)
        out = op.MultiHeadAttention(q, mha_layout(k_index), mha_layout(v_index), None, None, wide,
                                    num_heads=groups, scale=scale, _domain="com.microsoft")
        position = _flat_constant(token_index)  # rows of [B, windows * heads * n, d], (window, head, position)
        rows_out = position % n * groups + position // n  # the same rows of [B, padded * windows * heads, d]
        flat = op.Reshape(out, constant(np.array([0, padded * groups, d])))
        return _typed(op.Gather(flat, constant(rows_out), axis=1), tokens)


window_attention_as_mha = RewriteRuleSet([WindowAttentionAsMha.rule()])


class AlignedKeys(RewriteRuleClassBase):
    """Attention over keys and values gathered per window (Swin's, M*M = 49 of them) -> the same over keys
    padded to a multiple of 8, the padding's scores masked to -inf (a weight of exactly 0).

    With 49 keys every row of the scores and probabilities starts at an odd offset, and cuBLAS runs both of
    the attention's batched products with its alignment-1 kernels (on an H100, 12% of Swin-T's fp16 time at
    batch 64); at 56 they are 16-byte aligned. The padding keys are copies of a real one, read by the same
    Gather, so nothing is added to the graph but longer indices and a wider mask.
    """

    def pattern(self, op, q, rows, k_index, k_shape, v_index, v_shape, mask):
        k = op.Reshape(op.Gather(rows, k_index, axis=1), k_shape, _allow_other_attributes=True, _outputs=["k"])
        v = op.Reshape(op.Gather(rows, v_index, axis=1), v_shape, _allow_other_attributes=True, _outputs=["v"])
        return op.Attention(q, k, v, mask, _allow_other_attributes=True, _outputs=["attention"])

    def check(self, context, k, k_index, k_shape, v_index, v_shape, mask, attention, **_) -> MatchResult:
        result = MatchResult()
        if k.shape is None or len(k.shape) != 4:
            return result.fail("keys of unknown shape")
        consts = [_flat_constant(k_index), _constant(k_shape), _flat_constant(v_index), _constant(v_shape)]
        if any(c is None for c in consts):
            return result.fail("the gathers and the head shapes must be constants")
        _, k_dims, _, v_dims = consts
        if mask.dtype == ir.DataType.BOOL or mask.shape is None or len(mask.shape) != 4:
            return result.fail("not an additive 4-D mask")
        if len(k_dims) != 4 or list(k_dims[1:3]) != list(v_dims[1:3]) or mask.shape[3] != k_dims[2]:
            return result.fail("not keys and values [B, heads, keys, d] with a mask over those keys")
        if k_dims[2] % 8 == 0:
            return result.fail("the keys are aligned already")
        if not _plain(attention):
            return result.fail("a variant of attention")
        return result

    def rewrite(self, op, q, rows, k, k_index, k_shape, v, v_index, v_shape, mask, attention) -> ir.Value:
        n = int(_constant(k_shape)[2])
        pad = -n % 8

        def wider(value: ir.Value, like: ir.Value, axis: int) -> ir.Value:
            """`value` typed as `like`, `pad` longer along `axis`."""
            return _typed(value, like, [d + pad if i == axis else d for i, d in enumerate(like.shape)])

        def padded(index: ir.Value, shape: ir.Value, like: ir.Value) -> ir.Value:
            # each window's (and head's) keys are contiguous in the index
            longer = _padded_positions(_flat_constant(index).reshape(-1, n), n, n + pad).reshape(-1)
            dims = _constant(shape).copy()
            dims[2] += pad
            gathered = op.Gather(rows, _const(op, longer), axis=1)
            return wider(op.Reshape(gathered, _const(op, dims)), like, 2)

        wide = wider(_keys_masked_out(op, mask, pad), mask, 3)
        attributes = {name: attr.value for name, attr in attention.producer().attributes.items()}
        return op.Attention(q, padded(k_index, k_shape, k), padded(v_index, v_shape, v), wide, **attributes)


aligned_keys = RewriteRuleSet([AlignedKeys.rule()])


class SumBeforeRegrouping(RewriteRuleClassBase):
    """LayerNorm(Reshape(a + (x W + b))) that regroups rows [B, T, C] into [B, T/k, kC] -> LayerNorm(Reshape(a)
    + (Reshape(x W) + b tiled k times)).

    Swin's patch merging is that reshape (the rows are in merge order, each 2 x 2 neighbourhood four consecutive
    rows), between a stage's last residual sum and the merging's LayerNorm. With the reshape moved onto the two
    terms (free: a reshape is a view), the sum, the bias and the norm become one SkipLayerNormalization, where
    they were an Add pass and a LayerNorm pass over the stage's last activations.
    """

    def pattern(self, op, residual, product, bias, shape, scale, shift):
        total = op.Add(residual, op.Add(product, bias), _outputs=["total"])
        regrouped = op.Reshape(total, shape, _allow_other_attributes=True, _outputs=["regrouped"])
        return op.LayerNormalization(regrouped, scale, shift, axis=-1, _allow_other_attributes=True,
                                     _outputs=["normed"])

    def check(self, context, residual, product, bias, total, regrouped, **_) -> MatchResult:
        result = MatchResult()
        b, shapes = _constant(bias), [v.shape for v in (residual, product, regrouped)]
        if b is None or b.ndim != 1 or any(s is None or len(s) != 3 for s in shapes):
            return result.fail("not rows [B, T, C] with a constant bias")
        if not all(isinstance(s[2], int) for s in shapes) or shapes[0][2] != shapes[1][2] or shapes[1][2] != len(b):
            return result.fail("not terms of one width with the bias")
        if shapes[2][2] % len(b) or shapes[2][0] != shapes[0][0]:
            return result.fail("not a regrouping of each sample's rows")
        if len(total.uses()) != 1:
            return result.fail("the sum has another use")
        return result

    def rewrite(self, op, residual, product, bias, shape, scale, shift, regrouped, normed, **_) -> ir.Value:
        b = _constant(bias)
        tiled = _const(op, np.tile(b, regrouped.shape[2] // len(b)))
        left, right = (_typed(op.Reshape(v, shape), regrouped) for v in (residual, product))
        total = _typed(op.Add(left, _typed(op.Add(right, tiled), regrouped)), regrouped)
        attributes = {name: attr.value for name, attr in normed.producer().attributes.items()}
        return op.LayerNormalization(total, scale, shift, **attributes)


sum_before_regrouping = RewriteRuleSet([SumBeforeRegrouping.rule()])


class MaskedAttentionAsMatMuls(RewriteRuleClassBase):
    """Opset-23 Attention with an additive float mask -> MatMul, Add, Softmax, MatMul."""

    def pattern(self, op, q, k, v, mask):
        return op.Attention(q, k, v, mask, _allow_other_attributes=True, _outputs=["attention"])

    def check(self, context, q, k, v, mask, attention, **_) -> MatchResult:
        result = MatchResult()
        if any(t.shape is None or len(t.shape) != 4 for t in (q, k, v, mask)) or not isinstance(q.shape[3], int):
            return result.fail("not 4-D inputs with a known head size")
        if mask.dtype == ir.DataType.BOOL:
            return result.fail("a boolean mask")
        if not _plain(attention):
            return result.fail("a variant of attention")
        return result

    def rewrite(self, op, q, k, v, mask, attention) -> ir.Value:
        scale = attention.producer().attributes.get_float("scale", q.shape[3] ** -0.5)
        scaled = op.Mul(q, _const(op, np.float32(scale)))
        scores = op.MatMul(scaled, op.Transpose(k, perm=[0, 1, 3, 2]))
        return op.MatMul(op.Softmax(op.Add(scores, mask), axis=-1), v)


masked_attention_as_matmuls = RewriteRuleSet([MaskedAttentionAsMatMuls.rule()])


def fold_constant_subgraphs(graph: ir.Model) -> int:
    """Every node computed from constants alone replaced by its value; how many it replaced. No size limit: each
    value is one the graph would otherwise compute on every run (Swin-T's masks: 2.3M values, 4.6 MB in fp16)."""
    def computed() -> int:
        return sum(node.op_type != "Constant" for node in graph.graph)

    RemoveUnusedNodesPass()(graph)  # what the rewrites before left unused (Swin-T: 8 nodes) is no run's work
    before = computed()
    fold_constants(graph, input_size_limit=2 ** 62, output_size_limit=2 ** 62)  # fuse_for_ort drops what is unused
    return before - computed()


REWRITES = {"MultiHeadAttention": separate_qkv_attention.apply_to_model,
            "Attention": packed_qkv_attention.apply_to_model,
            "sum before patch merging": sum_before_regrouping.apply_to_model,
            "SkipLayerNormalization": fuse_skip_layer_normalization,
            "BiasGelu": fuse_bias_gelu,
            "window attention as MultiHeadAttention": window_attention_as_mha.apply_to_model,
            "aligned keys": aligned_keys.apply_to_model,
            "masked attention as MatMuls": masked_attention_as_matmuls.apply_to_model,
            "folded constants": fold_constant_subgraphs}  # last: the rewrites above pad and expand constant masks


def fuse_for_ort(graph: ir.Model, without: tuple[str, ...] = ()) -> dict[str, int]:
    """Rewrite `graph` in place; how many of each rewrite it made. `without`: REWRITES left out (what each
    one gains: bench/gpu.py --ablate)."""
    made = {name: rewrite(graph) for name, rewrite in REWRITES.items() if name not in without}
    for node in graph.graph:
        if node.op_type == "SkipLayerNormalization":
            # the mean and inverse deviation: absent, as in ORT's own fused form (its CUDA kernel never makes them)
            for unused in (v for v in node.outputs[1:3] if not v.uses()):
                unused.name = ""
    RemoveUnusedNodesPass()(graph)  # what the rewrites left behind (the padded keys' shorter indices)
    return made
