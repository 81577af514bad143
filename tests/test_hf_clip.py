"""A whole CLIP folder (models/hf_clip.py; docs/export.md, "A whole CLIP"): its tokenizer gives the folder's own
tokenizer's ids, and `python -m export FOLDER` writes its text tower (text.onnx, tokenizer.json and the manifest's
`text`) beside its image tower, the two answering as transformers' CLIPModel answers: text embeddings as
get_text_features, zero-shot probabilities as logits_per_image.softmax. transformers is a test dependency only."""
import io
import json
import shutil
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import torch
import transformers
from clip_folder import CONTEXT, LABELS, save_clip_folder
from PIL import Image
from service_process import photo_bytes
from tokenizers import Tokenizer

from export.__main__ import main as export_main
from models import WeightsError
from models.hf_clip import padded, read_text_tower, token_ids
from repository import graph_inputs

ATOL = 1e-4
PHOTOS = ("chelsea", "astronaut", "coffee")
LABEL_SETS = [["cat", "astronaut", "coffee"], ["tabby cat", "tiger cat", "Egyptian cat", "lynx", "dog"],
              ["a rocket", "a cup of coffee"]]


def probe_texts() -> list[str]:
    """A few hundred strings: class names as they are, upper case and title case, punctuation, digits and
    contractions, runs of whitespace, accents, CJK and emoji, control characters, empty, and past the context."""
    names = LABELS.read_text().splitlines()[::4]
    texts = names[:100] + [n.upper() for n in names[100:150]] + [n.title() + "!?" for n in names[150:200]]
    texts += [f"a photo of a {n}." for n in names[200:250]]
    texts += ["", " ", "it's", "they've been, haven't they?", "3.14159 and 42", "\t tabs \n and\r\nnewlines  ",
              "crème brûlée", "Ça VA", "naïve café", "日本語のテキスト", "한국어", "emoji 🐱🚀", "\x00nul\x01",
              "ﬁ ligature", "e\u0301 combining", "a" * 300, "word " * 60, "<|startoftext|> inside <|endoftext|>"]
    return texts


@pytest.fixture(scope="module")
def clip(tmp_path_factory) -> tuple[Path, Path]:
    """(the folder, the repository it was exported into as `clip`)."""
    root = tmp_path_factory.mktemp("hf-clip")
    save_clip_folder(root / "clip")
    export_main([str(root / "clip"), "--out", str(root / "repository"), "--no-explain"])
    return root / "clip", root / "repository"


def hf_ids(folder: Path, texts: list[str]) -> list[list[int]]:
    tokenizer = transformers.CLIPTokenizer.from_pretrained(folder)
    return tokenizer(texts, truncation=True, max_length=CONTEXT)["input_ids"]


def test_the_tokenizer_gives_the_folders_own_ids(clip):
    folder, _ = clip
    texts = probe_texts()
    assert len(texts) > 250
    assert token_ids(read_text_tower(folder).tokenizer, texts) == hf_ids(folder, texts)


def test_a_folder_without_tokenizer_json_gets_one_made_from_vocab_and_merges(clip, tmp_path):
    folder = shutil.copytree(clip[0], tmp_path / "clip")
    (folder / "tokenizer.json").unlink()
    texts = probe_texts()
    assert token_ids(read_text_tower(folder).tokenizer, texts) == hf_ids(clip[0], texts)


def test_long_texts_are_truncated_to_the_context_keeping_their_end_of_text(clip):
    ids = token_ids(read_text_tower(clip[0]).tokenizer, ["word " * 60])[0]
    tokenizer = transformers.CLIPTokenizer.from_pretrained(clip[0])
    assert len(ids) == CONTEXT and ids[0] == tokenizer.bos_token_id and ids[-1] == tokenizer.eos_token_id


def text_graph(repo: Path, name: str, texts: list[str]) -> np.ndarray:
    """The exported text graph's embeddings of the texts, tokenized and padded as the manifest says."""
    text = json.loads((repo / name / "manifest.json").read_text())["text"]
    tokenizer = Tokenizer.from_file(str(repo / name / "tokenizer.json"))  # as the service reads it
    session = ort.InferenceSession(repo / name / "text.onnx", providers=["CPUExecutionProvider"])
    return session.run([text["output"]], {text["input"]: padded(token_ids(tokenizer, texts), text["pad_id"])})[0]


@pytest.mark.parametrize("legacy_eos", [False, True], ids=["eos-token-id", "legacy-largest-id"])
def test_the_text_graph_embeds_as_get_text_features(tmp_path, legacy_eos):
    save_clip_folder(tmp_path / "clip", legacy_eos=legacy_eos)
    export_main([str(tmp_path / "clip"), "--out", str(tmp_path / "repository"), "--no-explain"])
    texts = probe_texts()
    model = transformers.CLIPModel.from_pretrained(tmp_path / "clip").eval()
    tokenizer = transformers.CLIPTokenizer.from_pretrained(tmp_path / "clip")
    with torch.no_grad():
        inputs = tokenizer(texts, padding=True, truncation=True, max_length=CONTEXT, return_tensors="pt")
        want = model.get_text_features(**inputs).pooler_output.numpy()
    got = text_graph(tmp_path / "repository", "clip", texts)
    assert np.abs(want).max() > 100 * ATOL  # far from zero: the comparison means something
    np.testing.assert_allclose(got, want, atol=ATOL, rtol=0)


def test_the_manifest_says_how_texts_are_tokenized_and_scored(clip):
    folder, repo = clip
    manifest = json.loads((repo / "clip" / "manifest.json").read_text())
    model = transformers.CLIPModel.from_pretrained(folder)
    tokenizer = transformers.CLIPTokenizer.from_pretrained(folder)
    assert manifest["task"] == "embedding" and manifest["source"]["huggingface"]["model_type"] == "clip"
    assert {"text", "tokenizer"} <= manifest["files"].keys()
    text = manifest["text"]
    assert text["context_length"] == CONTEXT and text["pad_id"] == tokenizer.pad_token_id
    assert text["size"] == manifest["embedding"]["size"] == model.config.projection_dim
    assert text["scores"] == "softmax" and text["template"].count("{}") == 1
    assert text["logit_scale"] == pytest.approx(model.logit_scale.exp().item(), rel=1e-6)
    assert manifest["parity"]["text_max_abs_diff"] <= ATOL


@pytest.mark.parametrize("labels", LABEL_SETS, ids=lambda labels: f"{len(labels)}-labels")
def test_zero_shot_probabilities_of_real_photos_are_transformers(clip, labels):
    """softmax(logit_scale cos(image, prompt)) from the two exported graphs, against CLIPModel's own
    logits_per_image.softmax, on the processor's pixels of real photographs."""
    folder, repo = clip
    text = json.loads((repo / "clip" / "manifest.json").read_text())["text"]
    prompts = [text["template"].format(label) for label in labels]
    model = transformers.CLIPModel.from_pretrained(folder).eval()
    processor = transformers.CLIPProcessor(transformers.CLIPImageProcessor.from_pretrained(folder),
                                           transformers.CLIPTokenizer.from_pretrained(folder))
    photos = [Image.open(io.BytesIO(photo_bytes(p, "JPEG", quality=90))).convert("RGB") for p in PHOTOS]
    inputs = processor(text=prompts, images=photos, return_tensors="pt", padding=True)
    with torch.no_grad():
        want = model(**inputs).logits_per_image.softmax(-1).numpy()
    images = ort.InferenceSession(repo / "clip" / "model.onnx", providers=["CPUExecutionProvider"]).run(
        ["embeddings"], graph_inputs(inputs["pixel_values"].numpy()))[0]
    texts = text_graph(repo, "clip", prompts)
    cos = (images / np.linalg.norm(images, axis=1, keepdims=True)) @ (
        texts / np.linalg.norm(texts, axis=1, keepdims=True)).T
    logits = text["logit_scale"] * cos + text["logit_bias"]
    got = np.exp(logits - logits.max(1, keepdims=True))
    np.testing.assert_allclose(got / got.sum(1, keepdims=True), want, atol=ATOL, rtol=0)


@pytest.mark.parametrize("remove, change, words", [
    (("tokenizer.json", "vocab.json", "merges.txt"), None, "no tokenizer.json, and no vocab.json and merges.txt"),
    (("vocab.json",), {"tokenizer.json": "{not json"}, "tokenizer.json: not a tokenizer"),
    (("tokenizer.json",), {"special_tokens_map.json": '{"bos_token": "<s>"}'}, "bos_token = '<s>'"),
    ((), {"config.json": None}, "text_config.hidden_act = 'relu'"),
])
def test_a_text_tower_that_cannot_be_served_exactly_is_refused_by_name(clip, tmp_path, remove, change, words):
    folder = shutil.copytree(clip[0], tmp_path / "clip")
    for name in remove:
        (folder / name).unlink()
    for name, content in (change or {}).items():
        if name == "config.json":
            config = json.loads((folder / name).read_text())
            config["text_config"]["hidden_act"] = "relu"
            content = json.dumps(config)
        (folder / name).write_text(content)
    with pytest.raises(WeightsError, match=words):
        read_text_tower(folder)
