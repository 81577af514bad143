"""The embedded CLIP (models/shapes_clip.py, docs/models.md#the-embedded-clip): its captions say what the generator
drew; its folder is a CLIPModel that transformers loads and that answers as the committed graphs answer; a real server
names held-out shapes by the six class names given as labels, and finds them by their captions; and its training
command writes a folder that the export takes."""
import io
import json

import httpx
import numpy as np
import onnxruntime as ort
import pytest
import torch
import transformers
from PIL import Image
from service_process import ROOT, running_service
from tokenizers import Tokenizer

from export.__main__ import main as export_main
from export.manifest import sha256
from models.hf_clip import TEMPLATE, token_ids
from models.labels import SHAPE_LABELS
from models.shapes_clip import Shape, _render, caption
from models.shapes_clip import main as train_main
from repository import graph_inputs

FOLDER = ROOT / "models" / "demo" / "shapes-clip"
ENTRY = ROOT / "model_repository" / "shapes-clip"
HELD_OUT = [_render(1, i) for i in range(24)]  # data/shapes/val's first: seed 1


def png(image: np.ndarray) -> bytes:
    out = io.BytesIO()
    Image.fromarray(image).save(out, "PNG")
    return out.getvalue()


@pytest.mark.parametrize("shape, keep, text", [
    (Shape(3, (2, 3, 28, 28), (0.5, 0.05, 0.05)), (True, True, True), "a photo of a small red star in the top left."),
    (Shape(3, (2, 3, 28, 28), (0.5, 0.05, 0.05)), (False, False, False), "a photo of a star."),
    (Shape(5, (30, 30, 40, 40), (0.05, 0.05, 0.25)), (True, True, True),
     "a photo of a large dark blue heart in the middle."),
    (Shape(0, (70, 30, 34, 34), (0.3, 0.3, 0.32)), (True, True, True), "a photo of a grey circle on the right."),
    (Shape(1, (60, 62, 20, 20), (0.1, 0.1, 0.1)), (False, True, True),
     "a photo of a black square in the bottom right."),
    (Shape(2, (35, 0, 26, 26), (0.1, 0.5, 0.1)), (True, False, True), "a photo of a small triangle at the top."),
], ids=["all", "none", "large-dark", "grey-side", "black-corner", "no-colour"])
def test_a_caption_says_the_shapes_size_colour_and_position(shape, keep, text):
    assert caption(shape, keep) == text


@pytest.fixture(scope="module")
def reference():
    return (transformers.CLIPModel.from_pretrained(FOLDER).eval(), transformers.CLIPTokenizer.from_pretrained(FOLDER),
            transformers.CLIPImageProcessor.from_pretrained(FOLDER))


def test_the_folder_is_a_clipmodel_answering_as_the_committed_graphs(reference):
    """transformers loads the committed folder as a CLIPModel; the exported graphs' image and text embeddings are its
    get_image_features and get_text_features on its own processor's pixels and tokenizer's ids."""
    model, tokenizer, processor = reference
    manifest = json.loads((ENTRY / "manifest.json").read_text())
    assert manifest["source"]["sha256"] == {"model.safetensors": sha256(FOLDER / "model.safetensors")}
    texts = [caption(shape) for _, shape in HELD_OUT] + [TEMPLATE.format(label) for label in SHAPE_LABELS]
    texts += ["A LARGE Purple Cross, bottom-left!", "crème brûlée 🐱", "", "word " * 60]
    assert token_ids(Tokenizer.from_file(str(ENTRY / "tokenizer.json")), texts) == tokenizer(
        texts, truncation=True, max_length=manifest["text"]["context_length"])["input_ids"]
    pixels = processor([Image.fromarray(image) for image, _ in HELD_OUT], return_tensors="pt")["pixel_values"]
    ids = tokenizer(texts, padding=True, truncation=True, max_length=manifest["text"]["context_length"],
                    return_tensors="pt")
    with torch.no_grad():
        want_images = model.get_image_features(pixel_values=pixels).pooler_output.numpy()
        want_texts = model.get_text_features(**ids).pooler_output.numpy()
    images = ort.InferenceSession(ENTRY / "model.onnx", providers=["CPUExecutionProvider"]).run(
        ["embeddings"], graph_inputs(pixels.numpy()))[0]
    text = ort.InferenceSession(ENTRY / "text.onnx", providers=["CPUExecutionProvider"])
    got_texts = text.run(None, {manifest["text"]["input"]: ids["input_ids"].numpy()})[0]
    np.testing.assert_allclose(images, want_images, atol=1e-4, rtol=0)
    np.testing.assert_allclose(got_texts, want_texts, atol=1e-4, rtol=0)
    summary = json.loads((FOLDER / "summary.json").read_text())
    assert summary["command"].startswith("python -m models.shapes_clip")
    assert summary["held_out"]["images"] == 1200 and summary["held_out"]["zero_shot_accuracy"] >= 0.9


def test_a_server_names_held_out_shapes_and_finds_them_by_caption():
    """Zero-shot /classify with the six class names names the held-out shapes; and a caption's /v1/embeddings text
    vector is nearer its own image's /embed vector than most of the others'."""
    files = [("files", (f"{i}.png", png(image))) for i, (image, _) in enumerate(HELD_OUT)]
    with running_service() as url:
        answer = httpx.post(f"{url}/classify", params={"model": "shapes-clip", "labels": list(SHAPE_LABELS)},
                            files=files, timeout=120)
        assert answer.status_code == 200, answer.text
        named = [result["predictions"][0]["label"] for result in answer.json()["results"]]
        right = sum(name == SHAPE_LABELS[shape.label] for name, (_, shape) in zip(named, HELD_OUT))
        assert right >= 21, named  # 98% held out: 23.5 of 24 expected
        images = httpx.post(f"{url}/embed", params={"model": "shapes-clip"}, files=files, timeout=120)
        assert images.status_code == 200, images.text
        texts = httpx.post(f"{url}/v1/embeddings", json={"model": "shapes-clip",
                                                         "input": [caption(s) for _, s in HELD_OUT]}, timeout=120)
        assert texts.status_code == 200, texts.text
    image_vectors = np.array([r["embedding"] for r in images.json()["results"]])
    text_vectors = np.array([d["embedding"] for d in texts.json()["data"]])
    cos = (text_vectors / np.linalg.norm(text_vectors, axis=1, keepdims=True)) @ (
        image_vectors / np.linalg.norm(image_vectors, axis=1, keepdims=True)).T
    ranks = (cos > cos.diagonal()[:, None]).sum(1)  # images nearer a caption than its own
    assert np.median(ranks) <= 3, ranks


def test_the_training_command_writes_a_folder_that_the_export_takes(tmp_path):
    train_main(["--out", str(tmp_path / "clip"), "--images", "64", "--val", "12", "--epochs", "1",
                "--batch-size", "32"])
    summary = json.loads((tmp_path / "clip" / "summary.json").read_text())
    assert summary["held_out"]["images"] == 12 and 0 <= summary["held_out"]["zero_shot_accuracy"] <= 1
    assert summary["image_tower"]["sha256"] == sha256(ROOT / "models/demo/vit_micro_patch8_96/model.safetensors")
    export_main([str(tmp_path / "clip"), "--out", str(tmp_path / "repository"), "--no-explain"])
    manifest = json.loads((tmp_path / "repository" / "clip" / "manifest.json").read_text())
    assert manifest["task"] == "embedding" and manifest["text"]["template"] == TEMPLATE
