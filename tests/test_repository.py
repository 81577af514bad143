"""The committed model repository: valid manifests, intact files, and graphs that still are the committed
demo weights (checked by outputs, not bytes: `make models` rebuilds them)."""
import json

import numpy as np
import onnxruntime as ort
import pytest
import torch
from service_process import ROOT

import models
from export.manifest import sha256, validate
from models.hf_folder import read_folder
from repository import graph_inputs

REPO = ROOT / "model_repository"
FOLDERS = sorted(p.parent.name for p in REPO.glob("*/manifest.json"))
ENTRIES = [name for name in FOLDERS if name != "mtcnn"]  # the models; mtcnn is the face detector (test_mtcnn.py)


def test_the_embedded_repository_has_every_demo_model_and_the_face_detector():
    assert FOLDERS == ["expression-fer2013", "expression-vit", "mtcnn", "shapes-clip", "shapes-deit", "shapes-swin",
                       "shapes-vit", "shapes-vit-int8"]
    # small enough to clone anywhere: each model a few MB, its relevance graph (a copy of its weights) as much again
    assert sum(f.stat().st_size for f in REPO.rglob("*") if f.is_file()) < 56 * 2**20


@pytest.mark.parametrize("name", ENTRIES)
def test_committed_graphs_agree_with_the_committed_weights(name):
    manifest = json.loads((REPO / name / "manifest.json").read_text())
    validate(manifest)
    for file in manifest["files"].values():
        assert sha256(REPO / name / file["path"]) == file["sha256"]
    if "huggingface" in manifest["source"]:  # a Hugging Face folder committed beside it (the embedded CLIP)
        folder = ROOT / manifest["source"]["huggingface"]["folder"]
        assert {name: sha256(folder / name) for name in manifest["source"]["sha256"]} == manifest["source"]["sha256"]
        model, output = read_folder(folder).build(), "embeddings"
    else:
        weights = ROOT / manifest["source"]["weights"]
        assert sha256(weights) == manifest["source"]["weights_sha256"]  # built from the weights committed beside it
        model, output = models.load_weights(models.create_model(manifest["architecture"]), weights).eval(), "logits"
    x = np.random.default_rng(0).standard_normal((4, 3, *manifest["input"]["size"])).astype(np.float32)
    session = ort.InferenceSession(REPO / name / "model.onnx", providers=["CPUExecutionProvider"])
    logits = session.run([output], graph_inputs(x))[0]
    with torch.no_grad():
        expected = (model.forward_head(model.forward_features(torch.from_numpy(x)), pre_logits=True)
                    if output == "embeddings" else model(torch.from_numpy(x))).numpy()
    if manifest["precision"] == "fp32":
        np.testing.assert_allclose(logits, expected, atol=1e-4)
    else:  # int8 keeps the decisions, not the digits
        assert (logits.argmax(1) == expected.argmax(1)).all()
        assert manifest["parity"]["int8"]["top1_agreement"] >= 0.99
    if "huggingface" in manifest["source"]:  # trained here (models/shapes_clip.py), its summary beside it
        summary = json.loads((folder / "summary.json").read_text())
        assert summary["held_out"]["zero_shot_accuracy"] >= 0.9
    elif "training" in manifest["source"]:  # trained here; else pretrained, with where it came from
        training = manifest["source"]["training"]
        assert training["val_accuracy"] >= 0.95 and training["command"].startswith("python -m models.train")
    else:
        assert {"origin", "wheel_sha256", "licence", "trained_on"} <= set(manifest["source"])


@pytest.mark.parametrize("graph", sorted(p.relative_to(REPO).as_posix() for name in ENTRIES
                                         for p in (REPO / name).glob("*.onnx")))
def test_every_graph_lists_its_inputs_and_runs_them_through_iobinding(graph):
    """What every consumer of the file sees (Netron, a user's code, a server's auto-configuration): its inputs in
    session.get_inputs() (the images and the float pixels, or for the relevance graph the images and their targets; a
    CLIP's text graph its token ids); each batch feeds both, the one not used empty; IOBinding (the CUDA path) takes
    them from host memory as numpy arrays and as OrtValues, with the same outputs as a plain run."""
    manifest = json.loads((REPO / graph).parent.joinpath("manifest.json").read_text())
    h, w = manifest["input"]["size"]
    rng = np.random.default_rng(0)
    images, pixels = rng.integers(0, 256, (2, h, w, 3), dtype=np.uint8), rng.standard_normal((3, 3, h, w), np.float32)
    session = ort.InferenceSession(REPO / graph, providers=["CPUExecutionProvider"])
    relevance, text = graph.endswith("/relevance.onnx"), graph.endswith("/text.onnx")  # text: a CLIP's text tower
    inputs = ([("input_ids", "tensor(int64)")] if text else
              [("images", "tensor(uint8)"), ("target" if relevance else "pixel_values", "tensor(float)")])
    assert [(i.name, i.type) for i in session.get_inputs()] == inputs
    assert session.get_overridable_initializers() == []
    outputs = [o.name for o in session.get_outputs()]
    if relevance:
        every = [{"images": images, "target": np.eye(len(manifest["labels"]), dtype=np.float32)[[0, 1]]}]
    elif text:
        every = [{"input_ids": rng.integers(0, manifest["text"]["pad_id"], (2, 7))}]
    else:
        every = [graph_inputs(images), graph_inputs(pixels), {"images": images, "pixel_values": pixels}]
    for feeds in every:
        want = session.run(outputs, feeds)
        assert len(want[0]) == (len(images) if relevance else sum(len(x) for x in feeds.values()))
        for bind in ("numpy", "ortvalue"):
            binding = session.io_binding()
            for name, x in feeds.items():
                if bind == "numpy":
                    binding.bind_cpu_input(name, x)
                else:
                    binding.bind_ortvalue_input(name, ort.OrtValue.ortvalue_from_numpy(x))
            for name in outputs:
                binding.bind_output(name, "cpu")
            session.run_with_iobinding(binding)
            for got, expected in zip(binding.copy_outputs_to_cpu(), want):
                np.testing.assert_array_equal(got, expected)


def test_a_plan_naming_a_graph_its_manifest_does_not_list_is_refused_by_name():
    """A manifest copied without its int8 graph (bench/service_overhead.py's null repository did): the refusal names
    the graph and the folder, not a bare key."""
    from repository import RepositoryError, read_entry, verify_file
    manifest = json.loads((REPO / "shapes-deit" / "manifest.json").read_text())
    entry = read_entry(REPO / "shapes-deit")
    entry.manifest["files"] = {"model": manifest["files"]["model"]}
    with pytest.raises(RepositoryError, match="shapes-deit: its manifest names a graph 'model_int8' that its files do "
                                              "not list"):
        verify_file(entry, "model_int8")
