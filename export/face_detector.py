"""MTCNN's three nets -> a verified face-detector entry: DIR/NAME/{pnet,rnet,onet}.onnx and manifest.json.

Each graph takes uint8 NHWC pixels, as every vitserve graph does, and normalises them itself; P-Net has a dynamic
height and width (one pyramid scale per run), R-Net and O-Net a dynamic batch of 24 x 24 and 48 x 48 crops. Each
is checked against PyTorch on a real photograph before the folder is published, as export_model does for a ViT.
"""
import warnings
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from skimage import data as photos
from torch import nn

from models.mtcnn import PRETRAINED, create_mtcnn

from . import manifest as mf
from .graph import IMAGES, OPSET, quiet_exporter, save_graph
from .parity import FP32_ABS_TOLERANCE, ParityError
from .pipeline import Progress, building, publish, session_for

OUTPUTS = {"pnet": ["offsets", "scores"], "rnet": ["offsets", "scores"], "onet": ["offsets", "landmarks", "scores"]}
CROPS = {"rnet": 24, "onet": 48}
# The paper's cascade as facenet-pytorch runs it: each stage's score threshold, and the pyramid's scale step.
THRESHOLDS = {"pnet": 0.6, "rnet": 0.7, "onet": 0.7}
PYRAMID_FACTOR = 0.709


class PixelNet(nn.Module):
    """uint8 [B, H, W, 3] -> the net's outputs, with only the face probability of its softmax."""

    def __init__(self, net: nn.Module):
        super().__init__()
        self.net = net

    def forward(self, images: torch.Tensor) -> tuple[torch.Tensor, ...]:
        *rest, probs = self.net((images.permute(0, 3, 1, 2).float() - 127.5) * 0.0078125)
        return *rest, probs[:, 1]


def _examples(name: str) -> torch.Tensor:
    """Real pixels for the export's trace and its parity check: the astronaut, whole (P-Net) or as crops."""
    photo = Image.fromarray(photos.astronaut())
    if name == "pnet":
        return torch.from_numpy(np.array(photo.resize((97, 83))))[None]
    side = CROPS[name]
    boxes = [(150, 40, 300, 190), (180, 70, 270, 160), (0, 0, 512, 512), (300, 300, 400, 400)]
    return torch.from_numpy(np.stack([np.asarray(photo.resize((side, side), box=b)) for b in boxes]))


def export_net(name: str, net: nn.Module, path: Path) -> float:
    """One net as ONNX at `path`; the largest difference from PyTorch on real pixels."""
    module, example = PixelNet(net).eval(), _examples(name)
    quiet_exporter()
    if name == "pnet":
        dims = {1: torch.export.Dim("height", min=12, max=8192), 2: torch.export.Dim("width", min=12, max=8192)}
    else:
        dims = {0: torch.export.Dim("batch", min=1, max=4096)}
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        program = torch.onnx.export(module, (example,), dynamo=True, opset_version=OPSET, input_names=[IMAGES],
                                    output_names=OUTPUTS[name], dynamic_shapes={"images": dims}, verbose=False)
        save_graph(program.model, path)
        want = [t.numpy() for t in module(example)]
    got = session_for(path, ["CPUExecutionProvider"]).run(None, {IMAGES: example.numpy()})
    return max(float(np.abs(g - w).max()) for g, w in zip(got, want))


def _manifest(name: str, files: dict, parity: dict) -> dict:
    return {
        "schema_version": 2,
        "name": name,
        "architecture": "mtcnn",
        "task": "face-detection",
        "input": {"name": IMAGES, "dtype": "uint8", "layout": "NHWC",
                  "in_graph": "NHWC to NCHW, cast to float32, (x - 127.5) / 128"},
        "nets": {
            "pnet": {"window": 12, "stride": 2, "threshold": THRESHOLDS["pnet"], "outputs": OUTPUTS["pnet"],
                     "shape": "[1, height, width, 3] -> offsets [1, 4, h, w], scores [1, h, w]"},
            "rnet": {"crop": CROPS["rnet"], "threshold": THRESHOLDS["rnet"], "outputs": OUTPUTS["rnet"],
                     "shape": "[batch, 24, 24, 3] -> offsets [batch, 4], scores [batch]"},
            "onet": {"crop": CROPS["onet"], "threshold": THRESHOLDS["onet"], "outputs": OUTPUTS["onet"],
                     "shape": "[batch, 48, 48, 3] -> offsets [batch, 4], landmarks [batch, 10] (five x, then five "
                              "y, as fractions of the box), scores [batch]"},
        },
        "pyramid_factor": PYRAMID_FACTOR,
        "landmarks": ["left_eye", "right_eye", "nose", "mouth_left", "mouth_right"],
        "opset": OPSET,
        "files": files,
        "parity": parity,
        "source": {"weights": PRETRAINED.name, "weights_sha256": mf.sha256(PRETRAINED),
                   "licence": "MIT, facenet-pytorch 2.6.0 (models/pretrained/mtcnn.LICENSE.md)"},
        "versions": mf.package_versions(),
        "created": mf.now(),
    }


def export_face_detector(out: Path, name: str = "mtcnn") -> Path:
    log = Progress()
    with building(out, name) as work:
        files, parity = {}, {}
        for net_name, net in create_mtcnn().items():
            path = work / f"{net_name}.onnx"
            worst = export_net(net_name, net, path)
            if worst > FP32_ABS_TOLERANCE:
                raise ParityError(f"{net_name} differs from PyTorch by {worst:.3g}")
            log(f"{net_name}: exported, max |diff| vs PyTorch {worst:.2e}")
            files[net_name], parity[f"{net_name}_max_abs_diff"] = mf.file_entry(path), worst
        return publish(work, out / name, _manifest(name, files, parity), log)
