"""Hugging Face embedding folders (models/hf_folder.py; docs/export.md, "Embedding folders"): tiny random base ViT,
DeiT and Swin, DINOv2 with and without registers and CLIP's image tower (with and without its projection), made and
saved by transformers itself, each exported once with `python -m export FOLDER` into one repository (`embedding_repo`),
and answered as transformers answers: its embedding of its own processor's pixels through our graph, and of a real
photo through our decode. transformers is a test dependency only: the converter reads the folder without it."""
import dataclasses
import io
import json
import re
import shutil
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import NamedTuple

import httpx
import numpy as np
import onnxruntime as ort
import pytest
import torch
import transformers
from PIL import Image
from safetensors.torch import load_file, save_file
from service_process import photo_bytes, running_service

from export.__main__ import main as export_main
from export.parity import MIN_EMBEDDING_COSINE, ParityError, check_reduced, gate_inputs
from export.precision import quantize_int8
from models import WeightsError
from models.hf_folder import CLIP_MEAN, CLIP_STD, interpolated_pos_embed, read_folder
from repository import InputPolicy, graph_inputs
from service.images.decode import upload_input

PHOTOS = ("chelsea", "astronaut", "coffee")
ATOL, MIN_COSINE = 1e-4, 0.99999
IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
IMAGENET = {"image_mean": list(IMAGENET_MEAN), "image_std": list(IMAGENET_STD)}
VIT = {"image_size": 32, "patch_size": 8, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4}
# DINOv2 as its Hub folders have it, shrunk: trained at a larger size (518, here 56) than it serves (the processor's
# crop: 224, here 32), so that the position embedding is resized, downwards, where antialias counts
DINOV2 = {**VIT, "image_size": 56}
BIT = transformers.BitImageProcessor(size={"shortest_edge": 37}, crop_size={"height": 32, "width": 32}, **IMAGENET)
REGISTERS = 2


def _cls(out) -> torch.Tensor:
    return out.last_hidden_state[:, 0]


def _linear_probe(registers: int) -> Callable:
    """DINOv2's linear-probe feature: [CLS] and the mean of the patch tokens (the registers left out)."""
    return lambda out: torch.cat([out.last_hidden_state[:, 0], out.last_hidden_state[:, 1 + registers:].mean(1)], 1)


class Folder(NamedTuple):
    model: type
    config: transformers.PretrainedConfig
    processor: object
    embedding: Callable  # transformers' output -> the embedding we must answer


FOLDERS = {
    "vit": Folder(transformers.ViTModel, transformers.ViTConfig(**VIT, intermediate_size=64),
                  transformers.ViTImageProcessor(size={"height": 32, "width": 32}), lambda out: out.pooler_output),
    "deit": Folder(transformers.DeiTModel, transformers.DeiTConfig(**VIT, intermediate_size=64),
                   transformers.DeiTImageProcessor(size={"height": 37, "width": 37}, crop_size=32),
                   lambda out: out.pooler_output),
    "swin": Folder(transformers.SwinModel,
                   transformers.SwinConfig(image_size=32, patch_size=4, embed_dim=16, depths=[2, 2], num_heads=[2, 4],
                                           window_size=4),
                   transformers.ViTImageProcessor(size={"height": 32, "width": 32}, resample=3),
                   lambda out: out.pooler_output),
    "dinov2": Folder(transformers.Dinov2Model, transformers.Dinov2Config(**DINOV2), BIT, _cls),
    "dinov2-registers": Folder(transformers.Dinov2WithRegistersModel,
                               transformers.Dinov2WithRegistersConfig(**DINOV2, num_register_tokens=REGISTERS), BIT,
                               _cls),
    "clip-projection": Folder(transformers.CLIPVisionModelWithProjection,
                              transformers.CLIPVisionConfig(**VIT, intermediate_size=64, projection_dim=16),
                              transformers.CLIPImageProcessor(size={"shortest_edge": 32},
                                                              crop_size={"height": 32, "width": 32}),
                              lambda out: out.image_embeds),
    "clip": Folder(transformers.CLIPVisionModel,  # a gelu (erf) CLIP, as some converted towers are
                   transformers.CLIPVisionConfig(**VIT, intermediate_size=64, hidden_act="gelu"),
                   transformers.CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}),
                   lambda out: out.pooler_output),
}


def save_folder(folder: Path, name: str) -> None:
    """A transformers model of FOLDERS[name] with random weights large enough that the photos' embeddings differ by
    far more than the tolerance (asserted below), biases and embeddings small, saved by transformers with its image
    processor."""
    cls, config, processor, _ = FOLDERS[name]
    model = cls(config)
    generator = torch.Generator().manual_seed(len(name))
    with torch.no_grad():
        for key, p in model.named_parameters():
            p.copy_(torch.randn(p.shape, generator=generator) * (0.05 if "embedding" in key or "bias" in key else 0.3))
    model.save_pretrained(folder)
    processor.save_pretrained(folder)


@pytest.fixture(scope="module")
def embedding_repo(tmp_path_factory) -> tuple[Path, dict[str, Path]]:
    """Every folder of FOLDERS saved under root/hf and exported (main graph only) into the repository root/repository:
    (the repository, name -> its folder)."""
    root = tmp_path_factory.mktemp("hf-embeddings")
    folders = {name: root / "hf" / name for name in FOLDERS}
    for name, folder in folders.items():
        save_folder(folder, name)
        export_main([str(folder), "--out", str(root / "repository"), "--no-explain"])
    return root / "repository", folders


@cache
def transformers_model(folder: Path) -> tuple[torch.nn.Module, object]:
    """The folder's model (its own class: AutoModel would drop CLIP's projection) and image processor."""
    model = FOLDERS[folder.name].model.from_pretrained(folder, dtype=torch.float32).eval()
    return model, transformers.AutoImageProcessor.from_pretrained(folder)


def transformers_embedding(folder: Path, pixel_values: np.ndarray) -> np.ndarray:
    return FOLDERS[folder.name].embedding(transformers_output(folder, pixel_values)).numpy()


def transformers_output(folder: Path, pixel_values: np.ndarray):
    with torch.no_grad():
        return transformers_model(folder)[0](pixel_values=torch.from_numpy(pixel_values))


def processor_pixels(folder: Path, jpegs: list[bytes]) -> np.ndarray:
    """transformers' processor's pixel_values of the photos, decoded by Pillow at full size as transformers users do."""
    photos = [Image.open(io.BytesIO(jpeg)).convert("RGB") for jpeg in jpegs]
    return transformers_model(folder)[1](photos, return_tensors="np")["pixel_values"]


def jpegs() -> list[bytes]:
    return [photo_bytes(photo, "JPEG", quality=90) for photo in PHOTOS]


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    """The least cosine similarity between the rows of a and b."""
    a, b = a.astype(np.float64), b.astype(np.float64)
    return float(((a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))).min())


def session(repo: Path, name: str) -> ort.InferenceSession:
    return ort.InferenceSession(repo / name / "model.onnx", providers=["CPUExecutionProvider"])


def embed(repo: Path, name: str, x: np.ndarray) -> np.ndarray:
    return session(repo, name).run(["embeddings"], graph_inputs(x))[0]


def manifest(repo: Path, name: str) -> dict:
    return json.loads((repo / name / "manifest.json").read_text())


def test_an_embedding_folders_fp16_export_is_gated_by_its_embeddings_where_it_runs(tmp_path):
    """An embedding model has no logits: its fused fp32 graph and its fp16 graph are gated by their embeddings, here
    on the CPU (tests/test_gpu.py runs the same on CUDA, where this export first failed, on the missing logits)."""
    save_folder(tmp_path / "dinov2", "dinov2")
    export_main([str(tmp_path / "dinov2"), "--precision", "fp16", "--out", str(tmp_path), "--no-explain"])
    parity = manifest(tmp_path, "dinov2-fp16")["parity"]
    assert parity["fused_fp32"]["embeddings_max_abs_diff"] < ATOL and "logits_max_abs_diff" not in parity["fused_fp32"]
    assert parity["fp16"]["embeddings_min_cosine"] >= MIN_EMBEDDING_COSINE, parity["fp16"]


@pytest.mark.parametrize("name", FOLDERS)
def test_a_base_folder_is_exported_as_an_embedding_model(embedding_repo, name):
    repo, _ = embedding_repo
    found = manifest(repo, name)
    size = {"clip-projection": 16}.get(name, 32)
    assert found["task"] == "embedding" and found["labels"] == []
    assert found["embedding"]["output"] == "embeddings" and found["embedding"]["size"] == size
    attention = {"swin": ["attention"], "deit": ["cls_attention", "dist_attention"]}.get(name, ["cls_attention"])
    assert [o["name"] for o in found["outputs"]] == ["embeddings", *attention]
    assert all(o["shape"][-1] == 16 for o in found["outputs"][1:])  # a 4 x 4 grid: no register among the columns
    assert found["source"]["huggingface"]["architectures"] == [FOLDERS[name].model.__name__]


@pytest.mark.parametrize("name", FOLDERS)
def test_the_graph_embeds_the_processors_pixels_as_transformers_does(embedding_repo, name):
    repo, folders = embedding_repo
    pixel_values = processor_pixels(folders[name], jpegs())
    want = transformers_embedding(folders[name], pixel_values)
    got = embed(repo, name, pixel_values)
    np.testing.assert_allclose(got, want, atol=ATOL, rtol=0)
    assert cosine(got, want) >= MIN_COSINE
    assert np.abs(got[0] - got[1]).max() > 100 * ATOL  # the photos differ in it: the check has teeth


@pytest.mark.parametrize("name", ["dinov2", "dinov2-registers"])
def test_dinov2s_embedding_is_transformers_pooler_output_its_final_norm_cls(embedding_repo, name):
    repo, folders = embedding_repo
    pixel_values = processor_pixels(folders[name], jpegs())
    out = transformers_output(folders[name], pixel_values)
    got = embed(repo, name, pixel_values)
    np.testing.assert_allclose(got, out.pooler_output.numpy(), atol=ATOL, rtol=0)
    np.testing.assert_allclose(got, out.last_hidden_state[:, 0].numpy(), atol=ATOL, rtol=0)


@pytest.mark.parametrize("name,pooling,pooled", [
    ("dinov2-registers", "cls+mean", _linear_probe(REGISTERS)), ("vit", "cls", _cls),
    ("vit", "mean", lambda out: out.last_hidden_state[:, 1:].mean(1)),
    ("deit", "pooler", lambda out: out.pooler_output)])
def test_pooling_chooses_another_embedding_and_the_manifest_says_which(tmp_path, embedding_repo, name, pooling,
                                                                        pooled):
    """--pooling in place of the model's own: the linear probes' [CLS] and patch mean of DINOv2, a ViT's [CLS] or its
    patch tokens' mean where its own is the pooler's, and the pooler named where it is the model's own anyway."""
    _, folders = embedding_repo
    export_main([str(folders[name]), "--out", str(tmp_path), "--no-explain", "--pooling", pooling])
    pixel_values = processor_pixels(folders[name], jpegs())
    got, want = embed(tmp_path, name, pixel_values), pooled(transformers_output(folders[name], pixel_values)).numpy()
    np.testing.assert_allclose(got, want, atol=ATOL, rtol=0)
    assert manifest(tmp_path, name)["embedding"]["size"] == want.shape[1]
    assert manifest(tmp_path, name)["embedding"]["pooling"] == {
        "cls+mean": "final-norm [CLS] token and the mean of the final-norm patch tokens, concatenated",
        "cls": "final-norm [CLS] token", "mean": "mean of the final-norm patch tokens",
        "pooler": "the pooler (a linear map and tanh) on the final-norm [CLS] token"}[pooling]


@pytest.mark.parametrize("name,pooling,refusal", [
    ("swin", "cls", "Swin has no [CLS] token"), ("dinov2", "pooler", "the folder has no pooler"),
    ("clip-projection", "mean", "CLIP's visual projection reads the final-norm [CLS] alone")])
def test_a_pooling_the_folder_cannot_make_is_refused_saying_why(tmp_path, embedding_repo, name, pooling, refusal):
    with pytest.raises(SystemExit, match=re.escape(refusal)):
        export_main([str(embedding_repo[1][name]), "--out", str(tmp_path), "--no-explain", "--pooling", pooling])
    assert not list(tmp_path.iterdir())  # nothing written


@pytest.mark.parametrize("name", ["dinov2", "dinov2-registers"])
def test_the_position_embedding_is_resized_as_transformers_resizes_it(embedding_repo, name):
    _, folders = embedding_repo
    embeddings = transformers_model(folders[name])[0].embeddings
    theirs = embeddings.interpolate_pos_encoding(torch.zeros(1, 1 + 16, 32), 32, 32)
    pos = embeddings.position_embeddings.detach()
    ours = interpolated_pos_embed(pos, 4, antialias=name == "dinov2-registers")
    assert torch.equal(ours, theirs)
    # the other model's resize (with antialias or without) is far from it
    assert (interpolated_pos_embed(pos, 4, antialias=name != "dinov2-registers") - theirs).abs().max() > 1e-3


@pytest.mark.parametrize("name", ["deit", "dinov2-registers", "clip-projection"])
def test_the_attention_rows_are_transformers_class_token_rows_over_the_patches(embedding_repo, name):
    """The last block's [CLS] (and distillation token) row of transformers' attention probabilities, without the
    prefix tokens' columns (the registers' among them)."""
    repo, folders = embedding_repo
    pixel_values = processor_pixels(folders[name], jpegs())
    model = FOLDERS[name].model.from_pretrained(folders[name], dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        probs = model.eval()(pixel_values=torch.from_numpy(pixel_values), output_attentions=True).attentions[-1]
    graph = session(repo, name)
    rows = [o.name for o in graph.get_outputs()][1:]
    prefix = {"deit": 2, "dinov2-registers": 1 + REGISTERS}.get(name, 1)
    for row, got in zip(rows, graph.run(rows, graph_inputs(pixel_values)), strict=True):
        np.testing.assert_allclose(got, probs[:, :, rows.index(row), prefix:].numpy(), atol=1e-6, rtol=0)


# A shortest_edge processor (DINOv2's BitImageProcessor, CLIP's) resizes the photo at full size with Pillow to a long
# side of int(short_edge * long / short), then crops at ((W - w) // 2, (H - h) // 2): the manifest's processor_resize,
# which the service follows step by step (a rounded long side and a draft-reduced decode were tens of levels off)
@pytest.mark.parametrize("name", FOLDERS)
def test_a_photo_through_our_decode_embeds_as_through_transformers_processor(embedding_repo, name):
    repo, folders = embedding_repo
    found = manifest(repo, name)
    policy = InputPolicy.from_manifest(found["input"])
    photos = jpegs()
    pixel_values = processor_pixels(folders[name], photos)
    want = transformers_embedding(folders[name], pixel_values)
    ours = np.stack([upload_input(jpeg, policy, 10**8) for jpeg in photos])
    theirs = np.rint((pixel_values.transpose(0, 2, 3, 1) * policy.std + policy.mean) * 255)
    got = embed(repo, name, ours)
    np.testing.assert_allclose(got, want, atol=ATOL, rtol=0)
    assert cosine(got, want) >= MIN_COSINE
    # the input is the processor's, far nearer to it than a resize with another filter or a normalisation with
    # another mean and std, each of which moves the embedding by far more than the tolerance
    other = dataclasses.replace(policy, interpolation="bilinear" if policy.interpolation != "bilinear" else "bicubic")
    wrong_resize = np.stack([upload_input(jpeg, other, 10**8) for jpeg in photos])
    assert np.abs(ours - theirs).max() <= 1 < np.abs(wrong_resize - theirs).max()
    assert np.abs(embed(repo, name, wrong_resize) - want).max() > 10 * ATOL
    mean, std = (IMAGENET_MEAN, IMAGENET_STD) if policy.mean == CLIP_MEAN else (CLIP_MEAN, CLIP_STD)
    wrong_mean_std = ((ours / 255 - mean) / std).transpose(0, 3, 1, 2).astype(np.float32)
    assert np.abs(embed(repo, name, wrong_mean_std) - want).max() > 10 * ATOL


# one edit of a saved folder each, and the words its refusal must say
REFUSALS = [
    ("dinov2", "config.json", {"use_swiglu_ffn": True}, "use_swiglu_ffn = True"),
    ("dinov2", "config.json", {"hidden_act": "silu"}, "hidden_act = 'silu' in the folder's config: only gelu"),
    ("dinov2", "config.json", {"head_dim": 4}, "head_dim = 4"),
    ("dinov2-registers", "config.json", {"interpolate_offset": 0.1}, "interpolate_offset = 0.1"),
    ("dinov2", "preprocessor_config.json", {"crop_size": {"height": 36, "width": 36}},
     "patch_size = 8 in the folder's config: the processor's 36x36 images are not a whole number of patches"),
    ("clip", "config.json", {"hidden_act": "relu"},
     "hidden_act = 'relu' in the folder's config: only quick_gelu and gelu"),
    ("clip", "preprocessor_config.json", {"do_center_crop": False},
     "size = {'shortest_edge': 32} .*: a shortest_edge resize is served with a centre crop alone"),
    ("clip", "preprocessor_config.json", {"crop_size": {"height": 40, "width": 40}},
     "crop_size = \\(40, 40\\) .*larger than the shortest_edge 32"),
]


@pytest.mark.parametrize("name, file, change, words", REFUSALS)
def test_a_setting_that_cannot_be_served_exactly_is_refused_by_name(embedding_repo, tmp_path, name, file, change,
                                                                   words):
    folder = shutil.copytree(embedding_repo[1][name], tmp_path / name)
    (folder / file).write_text(json.dumps({**json.loads((folder / file).read_text()), **change}))
    with pytest.raises(WeightsError, match=words):
        read_folder(folder)


def test_a_dinov2_classifier_and_a_task_for_a_base_model_are_refused(embedding_repo, tmp_path):
    folder = shutil.copytree(embedding_repo[1]["dinov2"], tmp_path / "dinov2")
    weights = load_file(folder / "model.safetensors")
    save_file({**weights, "classifier.weight": torch.zeros(3, 64), "classifier.bias": torch.zeros(3)},
              folder / "model.safetensors")
    with pytest.raises(WeightsError, match="classifier.weight in a DINOv2 folder: Dinov2ForImageClassification"):
        read_folder(folder)
    with pytest.raises(WeightsError, match="--task expression: the folder holds a base model without a classifier"):
        read_folder(embedding_repo[1]["vit"], "expression")


def test_a_clip_tower_saved_with_its_vision_model_prefix_reads_the_same(embedding_repo, tmp_path):
    """transformers 4 saved CLIPVisionModel with the vision_model. prefix that transformers 5 leaves out."""
    folder = shutil.copytree(embedding_repo[1]["clip"], tmp_path / "clip")
    weights = load_file(folder / "model.safetensors")
    save_file({f"vision_model.{k}": v for k, v in weights.items()}, folder / "model.safetensors")
    want = read_folder(embedding_repo[1]["clip"]).state_dict
    got = read_folder(folder).state_dict
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


def test_the_folders_are_served_on_embed_as_transformers_embeds_the_jpeg(embedding_repo):
    """A real server on the exported folders: POST /embed of each JPEG (un-normalised, then normalised) is
    transformers' embedding of its processor's pixels of the same photos; an embedding model refuses /classify
    naming /embed, lists no labels, answers /v2 with the same vector, and still draws its attention map (but no
    relevance map: it has no labels to explain)."""
    repo, folders = embedding_repo
    photos = jpegs()
    with running_service(model_repository=repo) as url:
        for name, folder in folders.items():
            want = transformers_embedding(folder, processor_pixels(folder, photos))
            files = [("files", (f"{i}.jpg", jpeg)) for i, jpeg in enumerate(photos)]
            raw = httpx.post(f"{url}/embed", files=files, params={"model": name, "normalize": "false"}, timeout=60)
            assert raw.status_code == 200, raw.text
            got = np.array([r["embedding"] for r in raw.json()["results"]], np.float32)
            np.testing.assert_allclose(got, want, atol=ATOL, rtol=0)
            assert cosine(got, want) >= MIN_COSINE
            unit = httpx.post(f"{url}/embed", files=files, params={"model": name}, timeout=60).json()["results"]
            np.testing.assert_allclose([r["embedding"] for r in unit],
                                       want / np.linalg.norm(want, axis=1, keepdims=True), atol=1e-5)
        refused = httpx.post(f"{url}/classify", files={"file": ("a.jpg", photos[0])}, params={"model": "dinov2"},
                             timeout=30)
        assert refused.status_code == 400 and refused.json()["error"]["code"] == "embedding_model"
        assert "/embed" in refused.json()["error"]["message"]
        listed = {m["name"]: m for m in httpx.get(f"{url}/models", timeout=10).json()["models"]}
        assert listed["dinov2-registers"]["task"] == "embedding" and listed["dinov2-registers"]["labels"] == []
        assert listed["clip-projection"]["embedding"]["size"] == 16
        import tritonclient.http as triton  # here, not at the top: tests/test_gpu.py imports this file on a GPU host
        client = triton.InferenceServerClient(url=url.removeprefix("http://"))  # the processor's tensor over /v2
        pixel_values = processor_pixels(folders["clip-projection"], photos)
        tensor = triton.InferInput("pixel_values", list(pixel_values.shape), "FP32")
        tensor.set_data_from_numpy(pixel_values.astype(np.float32))
        answer = client.infer("clip-projection", [tensor], outputs=[triton.InferRequestedOutput("embeddings")])
        np.testing.assert_allclose(answer.as_numpy("embeddings"),
                                   transformers_embedding(folders["clip-projection"], pixel_values), atol=ATOL)
        drawn = httpx.post(f"{url}/attention-map", files={"file": ("a.jpg", photos[0])},
                           params={"model": "dinov2-registers"}, timeout=30)
        assert drawn.status_code == 200 and drawn.content.startswith(b"\x89PNG") and "x-prediction" not in drawn.headers
        why = httpx.post(f"{url}/attention-map", files={"file": ("a.jpg", photos[0])},  # no labels to explain
                         params={"model": "dinov2-registers", "method": "relevance"}, timeout=30)
        assert why.status_code == 400 and why.json()["error"]["code"] == "relevance_unavailable", why.text
        assert "no classifier" in why.json()["error"]["message"] and listed["dinov2-registers"]["relevance"] is None


def test_an_embedding_models_reduced_precision_gate_is_the_turn_of_its_embeddings(embedding_repo, tmp_path):
    """Without logits there are no decisions to agree on: a reduced-precision graph of an embedding model passes while
    every embedding stays within cosine 0.99 of fp32's (dynamic int8: about 0.997 here), and one that turns them further
    (the same graph with half of every vector negated) is refused."""
    repo, folders = embedding_repo
    fp32 = session(repo, "dinov2")
    quantize_int8(repo / "dinov2" / "model.onnx", tmp_path / "int8.onnx")
    inputs = gate_inputs(read_folder(folders["dinov2"]).spec)
    report = check_reduced(ort.InferenceSession(tmp_path / "int8.onnx", providers=["CPUExecutionProvider"]), fp32,
                           inputs)
    assert MIN_EMBEDDING_COSINE <= report["embeddings_min_cosine"] < 1 and "top1_agreement" not in report

    class Turned:  # fp32's own session, half of each embedding negated after it runs
        def __getattr__(self, name):
            return getattr(fp32, name)

        def run(self, names, feed):
            out = fp32.run(names, feed)
            out[0][:, ::2] *= -1
            return out

    with pytest.raises(ParityError, match="within cosine 0.99"):
        check_reduced(Turned(), fp32, inputs)
