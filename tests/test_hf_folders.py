"""Hugging Face transformers folders (models/hf_folder.py): tiny random ViT, DeiT and Swin made and saved by
transformers itself, exported with `python -m export FOLDER`, and answered as transformers answers: the logits of its
own image processor and model on a real photo, through our decode and graph; served with their own labels.
transformers is a test dependency only: the converter reads the folder without it."""
import io
import json
import shutil
from pathlib import Path

import numpy as np
import onnxruntime as ort
import httpx
import pytest
import torch
import transformers
import tritonclient.http as triton
from PIL import Image
from service_process import ROOT, photo_bytes, running_service

from export.__main__ import main as export_main
from models import WeightsError
from models.data import preprocess
from models.hf_folder import read_folder
from repository import InputPolicy, graph_inputs
from service.images.decode import upload_input

PHOTOS = ("chelsea", "astronaut", "coffee")
LABELS = {0: "tabby cat", 1: "rocket", 2: "coffee mug", 3: "astronaut"}
FACES = {i: name for i, name in enumerate(("anger", "disgust", "fear", "happiness", "sadness", "surprise", "neutral"))}
VIT = dict(image_size=224, patch_size=32, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
           intermediate_size=64)
# name: (model class, config, image processor, the weights' dtype): every trap the converter must take
FOLDERS = {
    "vit": (transformers.ViTForImageClassification, transformers.ViTConfig(**VIT, id2label=LABELS),  # eps 1e-12
            transformers.ViTImageProcessor(size={"height": 224, "width": 224}), torch.float32),
    "vit-bf16-no-qkv-bias": (transformers.ViTForImageClassification,
                             transformers.ViTConfig(**VIT, qkv_bias=False, layer_norm_eps=1e-6, id2label=LABELS),
                             transformers.ViTImageProcessor(size=224, resample=3, image_mean=[0.4, 0.5, 0.6]),
                             torch.bfloat16),
    "deit-with-teacher": (transformers.DeiTForImageClassificationWithTeacher,
                          transformers.DeiTConfig(**VIT, id2label=LABELS),  # a non-square resize, then the crop
                          transformers.DeiTImageProcessor(size={"height": 256, "width": 288}), torch.float32),
    "deit-fine-tuned": (transformers.DeiTForImageClassification, transformers.DeiTConfig(**VIT, id2label=LABELS),
                        transformers.DeiTImageProcessor(), torch.float32),
    "swin": (transformers.SwinForImageClassification,
             transformers.SwinConfig(image_size=224, patch_size=4, embed_dim=16, depths=[2, 2], num_heads=[2, 4],
                                     window_size=7, id2label=LABELS),
             transformers.ViTImageProcessor(size={"height": 224, "width": 224}), torch.float32),
    "vit-multi-label": (transformers.ViTForImageClassification,
                        transformers.ViTConfig(**VIT, id2label=LABELS, problem_type="multi_label_classification"),
                        transformers.ViTImageProcessor(), torch.float32),
    "faces-vit": (transformers.ViTForImageClassification, transformers.ViTConfig(**VIT, id2label=FACES),
                  transformers.ViTImageProcessor(size=224), torch.float32),
}


def save_folder(folder: Path, name: str) -> None:
    """A transformers model of FOLDERS[name] with random weights large enough that its classes differ, saved by
    transformers with its image processor. The embeddings are small, so that the first LayerNorm's eps counts (1e-12
    against 1e-6 moves the logits by more than the tolerance)."""
    cls, config, processor, dtype = FOLDERS[name]
    model = cls(config)
    generator = torch.Generator().manual_seed(len(name))
    with torch.no_grad():
        for key, p in model.named_parameters():
            p.copy_(torch.randn(p.shape, generator=generator) * (3e-4 if ".embeddings." in key else 0.3))
    model.to(dtype).save_pretrained(folder)
    processor.save_pretrained(folder)


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> Path:
    """Every folder of FOLDERS under root/hf, exported into root/repository (with the face detector, for
    /expression)."""
    root = tmp_path_factory.mktemp("hf")
    for name in FOLDERS:
        save_folder(root / "hf" / name, name)
        explain = [] if name == "vit" else ["--no-explain"]  # rollout's graph once: the maps here are the last block's
        export_main([str(root / "hf" / name), "--out", str(root / "repository"), *explain])
    shutil.copytree(ROOT / "model_repository" / "mtcnn", root / "repository" / "mtcnn")
    return root


def transformers_logits(folder: Path, jpeg: bytes) -> tuple[np.ndarray, np.ndarray]:
    """(pixel_values, logits) of transformers' own image processor and model for the photo."""
    model = transformers.AutoModelForImageClassification.from_pretrained(folder, dtype=torch.float32).eval()
    processor = transformers.AutoImageProcessor.from_pretrained(folder)
    pixels = processor(Image.open(io.BytesIO(jpeg)).convert("RGB"), return_tensors="pt")["pixel_values"]
    with torch.no_grad():
        return pixels.numpy(), model(pixel_values=pixels).logits.numpy()


@pytest.mark.parametrize("name", FOLDERS)
def test_a_folder_answers_a_photo_as_transformers_does_with_its_labels_and_preprocessing(folders, name):
    entry, folder = folders / "repository" / name, folders / "hf" / name
    manifest = json.loads((entry / "manifest.json").read_text())
    assert manifest["labels"] == list(FOLDERS[name][1].id2label.values())
    assert manifest["task"] == ("expression" if name == "faces-vit" else "classification")
    assert manifest["scores"] == ("sigmoid" if name == "vit-multi-label" else "softmax")
    assert manifest["source"]["huggingface"]["folder"] == str(folder)
    policy, spec = InputPolicy.from_manifest(manifest["input"]), read_folder(folder).spec
    session = ort.InferenceSession(entry / "model.onnx", providers=["CPUExecutionProvider"])
    for photo in PHOTOS:
        jpeg = photo_bytes(photo, "JPEG", quality=90)
        pixel_values, want = transformers_logits(folder, jpeg)
        # the converted graph on transformers' own pixels: the weights and the architecture
        np.testing.assert_allclose(session.run(["logits"], graph_inputs(pixel_values))[0], want, atol=1e-4)
        # our decode against its processor: the same uint8 pixels (a crop's region resized alone: within a level)
        theirs = np.rint((pixel_values[0].transpose(1, 2, 0) * policy.std + policy.mean) * 255)
        ours = upload_input(jpeg, policy, 10**8)
        assert np.abs(ours - theirs).max() <= (1 if "deit" in name else 0)
        training = preprocess(Image.open(io.BytesIO(jpeg)).convert("RGB"), spec.img_size, spec.crop_pct,
                              spec.interpolation, spec.resize_to)  # the export's gate and models.train's reference
        assert np.abs(training.permute(1, 2, 0).numpy() - theirs).max() <= (1 if "deit" in name else 0)
        got = session.run(["logits"], graph_inputs(ours[None]))[0]
        np.testing.assert_allclose(got, want, atol=1e-3)
        assert got.argmax() == want.argmax()


def test_a_vit_folders_relevance_graph_is_chefers_rule_by_autograd_on_transformers_own_model(folders):
    """The relevance graph exported from the folder against Chefer et al. 2021's rule computed on transformers' own
    ViTForImageClassification (eager attention, its returned probabilities on the graph: their gradients by
    torch.autograd.grad): within 1e-4 of each map's largest value, at batch 1 and in a batch of mixed targets."""
    entry = folders / "repository" / "vit"
    manifest = json.loads((entry / "manifest.json").read_text())
    assert manifest["relevance"] == {"rule": "chefer2021", "grid": [7, 7], "rows": ["cls"], "input": "target",
                                     "output": "relevance"}
    model = transformers.ViTForImageClassification.from_pretrained(folders / "hf" / "vit", dtype=torch.float32,
                                                                    attn_implementation="eager").eval()
    policy = InputPolicy.from_manifest(manifest["input"])
    images = np.stack([upload_input(photo_bytes(photo, "JPEG", quality=90), policy, 10**8) for photo in PHOTOS])
    targets = np.zeros((len(images), len(LABELS)), np.float32)
    targets[1, 2], targets[2] = 1, np.linspace(-1, 1, len(LABELS))  # the top label, one label, a weight vector
    pixels = torch.from_numpy(((images / 255 - policy.mean) / policy.std).transpose(0, 3, 1, 2)).float()
    with torch.enable_grad():
        out = model(pixel_values=pixels, output_attentions=True)
        t = torch.from_numpy(targets)
        t = torch.where(t.abs().sum(-1, keepdim=True) == 0, torch.nn.functional.one_hot(
            out.logits.argmax(-1), len(LABELS)).float(), t)
        grads = torch.autograd.grad((out.logits * t).sum(), out.attentions)
    r = torch.eye(50).expand(len(images), 50, 50)
    for a, g in zip(out.attentions, grads):
        r = r + (g * a).clamp(min=0).mean(dim=1) @ r
    want = r[:, :1, 1:].detach().numpy()
    session = ort.InferenceSession(entry / "relevance.onnx", providers=["CPUExecutionProvider"])
    for rows in (slice(0, 1), slice(0, len(images))):
        logits, got = session.run(None, {"images": images[rows], "target": targets[rows]})
        np.testing.assert_allclose(logits, out.logits[rows].detach().numpy(), atol=1e-4)
        scale = np.abs(want[rows]).max(axis=-1, keepdims=True)
        assert np.abs((got - want[rows]) / scale).max() < 1e-4


def test_the_folders_are_served_with_their_own_labels_maps_and_faces(folders):
    jpeg = photo_bytes("chelsea", "JPEG", quality=90)
    with running_service(model_repository=str(folders / "repository"), default_model="vit",
                         default_expression_model="faces-vit") as url:
        client = triton.InferenceServerClient(url=url.removeprefix("http://"))
        for name in ("vit", "deit-with-teacher", "swin", "vit-multi-label"):
            pixel_values, want = transformers_logits(folders / "hf" / name, jpeg)
            scores = "sigmoid" if name == "vit-multi-label" else "softmax"
            logits = torch.from_numpy(want[0])
            probs = (logits.sigmoid() if scores == "sigmoid" else logits.softmax(0)).numpy()
            response = httpx.post(f"{url}/classify", params={"model": name, "top_k": 4, "attention": "true"},
                                  files={"file": ("chelsea.jpg", jpeg)}, timeout=60)
            assert response.status_code == 200, response.text
            assert response.json()["scores"] == scores
            [result] = response.json()["results"]
            assert [p["label"] for p in result["predictions"]] == [LABELS[i] for i in np.argsort(-probs)]
            np.testing.assert_allclose([p["score"] for p in result["predictions"]], np.sort(probs)[::-1], atol=1e-4)
            attention_map = httpx.get(url + result["attention_map_url"], timeout=60)
            assert attention_map.status_code == 200 and attention_map.headers["content-type"] == "image/png"
            tensor = triton.InferInput("pixel_values", list(pixel_values.shape), "FP32")
            tensor.set_data_from_numpy(pixel_values)
            np.testing.assert_allclose(client.infer(name, [tensor]).as_numpy("logits"), want, atol=1e-4)
        faces = httpx.post(f"{url}/expression", files={"file": ("astronaut.jpg", photo_bytes("astronaut", "JPEG"))},
                           timeout=60)
        assert faces.status_code == 200, faces.text
        [face] = faces.json()["faces"]
        assert list(face["probabilities"]) == list(FACES.values()) and face["expression"] in FACES.values()


# one edit of a saved folder each, and the words its refusal must say
REFUSALS = [
    ("config.json", {"hidden_act": "gelu_new"}, "hidden_act = 'gelu_new'"),
    ("config.json", {"model_type": "swinv2"}, "model_type 'swinv2' is not served"),
    ("config.json", {"id2label": {}}, "no id2label"),
    ("preprocessor_config.json", {"resample": 4}, "resample = 4"),
    ("preprocessor_config.json", {"size": {"height": 256, "width": 256}}, "gives 256x256 images"),
    ("preprocessor_config.json", {"image_processor_type": "ConvNextImageProcessor"}, "'ConvNextImageProcessor'"),
    ("preprocessor_config.json", {"do_rescale": False}, "rescale_factor = None"),
]
SWIN_REFUSALS = [({"window_size": 8}, "window_size = 8 in the folder's config: stage 1's 28x28 grid"),
                 ({"use_absolute_embeddings": True}, "use_absolute_embeddings = True"),
                 ({"layer_norm_eps": 1e-6}, "layer_norm_eps = 1e-06")]


@pytest.mark.parametrize("file, change, words", REFUSALS)
def test_a_setting_that_cannot_be_served_exactly_is_refused_by_name(folders, tmp_path, file, change, words):
    folder = shutil.copytree(folders / "hf" / "vit", tmp_path / "vit")
    (folder / file).write_text(json.dumps({**json.loads((folder / file).read_text()), **change}))
    with pytest.raises(WeightsError, match=words.replace("(", r"\(")):
        read_folder(folder)


@pytest.mark.parametrize("change, words", SWIN_REFUSALS)
def test_a_swin_that_would_pad_or_embed_differently_is_refused(folders, tmp_path, change, words):
    folder = shutil.copytree(folders / "hf" / "swin", tmp_path / "swin")
    config = folder / "config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), **change}))
    with pytest.raises(WeightsError, match=words):
        read_folder(folder)


def test_the_command_line_names_a_refusal_and_writes_nothing(folders, tmp_path, capsys):
    folder = shutil.copytree(folders / "hf" / "vit", tmp_path / "vit")
    (folder / "model.safetensors").unlink()
    with pytest.raises(SystemExit, match="no model.safetensors or pytorch_model.bin"):
        export_main([str(folder), "--out", str(tmp_path / "repository")])
    assert not (tmp_path / "repository" / "vit").exists()
