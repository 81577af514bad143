"""The exporter: fused attention, dynamic batch, the parity gate, the manifest, and clean failures."""
import functools
import json

import jsonschema
import numpy as np
import onnx
import onnx_ir
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper
from safetensors.torch import load_file, save_file

import models
from export import isa
from export.__main__ import main as export_main
from export.fusion import REWRITES, fuse_for_ort, masked_attention_as_matmuls
from export.graph import MainGraph, export_form, export_program, save_graph, unfused_attention
from export.manifest import sha256, validate
from export.parity import (MIN_TOP1_AGREEMENT, ParityError, check_fp32, check_reduced, gate_inputs,
                           reduced_precision_passes)
from export.pipeline import target_folder
from export.precision import INT8_WEIGHT_RANGE
from models.synthetic import __main__ as synthetic
from repository import graph_inputs, read_entry

MICRO = {"vit": "vit_micro_patch8_96", "deit": "deit_micro_distilled_patch8_96", "swin": "swin_micro_patch4_window6_96"}
BLOCKS = {"vit": 4, "deit": 4, "swin": 6}


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    """The three micro architectures, exported once from seeded random weights."""
    out = tmp_path_factory.mktemp("repo")
    torch.manual_seed(0)
    for arch, name in MICRO.items():
        weights = out / f"{arch}.safetensors"
        save_file(models.create_model(name).state_dict(), weights)
        export_main([name, "--weights", str(weights), "--name", arch, "--out", str(out)])
    return out


def with_biases(name: str, **kwargs) -> torch.nn.Module:
    """A seeded random-init model whose biases (and norms) are not zero, as trained ones are not: folding a bias
    away shows only then."""
    torch.manual_seed(0)
    model = models.create_model(name, **kwargs).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.normal_(0, 0.5)
    return model


def manifest(repo, arch: str) -> dict:
    return json.loads((repo / arch / "manifest.json").read_text())


@pytest.mark.parametrize("arch", MICRO)
def test_attention_is_fused_in_every_block(repo, arch):
    m = manifest(repo, arch)
    assert m["op_counts"]["Attention"] == m["fused_attention"] == BLOCKS[arch]
    graph = onnx.load(repo / arch / "model.onnx")
    assert graph.opset_import[0].version == 23 and unfused_attention(graph) == []


@pytest.mark.parametrize("arch", MICRO)
def test_dynamic_batch_gives_the_same_per_item_outputs(repo, arch):
    session = ort.InferenceSession(repo / arch / "model.onnx", providers=["CPUExecutionProvider"])
    x = np.random.default_rng(0).standard_normal((8, 3, 96, 96)).astype(np.float32)
    full = session.run(None, graph_inputs(x))
    for batch in (1, 3):
        for start in range(0, 8 - batch + 1, batch):
            part = session.run(None, graph_inputs(x[start:start + batch]))
            for a, b in zip(part, full):
                np.testing.assert_allclose(a, b[start:start + batch], atol=1e-5)


SKIP_LAYER_NORMS = {"vit": 8, "deit": 8, "swin": 12}  # every LayerNorm after a residual sum: 2 a block (Swin:
# not the first of a stage, which follows patch merging, but the merging's own instead) and the final norm


@pytest.fixture(scope="module")
def fp16_repo(repo):
    for arch, name in MICRO.items():
        export_main([name, "--weights", str(repo / f"{arch}.safetensors"), "--precision", "fp16", "--name", arch,
                     "--out", str(repo / "fp16"), "--no-explain"])
    return repo / "fp16"


def _residual_sums_into_layer_norms(graph: onnx.ModelProto) -> list[str]:
    """LayerNormalization nodes fed by an Add of two computed tensors (a residual sum), left unfused; also through
    a Reshape (Swin's patch merging)."""
    made = {out: n for n in graph.graph.node for out in n.output}
    constant = {i.name for i in graph.graph.initializer}

    def residual_sum(name: str) -> bool:
        node = made.get(name)
        if node is not None and node.op_type == "Reshape":
            node = made.get(node.input[0])
        return node is not None and node.op_type == "Add" and not constant & set(node.input)

    return [n.name for n in graph.graph.node if n.op_type == "LayerNormalization" and residual_sum(n.input[0])]


def _computed_from_constants(graph: onnx.ModelProto) -> list[str]:
    """Nodes whose inputs are all constants: what a session computes at load, or on every run where its CPU kernels
    cannot (ONNX Runtime has no fp16 Add or Pad on the CPU)."""
    inputs = {i.name for i in graph.graph.input}  # an input's default is no constant: a feed overrides it
    constant = {i.name for i in graph.graph.initializer if i.name not in inputs} | {""}
    found = []
    for node in graph.graph.node:  # in order: a node's inputs are made before it
        if set(node.input) <= constant:
            constant.update(node.output)
            if node.op_type != "Constant":
                found.append(node.op_type)
    return found


@pytest.mark.parametrize("arch", MICRO)
def test_fp16_graphs_carry_onnx_runtimes_fused_kernels_and_fp32_stays_standard(repo, fp16_repo, arch):
    fp32, fp16 = onnx.load(repo / arch / "model.onnx"), onnx.load(fp16_repo / arch / "model.onnx")
    onnx.checker.check_model(fp16)  # valid ONNX (its nodes in order), the contrib domain declared
    assert len(_residual_sums_into_layer_norms(fp32)) == SKIP_LAYER_NORMS[arch]  # what there is to fuse
    assert {n.domain for n in fp32.graph.node} <= {""}
    m = manifest(fp16_repo, arch)
    assert m["op_counts"]["com.microsoft:SkipLayerNormalization"] == SKIP_LAYER_NORMS[arch]
    assert m["op_counts"]["com.microsoft:BiasGelu"] == BLOCKS[arch] and "Gelu" not in m["op_counts"]
    assert _residual_sums_into_layer_norms(fp16) == [] and "ReduceMean" not in m["op_counts"]
    assert _computed_from_constants(fp16) == []  # Swin's masks folded at export: no fp16 Adds and Pads left to run
    # ORT's fused form: output 3 carries the sum on; 1 and 2 (statistics its CUDA kernel never makes) absent
    assert {tuple(n.output[1:3]) for n in fp16.graph.node if n.op_type == "SkipLayerNormalization"} == {("", "")}
    # every block's attention one MultiHeadAttention but the last (its q and k also give the attention map), which
    # Swin writes out as MatMuls (its mask) and ViT/DeiT keep as the standard op
    written_out = 1 if arch == "swin" else 0
    assert m["op_counts"]["com.microsoft:MultiHeadAttention"] == BLOCKS[arch] - 1
    assert "com.microsoft:Attention" not in m["op_counts"]
    assert m["fused_attention"] == BLOCKS[arch] - written_out
    assert m["op_counts"].get("Softmax", 0) == manifest(repo, arch)["op_counts"].get("Softmax", 0) + written_out
    assert m["parity"]["fused_fp32"]["logits_max_abs_diff"] <= 1e-4  # the fusions are gated against PyTorch too
    assert m["parity"]["fp16"]["top1_agreement"] >= 0.99


def test_attention_the_fused_op_does_not_compute_is_left_as_it_is(repo):
    graph = onnx_ir.load(repo / "vit" / "model.onnx")
    causal = next(n for n in graph.graph if n.op_type == "Attention")
    causal.attributes["is_causal"] = onnx_ir.AttrInt64("is_causal", 1)
    assert fuse_for_ort(graph)["MultiHeadAttention"] == BLOCKS["vit"] - 2  # neither the causal one nor the last


def test_vit_attention_fused_either_way_gives_the_same_answers(tmp_path):
    """MultiHeadAttention over separate q, k, v with k's and v's biases folded away (the export's), and
    com.microsoft Attention over the packed projection (what `bench/gpu.py --ablate` compares it with)."""
    model = with_biases(MICRO["deit"])
    images = np.random.default_rng(0).integers(0, 256, (3, 96, 96, 3), dtype=np.uint8)
    runs, made = {}, {}
    for name, without in (("unfused", tuple(REWRITES)), ("separate", ()), ("packed", ("MultiHeadAttention",))):
        graph = export_program(MainGraph(export_form(model)), 96)
        made[name] = fuse_for_ort(graph, without)
        save_graph(graph, tmp_path / f"{name}.onnx")
        session = ort.InferenceSession(tmp_path / f"{name}.onnx", providers=["CPUExecutionProvider"])
        runs[name] = session.run(None, graph_inputs(images))
    assert made["separate"]["MultiHeadAttention"] == made["packed"]["Attention"] == BLOCKS["deit"] - 1
    for name in ("separate", "packed"):
        for want, got in zip(runs["unfused"], runs[name]):
            np.testing.assert_allclose(got, want, atol=1e-5)


def test_a_graph_exported_for_one_batch_size_has_no_shape_arithmetic_and_the_same_answers(repo, tmp_path):
    """What CUDA graph capture needs (bench/gpu.py times it): every shape fixed, nothing left for the CPU."""
    model = models.create_model(MICRO["vit"])
    model.load_state_dict(load_file(repo / "vit.safetensors"))
    save_graph(export_program(MainGraph(export_form(model)), 96, batch=3), tmp_path / "static.onnx")
    static = ort.InferenceSession(tmp_path / "static.onnx", providers=["CPUExecutionProvider"])
    assert [i.shape for i in static.get_inputs()] == [[3, 96, 96, 3], [0, 3, 96, 96]]
    assert not {"Shape", "Size", "NonZero"} & {n.op_type for n in onnx.load(tmp_path / "static.onnx").graph.node}
    images = np.random.default_rng(0).integers(0, 256, (3, 96, 96, 3), dtype=np.uint8)
    dynamic = ort.InferenceSession(repo / "vit" / "model.onnx", providers=["CPUExecutionProvider"])
    for a, b in zip(static.run(None, graph_inputs(images)), dynamic.run(None, graph_inputs(images))):
        np.testing.assert_allclose(a, b, atol=1e-5)


@pytest.mark.parametrize("img_size", [96, 104])  # 104 px: 26 tokens a side, so windows of 6 are padded
def test_swin_exported_with_only_qs_bias_gives_the_same_answers(img_size):
    """k's bias cancels in the softmax and v's moves into the output projection's: same outputs, shifted and
    padded windows included, for biases that are not zero."""
    model = with_biases(MICRO["swin"], img_size=img_size)
    exported = export_form(model)
    assert all(b.attn.qkv.bias is None for stage in exported.layers for b in stage.blocks)
    images = torch.randint(0, 256, (2, img_size, img_size, 3), dtype=torch.uint8)
    pixels = torch.randn(1, 3, img_size, img_size)
    with torch.no_grad():
        for want, got in zip(MainGraph(model)(images, pixels), MainGraph(exported)(images, pixels)):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_manifest_validates_and_describes_the_graph(repo):
    m = manifest(repo, "deit")
    validate(m)
    assert m["files"]["model"]["sha256"] == sha256(repo / "deit" / "model.onnx")
    assert m["files"]["explain"]["sha256"] == sha256(repo / "deit" / "explain.onnx")
    assert [o["name"] for o in m["outputs"]] == ["logits", "cls_attention", "dist_attention", "embeddings"]
    assert m["outputs"][1]["shape"] == ["batch", 4, 144] and m["outputs"][3]["shape"] == ["batch", 128]
    # the distilled DeiT's pre-logits feature, as timm's: what its two averaged heads read
    assert m["embedding"] == {"output": "embeddings", "size": 128,
                              "pooling": "mean of the final-norm [CLS] and distillation tokens"}
    assert m["parity"]["embeddings_max_abs_diff"] <= 1e-4
    assert m["attention"] == {"method": "cls_row", "grid": [12, 12], "heads": 4,
                              "outputs": {"cls": "cls_attention", "dist": "dist_attention"},
                              "explain_outputs": ["attention_0", "attention_1", "attention_2", "attention_3"]}
    assert m["input"]["mean"] == [0.5, 0.5, 0.5] and m["input"]["resize_short_side"] == 96
    assert m["parity"]["logits_max_abs_diff"] <= 1e-4 and m["parity"]["top1_agreement"] == 1.0
    swin = manifest(repo, "swin")
    assert swin["attention"]["method"] == "window_received" and swin["attention"]["grid"] == [6, 6]
    assert swin["embedding"]["pooling"] == "mean of the final-norm last-stage tokens"
    assert "explain" not in swin["files"]
    broken = {k: v for k, v in m.items() if k != "labels"}
    with pytest.raises(jsonschema.ValidationError, match="'labels' is a required property"):
        validate(broken)


def test_explain_graph_gives_every_blocks_attention(repo):
    session = ort.InferenceSession(repo / "vit" / "explain.onnx", providers=["CPUExecutionProvider"])
    outputs = session.run(None, graph_inputs(np.zeros((2, 96, 96, 3), np.uint8)))
    assert len(outputs) == 4 and all(o.shape == (2, 4, 145, 145) for o in outputs)
    np.testing.assert_allclose(outputs[-1].sum(-1), 1.0, atol=1e-5)


def _perturbed_copy(repo, arch: str, tmp_path, scale: float):
    graph = onnx.load(repo / arch / "model.onnx")
    for init in graph.graph.initializer:
        if "head" in init.name and init.name.endswith("weight"):
            init.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(init) * scale, init.name))
    path = tmp_path / "perturbed.onnx"
    onnx.save(graph, path)
    return ort.InferenceSession(path, providers=["CPUExecutionProvider"])


def test_parity_gate_rejects_a_perturbed_graph(repo, tmp_path):
    model = models.create_model(MICRO["vit"])
    model.load_state_dict(load_file(repo / "vit.safetensors"))
    main, inputs = MainGraph(model), gate_inputs(model.spec)
    good = ort.InferenceSession(repo / "vit" / "model.onnx", providers=["CPUExecutionProvider"])
    assert check_fp32(good, main, inputs)["logits_max_abs_diff"] < 1e-4
    with pytest.raises(ParityError, match="differs from PyTorch"):
        check_fp32(_perturbed_copy(repo, "vit", tmp_path, 1.001), main, inputs)
    with pytest.raises(ParityError, match="fails the gate"):  # logits flipped: decisions and errors both off
        check_reduced(_perturbed_copy(repo, "vit", tmp_path, -1.0), good, inputs)
    close = check_reduced(_perturbed_copy(repo, "vit", tmp_path, 1.001), good, inputs)
    assert close["logits_relative_error"] < 0.01


def test_the_reduced_precision_gate_judges_untrained_logits_by_their_error_and_trained_ones_by_decisions():
    assert reduced_precision_passes(0.917, 0.001, heldout=False)  # ViT-B/16, random init, fp16 on an H100
    assert not reduced_precision_passes(0.917, 0.001, heldout=True)  # on held-out data, decisions alone count
    assert not reduced_precision_passes(0.5, 0.3, heldout=False)  # a broken conversion
    assert reduced_precision_passes(0.995, 0.3, heldout=True)


def test_unfused_attention_is_detected_and_a_mean_over_the_queries_is_not():
    nodes = [helper.make_node("MatMul", ["q", "kt"], ["s"]), helper.make_node("Mul", ["s", "scale"], ["z"]),
             helper.make_node("Softmax", ["z"], ["p"], name="attn_softmax"),
             helper.make_node("MatMul", ["p", "v"], ["o"]),
             # the probabilities that an attention map averages over the queries: a constant row times them
             helper.make_node("Softmax", ["z"], ["p2"], name="map_softmax"),
             helper.make_node("MatMul", ["row", "p2"], ["m"])]
    f = TensorProto.FLOAT
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info(n, f, None) for n in ("q", "kt", "v")],
                              [helper.make_tensor_value_info(n, f, None) for n in ("o", "m")],
                              [numpy_helper.from_array(np.array(0.125, np.float32), "scale"),
                               numpy_helper.from_array(np.full((1, 4), 0.25, np.float32), "row")])
    assert unfused_attention(helper.make_model(graph)) == ["attn_softmax"]


@pytest.mark.parametrize("mask_type", [TensorProto.FLOAT, TensorProto.BOOL])
def test_masked_attention_is_written_out_with_the_same_answers_and_a_boolean_mask_left_alone(mask_type):
    """Swin's case (an additive float mask): MatMul, Add, Softmax, MatMul for ORT's CUDA kernels. A boolean
    mask (keep or drop) is not an addition, so that Attention stays as it is."""
    shape, f = [2, 3, 5, 4], TensorProto.FLOAT
    inputs = [helper.make_tensor_value_info(n, f, shape) for n in "qkv"]
    inputs.append(helper.make_tensor_value_info("mask", mask_type, [1, 3, 5, 5]))
    node = helper.make_node("Attention", ["q", "k", "v", "mask"], ["o"])
    graph = helper.make_graph([node], "g", inputs, [helper.make_tensor_value_info("o", f, shape)])
    original = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)], ir_version=10)
    rewritten = onnx_ir.from_proto(original)
    made = masked_attention_as_matmuls.apply_to_model(rewritten)
    rng = np.random.default_rng(0)
    feeds = {n: rng.standard_normal(shape, np.float32) for n in "qkv"}
    feeds["mask"] = (rng.standard_normal([1, 3, 5, 5], np.float32) if mask_type == TensorProto.FLOAT
                     else rng.random([1, 3, 5, 5]) > 0.3)
    run = {name: ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)[0]
           for name, model in (("original", original), ("rewritten", onnx_ir.to_proto(rewritten)))}
    assert made == (1 if mask_type == TensorProto.FLOAT else 0)
    np.testing.assert_allclose(run["rewritten"], run["original"], atol=1e-6)


@functools.cache
def swin_export(img_size: int) -> onnx.ModelProto:
    """The biased micro Swin's graph at this size, exported once for every rewrite tried on it."""
    return onnx_ir.to_proto(export_program(MainGraph(export_form(with_biases(MICRO["swin"], img_size=img_size))),
                                           img_size))


# 104 px: 26, 13, 7 tokens a side, so windows of 6 are padded and so is the second merging's grid (not a
# reshape); 16 px: a last stage of one token, padded to 8 positions
@pytest.mark.parametrize(("rewrite", "made"), [
    # every window's heads as one MultiHeadAttention with the masks as its attention bias, each window's 36
    # positions padded to 40; not the last block: its q and k give the map
    ("window attention as MultiHeadAttention", {96: 5, 104: 5, 16: 5}),
    # each merging that is a reshape: its residual sum moved after it (with the MLP's bias tiled)
    ("sum before patch merging", {96: 2, 104: 1, 16: 2})])
@pytest.mark.parametrize("img_size", [96, 104, 16])
def test_swin_rewrites_give_the_same_answers(rewrite, made, img_size, tmp_path):
    """Each Swin rewrite alone: the same outputs as the graph unfused, shifted and padded windows included, for
    biases that are not zero."""
    images = np.random.default_rng(0).integers(0, 256, (2, img_size, img_size, 3), dtype=np.uint8)
    runs = {}
    for name, without in (("unfused", tuple(REWRITES)), ("rewritten", tuple(r for r in REWRITES if r != rewrite))):
        graph = onnx_ir.from_proto(swin_export(img_size))  # a fresh copy: the fusions rewrite it in place
        counts = fuse_for_ort(graph, without)
        save_graph(graph, tmp_path / f"{name}.onnx")
        runs[name] = ort.InferenceSession(tmp_path / f"{name}.onnx", providers=["CPUExecutionProvider"]).run(
            None, graph_inputs(images))
    assert counts == {rewrite: made[img_size]}
    for want, got in zip(runs["unfused"], runs["rewritten"]):
        np.testing.assert_allclose(got, want, atol=1e-5)


def test_swin_keys_are_padded_to_a_multiple_of_8_with_the_same_answers(repo, tmp_path):
    """36 keys a window -> 40 (cuBLAS's aligned kernels), the padding masked out: the same outputs. The last
    block keeps its keys: they also give the attention map."""
    model = models.create_model(MICRO["swin"])
    model.load_state_dict(load_file(repo / "swin.safetensors"))
    graph = export_program(MainGraph(export_form(model)), 96)
    assert fuse_for_ort(graph, without=tuple(r for r in REWRITES if r != "aligned keys")) == {
        "aligned keys": BLOCKS["swin"] - 1}
    assert [n.inputs[1].shape[2] for n in graph.graph if n.op_type == "Attention"] == [40] * 5 + [36]
    save_graph(graph, tmp_path / "aligned.onnx")
    images = np.random.default_rng(0).integers(0, 256, (3, 96, 96, 3), dtype=np.uint8)
    runs = [ort.InferenceSession(path, providers=["CPUExecutionProvider"]).run(None, graph_inputs(images))
            for path in (repo / "swin" / "model.onnx", tmp_path / "aligned.onnx")]
    for want, got in zip(*runs):
        np.testing.assert_allclose(got, want, atol=1e-6)


@pytest.fixture(scope="module")
def int8_export(repo, tmp_path_factory):
    """The random-init ViT exported in int8, gated on 24 synthetic held-out images: the folder it was written to."""
    out = tmp_path_factory.mktemp("int8")
    synthetic.main(["shapes", "--out", str(out / "data"), "--train", "0", "--val", "24", "--workers", "1"])
    export_main([MICRO["vit"], "--weights", str(repo / "vit.safetensors"), "--precision", "int8", "--name", "vit-int8",
                 "--eval-data", str(out / "data" / "val"), "--out", str(out), "--no-explain"])
    return out


def test_int8_export_is_gated_on_held_out_images(int8_export):
    m = json.loads((int8_export / "vit-int8" / "manifest.json").read_text())
    assert m["precision"] == "int8" and m["providers"] == ["CPUExecutionProvider"]
    assert m["op_counts"]["Attention"] == 4 and m["op_counts"].get("DynamicQuantizeLinear", 0) > 0
    int8 = m["parity"]["int8"]
    assert int8["agreement_on"] == "heldout" and int8["inputs"]["heldout"]["images"] == 24
    assert int8["top1_agreement"] >= 0.99 and 0 <= int8["heldout_accuracy"] <= 1


def test_auto_lists_the_cpu_plans_that_pass_their_gate_each_with_its_figures(repo, int8_export, tmp_path):
    """--precision auto: the fp32 graph first, then each CPU plan gated against it on held-out images (OpenVINO's
    bf16 only where this CPU computes it, refused with why elsewhere), and the int8 graph they share beside it."""
    export_main([MICRO["vit"], "--weights", str(repo / "vit.safetensors"), "--precision", "auto", "--name", "vit",
                 "--eval-data", str(int8_export / "data" / "val"), "--out", str(tmp_path), "--no-explain"])
    m = json.loads((tmp_path / "vit" / "manifest.json").read_text())
    assert m["precision"] == "fp32" and set(m["files"]) == {"model", "model_int8"}
    assert m["plans"][0] == {"runtime": "onnxruntime", "precision": "fp32", "file": "model"}
    found = {(p["runtime"], p["precision"]) for p in m["plans"]} | {(r["runtime"], r["precision"])
                                                                    for r in m.get("plans_refused", [])}
    assert found == {(runtime, precision) for runtime in ("onnxruntime", "openvino") for precision in
                     ("fp32", "bf16", "int8")} - {("onnxruntime", "bf16")}
    for plan in m["plans"][1:]:
        gate = plan["parity"]
        assert gate["agreement_on"] == "heldout" and gate["top1_agreement"] >= 0.99, plan
    assert all(r["reason"] for r in m.get("plans_refused", []))
    assert read_entry(tmp_path / "vit").precision == "fp32"


def test_int8_weights_fit_the_avx2_kernels_int16_pair_sums(int8_export):
    """7-bit weights: on an AVX2 CPU without VNNI, ONNX Runtime sums two u8 x s8 products in a saturating int16,
    and 2 * 255 * 64 fits where 2 * 255 * 127 does not (export/precision.py)."""
    graph = onnx.load(int8_export / "vit-int8" / "model.onnx")
    weights = [numpy_helper.to_array(t) for t in graph.graph.initializer
               if t.data_type == TensorProto.INT8 and t.name.endswith("_quantized")]
    assert len(weights) == sum(n.op_type == "MatMulInteger" for n in graph.graph.node) == 19  # all but q·k's
    low, high = INT8_WEIGHT_RANGE
    assert 2 * 255 * max(-low, high) <= np.iinfo(np.int16).max
    assert all(low <= w.min() and w.max() <= high for w in weights)


@pytest.mark.skipif(isa.emulator() is None, reason=f"{isa.QEMU} is not installed (apt-get install qemu-user)")
def test_int8_graph_passes_its_gate_on_a_cpu_with_avx2_and_no_vnni(repo, int8_export):
    """The int8 gate as an AVX2-only CPU runs it (qemu-x86_64 -cpu Haswell, export/isa.py). 8-bit weights passed it
    here (AVX-512 VNNI) and failed it there: top-1 agreement 0.542, as on an AVX2-only CI host."""
    assert isa.saturates(), f"ONNX Runtime under {isa.QEMU} -cpu {isa.AVX2_ONLY} did not take its AVX2 u8 x s8 " \
                            "kernel (qemu >= 7.2 emulates AVX2): this test would show nothing"
    # 8 of the held-out images: each costs about 1.6 s emulated, and 8-bit weights' 0.542 agreement fails 8 of them
    # as surely as 24 (all 8 agreeing by chance: 0.7%)
    images = gate_inputs(models.get_spec(MICRO["vit"]), int8_export / "data" / "val").heldout.numpy()[:8]
    want = isa.logits(repo / "vit" / "model.onnx", images)  # fp32: 2.5e-7 from its run under qemu
    got, = isa.emulated_logits([int8_export / "vit-int8" / "model.onnx"], images, timeout=300)
    assert (got.argmax(1) == want.argmax(1)).mean() >= MIN_TOP1_AGREEMENT


def test_failures_are_clear_and_leave_nothing_behind(repo, tmp_path, capsys):
    out = tmp_path / "repo"
    with pytest.raises(SystemExit, match="unknown model 'vit_huge'"):
        export_main(["vit_huge", "--random-init", "--out", str(out)])
    with pytest.raises(SystemExit, match="pass --weights PATH, or --random-init"):
        export_main([MICRO["vit"], "--out", str(out)])
    with pytest.raises(SystemExit, match="does not fit swin_micro_patch4_window6_96"):
        export_main([MICRO["swin"], "--weights", str(repo / "vit.safetensors"), "--out", str(out)])
    labels = tmp_path / "labels.txt"
    labels.write_text("cat\ndog\nfox\n")
    three = [MICRO["vit"], "--weights", str(repo / "vit.safetensors"), "--labels", str(labels), "--out", str(out)]
    with pytest.raises(SystemExit, match="classifier has 6 classes, the model 3; pass --replace-head"):
        export_main(three)
    assert list(out.iterdir()) == []  # no half-written model folder, hidden or not
    (tmp_path / "a-file").write_text("")
    with pytest.raises(SystemExit, match="cannot write to"):
        export_main([MICRO["vit"], "--random-init", "--out", str(tmp_path / "a-file" / "repo")])
    export_main(three + ["--replace-head", "--name", "three", "--no-explain"])  # the backbone, a new classifier
    assert manifest(out, "three")["labels"] == ["cat", "dog", "fox"]


def test_versions_go_into_numbered_folders_and_never_mix_with_a_flat_one(repo, tmp_path):
    out = tmp_path / "repo"
    vit = [MICRO["vit"], "--weights", str(repo / "vit.safetensors"), "--no-explain", "--out", str(out)]
    export_main(vit + ["--name", "v", "--version", "next"])
    assert json.loads((out / "v" / "1" / "manifest.json").read_text())["version"] == 1
    assert read_entry(out / "v" / "1").version == 1
    assert target_folder(out, "v", "next") == (out / "v" / "2", 2)
    assert target_folder(out, "v", "7") == (out / "v" / "7", 7)
    with pytest.raises(SystemExit, match="holds versions 1: pass --version next"):
        export_main(vit + ["--name", "v"])  # a flat export would delete the versions
    (out / "flat").mkdir()
    (out / "flat" / "manifest.json").write_text("{}")
    with pytest.raises(SystemExit, match="is a flat folder"):
        export_main(vit + ["--name", "flat", "--version", "next"])
    with pytest.raises(SystemExit):
        export_main(vit + ["--name", "v", "--version", "0"])
    assert sorted(p.name for p in (out / "v").iterdir()) == ["1"]  # nothing half-written beside it
