"""A whole SigLIP folder (issue 76; models/hf_clip.py, models/hf_folder.py; docs/export.md, "A whole SigLIP"):
`python -m export FOLDER` writes its image tower (no [CLS], attention pooling) and its text tower (not causal, the
last position pooled, every text padded to the context length) with the folder's tokenizer.json, or one made from its
spiece.model as transformers' SiglipTokenizer tokenizes; the exported graphs and the served routes answer as
transformers' SiglipModel: token ids as the folder's own tokenizer pads them to max_length, text vectors as
get_text_features, image vectors as get_image_features, and zero-shot scores as logits_per_image.sigmoid().
transformers is a test dependency only."""
import io
import json
import shutil
from pathlib import Path

import httpx
import numpy as np
import onnxruntime as ort
import pytest
import torch
import transformers
from clip_folder import LABELS
from PIL import Image
from service_process import ROOT, photo_bytes, service_and_process, write_model
from siglip_folder import CONTEXT, save_siglip_folder
from test_hf_clip import PHOTOS, probe_texts
from tokenizers import Tokenizer

from export.__main__ import main as export_main
from models import WeightsError
from models.hf_clip import padded, read_text_tower, token_ids
from models.hf_folder import read_folder
from repository import graph_inputs

ATOL = 1e-4
LABEL_SETS = [["cat"], ["cat", "astronaut", "coffee"], ["tabby cat", "tiger cat", "Egyptian cat", "lynx", "dog"]]
JPEGS = [photo_bytes(p, "JPEG", quality=90) for p in PHOTOS]
QUIRKS = ["</s> inside", "a</s>b", "a </s> b", "<unk>", "x <unk>y", "( )", "(a) dog", " ( x", "-- -", "...",
          "▁", "▁▁ x", "no\xa0break", "\u3000ideographic", "\"quoted\" text", "UPPER-case_words"]


@pytest.fixture(scope="module", params=["tokenizer.json", "spiece.model"])
def siglip(request, tmp_path_factory) -> tuple[Path, Path]:
    """(the folder, with either kind of tokenizer, and a repository holding it exported as `siglip`, and shapes-vit,
    a classifier)."""
    root = tmp_path_factory.mktemp("hf-siglip")
    save_siglip_folder(root / "siglip", spiece=request.param == "spiece.model")
    export_main([str(root / "siglip"), "--out", str(root / "repository")])
    write_model(root / "repository" / "shapes-vit", ROOT / "model_repository" / "shapes-vit", "shapes-vit")
    return root / "siglip", root / "repository"


@pytest.fixture(scope="module")
def reference(siglip):
    folder = siglip[0]
    return (transformers.SiglipModel.from_pretrained(folder).eval(), transformers.AutoTokenizer.from_pretrained(folder),
            transformers.SiglipImageProcessorPil.from_pretrained(folder))


def hf_ids(tokenizer, texts: list[str]) -> list[list[int]]:
    """SigLIP's ids as transformers gives them to the model: truncated and padded to max_length."""
    return tokenizer(texts, padding="max_length", truncation=True, max_length=CONTEXT)["input_ids"]


def test_the_tokenizer_gives_the_folders_own_ids_padded_to_the_context(siglip, reference):
    """With a spiece.model, also SiglipTokenizer's quirks: special tokens inside a text, a leading space or
    punctuation, "▁" in the text, text that is all punctuation."""
    tower, texts = read_text_tower(siglip[0]), probe_texts() + QUIRKS
    assert len(texts) > 250
    got = padded(token_ids(tower.tokenizer, texts), tower.pad_id, CONTEXT)
    np.testing.assert_array_equal(got, np.array(hf_ids(reference[1], texts)))
    assert tower.pad_id == reference[1].pad_token_id
    exported = Tokenizer.from_file(str(siglip[1] / "siglip" / "tokenizer.json"))  # as the service reads it
    assert token_ids(exported, texts[:50]) == token_ids(tower.tokenizer, texts[:50])


def test_the_graphs_embed_as_get_text_features_and_get_image_features(siglip, reference):
    folder, repo = siglip
    model, tokenizer, processor = reference
    manifest = json.loads((repo / "siglip" / "manifest.json").read_text())
    text = manifest["text"]
    texts = probe_texts()
    with torch.no_grad():
        want = model.get_text_features(input_ids=torch.tensor(hf_ids(tokenizer, texts))).pooler_output.numpy()
    ids = padded(token_ids(read_text_tower(folder).tokenizer, texts), text["pad_id"], text["context_length"])
    got = ort.InferenceSession(repo / "siglip" / "text.onnx", providers=["CPUExecutionProvider"]).run(
        [text["output"]], {text["input"]: ids})[0]
    assert np.abs(want).max() > 100 * ATOL  # far from zero: the comparison means something
    np.testing.assert_allclose(got, want, atol=ATOL, rtol=0)
    pixels = processor([Image.open(io.BytesIO(j)).convert("RGB") for j in JPEGS], return_tensors="pt")["pixel_values"]
    with torch.no_grad():
        want = model.get_image_features(pixel_values=pixels).pooler_output.numpy()
    got = ort.InferenceSession(repo / "siglip" / "model.onnx", providers=["CPUExecutionProvider"]).run(
        ["embeddings"], graph_inputs(pixels.numpy()))[0]
    np.testing.assert_allclose(got, want, atol=ATOL, rtol=0)


def test_the_manifest_says_sigmoid_with_the_folders_scale_and_bias(siglip, reference):
    manifest = json.loads((siglip[1] / "siglip" / "manifest.json").read_text())
    model = reference[0]
    text = manifest["text"]
    assert manifest["task"] == "embedding" and manifest["source"]["huggingface"]["model_type"] == "siglip"
    assert text["scores"] == "sigmoid" and text["context_length"] == CONTEXT and text["template"].count("{}") == 1
    assert text["logit_scale"] == pytest.approx(model.logit_scale.exp().item(), rel=1e-6)
    assert text["logit_bias"] == pytest.approx(model.logit_bias.item(), rel=1e-6)
    assert text["size"] == manifest["embedding"]["size"] and "explain" not in manifest["files"]
    # the attention maps' row: attention pooling's query over the patches, [CLS]'s stand-in
    assert manifest["attention"]["outputs"] == {"cls": "cls_attention"}


@pytest.fixture(scope="module")
def server(siglip) -> str:
    """The service on the repository, under the process backend for the spiece.model folder and the thread backend
    for the other: every route under both backends, with no start more."""
    backend = "process" if (siglip[0] / "spiece.model").is_file() else "thread"
    with service_and_process(model_repository=siglip[1], default_model="siglip", max_queue_delay_ms=20,
                             backend=backend) as (url, _):
        yield url


@pytest.mark.parametrize("labels", LABEL_SETS, ids=lambda labels: f"{len(labels)}-labels")
def test_zero_shot_scores_are_siglips_sigmoid_of_the_same_prompts(server, reference, labels):
    """Each photo's scores, one label alone included (a sigmoid needs no other), equal logits_per_image.sigmoid()
    of transformers' SiglipModel on its processor's pixels of the same JPEGs and the model's default prompts."""
    model, tokenizer, processor = reference
    template = {m["name"]: m for m in httpx.get(f"{server}/models", timeout=10).json()["models"]}["siglip"]["text"][
        "template"]
    photos = [Image.open(io.BytesIO(j)).convert("RGB") for j in JPEGS]
    with torch.no_grad():
        want = model(input_ids=torch.tensor(hf_ids(tokenizer, [template.format(label) for label in labels])),
                     pixel_values=processor(photos, return_tensors="pt")["pixel_values"]
                     ).logits_per_image.sigmoid().numpy()
    answer = httpx.post(f"{server}/classify", params={"labels": labels, "top_k": 100}, timeout=60,
                        files=[("files", (f"{i}.jpg", j)) for i, j in enumerate(JPEGS)])
    assert answer.status_code == 200, answer.text
    assert answer.json()["scores"] == "sigmoid"
    for row, result in zip(want, answer.json()["results"]):
        got = {p["label"]: p["score"] for p in result["predictions"]}
        np.testing.assert_allclose([got[label] for label in labels], row, atol=ATOL, rtol=0)
    assert abs(want.sum(axis=1) - 1).max() > 0.05  # not a softmax: the scores are each label's own


def test_v1_embeddings_of_texts_are_get_text_features_unit_length(server, reference):
    model, tokenizer, _ = reference
    texts = ["a photo of a cat", "Tabby CAT!", "crème brûlée 🐱", "word " * 40]
    with torch.no_grad():
        want = model.get_text_features(input_ids=torch.tensor(hf_ids(tokenizer, texts))).pooler_output.numpy()
    answer = httpx.post(f"{server}/v1/embeddings", json={"model": "siglip", "input": texts}, timeout=60)
    assert answer.status_code == 200, answer.text
    got = np.array([d["embedding"] for d in answer.json()["data"]], np.float32)
    np.testing.assert_allclose(got, want / np.linalg.norm(want, axis=1, keepdims=True), atol=ATOL, rtol=0)


def test_maps_show_attention_poolings_query_and_rollout_is_refused(server):
    """Its `last` map is the pooling query's attention over the 4 x 4 patches; rollout (which follows a [CLS] row)
    is a 400 that names the method to use, and the server keeps serving."""
    answer = httpx.post(f"{server}/classify", params={"labels": ["cat"], "attention": "true"}, timeout=60,
                        files=[("file", ("0.jpg", JPEGS[0]))])
    url = f"{server}{answer.json()['results'][0]['attention_map_url']}"
    grid = httpx.get(f"{url}&format=json", timeout=60).json()
    assert grid["method"] == "last" and np.array(grid["grid"]).shape == (4, 4) and np.ptp(grid["grid"]) > 0
    refused = httpx.get(f"{url}&method=rollout", timeout=60)
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "rollout_unavailable"
    assert httpx.get(url, timeout=60).headers["content-type"] == "image/png"


@pytest.mark.parametrize("name, content, words", [
    ("spiece.model", b"\x0a\x05abc", "spiece.model: not a SentencePiece model"),
    ("tokenizer_config.json", {"tokenizer_class": "T5Tokenizer"}, "tokenizer_class = 'T5Tokenizer'"),
    ("tokenizer_config.json", {"additional_special_tokens": ["<x>"]}, "additional_special_tokens = \\['<x>'\\]"),
])
def test_a_spiece_model_that_cannot_be_converted_is_refused_by_name(tmp_path, name, content, words):
    save_siglip_folder(tmp_path / "siglip", spiece=True)
    path = tmp_path / "siglip" / name
    path.write_bytes(content) if isinstance(content, bytes) else path.write_text(json.dumps(content))
    with pytest.raises(WeightsError, match=words):
        read_text_tower(tmp_path / "siglip")


@pytest.mark.parametrize("change, words", [
    ({"text_config": {"hidden_act": "gelu"}}, "text_config.hidden_act = 'gelu'"),
    ({"model_type": "siglip2"}, "model_type 'siglip2'"),
    ({"drop": "logit_bias"}, "no head.weight, logit_scale or logit_bias"),
])
def test_a_siglip_folder_that_cannot_be_served_exactly_is_refused_by_name(siglip, tmp_path, change, words):
    folder = shutil.copytree(siglip[0], tmp_path / "siglip")
    config = json.loads((folder / "config.json").read_text())
    config["text_config"].update(change.get("text_config", {}))
    config["model_type"] = change.get("model_type", config["model_type"])
    (folder / "config.json").write_text(json.dumps(config))
    if "drop" in change:
        from safetensors.torch import load_file, save_file
        state = load_file(folder / "model.safetensors")
        del state[change["drop"]]
        save_file(state, folder / "model.safetensors")
    with pytest.raises(WeightsError, match=words):
        read_text_tower(folder)


def test_siglips_image_tower_pools_as_its_own_or_not_at_all(siglip):
    with pytest.raises(WeightsError, match="--pooling cls: SigLIP's image tower has no \\[CLS\\]"):
        read_folder(siglip[0], pooling="cls")
    assert LABELS.is_file()
