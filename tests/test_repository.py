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
from repository import graph_inputs

REPO = ROOT / "model_repository"
FOLDERS = sorted(p.parent.name for p in REPO.glob("*/manifest.json"))
ENTRIES = [name for name in FOLDERS if name != "mtcnn"]  # the models; mtcnn is the face detector (test_mtcnn.py)


def test_the_embedded_repository_has_every_demo_model_and_the_face_detector():
    assert FOLDERS == ["expression-vit", "mtcnn", "shapes-deit", "shapes-swin", "shapes-vit", "shapes-vit-int8"]
    assert sum(f.stat().st_size for f in REPO.rglob("*") if f.is_file()) < 40 * 2**20


@pytest.mark.parametrize("name", ENTRIES)
def test_committed_graphs_agree_with_the_committed_weights(name):
    manifest = json.loads((REPO / name / "manifest.json").read_text())
    validate(manifest)
    for file in manifest["files"].values():
        assert sha256(REPO / name / file["path"]) == file["sha256"]
    weights = ROOT / manifest["source"]["weights"]
    assert sha256(weights) == manifest["source"]["weights_sha256"]  # built from the weights committed beside it
    model = models.load_weights(models.create_model(manifest["architecture"]), weights).eval()
    x = np.random.default_rng(0).standard_normal((4, 3, *manifest["input"]["size"])).astype(np.float32)
    session = ort.InferenceSession(REPO / name / "model.onnx", providers=["CPUExecutionProvider"])
    logits = session.run(["logits"], graph_inputs(x))[0]
    with torch.no_grad():
        expected = model(torch.from_numpy(x)).numpy()
    if manifest["precision"] == "fp32":
        np.testing.assert_allclose(logits, expected, atol=1e-4)
    else:  # int8 keeps the decisions, not the digits
        assert (logits.argmax(1) == expected.argmax(1)).all()
        assert manifest["parity"]["int8"]["top1_agreement"] >= 0.99
    training = manifest["source"]["training"]
    assert training["val_accuracy"] >= 0.95 and training["command"].startswith("python -m models.train")


@pytest.mark.parametrize("graph", sorted(p.relative_to(REPO).as_posix() for name in ENTRIES
                                         for p in (REPO / name).glob("*.onnx")))
def test_every_graph_runs_with_either_input_alone_in_plain_onnx_runtime(graph):
    """What a user who takes the file elsewhere does: feed only the input they have; the other defaults to an
    empty batch."""
    manifest = json.loads((REPO / graph).parent.joinpath("manifest.json").read_text())
    h, w = manifest["input"]["size"]
    rng = np.random.default_rng(0)
    images, pixels = rng.integers(0, 256, (2, h, w, 3), dtype=np.uint8), rng.standard_normal((3, 3, h, w), np.float32)
    session = ort.InferenceSession(REPO / graph, providers=["CPUExecutionProvider"])
    assert session.get_inputs() == []  # both inputs have defaults: neither is required
    assert [i.name for i in session.get_overridable_initializers()] == ["images", "pixel_values"]
    for name, x, other, empty in (("images", images, "pixel_values", pixels[:0]),
                                  ("pixel_values", pixels, "images", images[:0])):
        alone, fed, rows = {name: x}, {other: empty}, len(x)
        for got, want in zip(session.run(None, alone), session.run(None, {**alone, **fed})):
            assert len(got) == rows
            np.testing.assert_array_equal(got, want)  # the same run: the default is an empty batch
