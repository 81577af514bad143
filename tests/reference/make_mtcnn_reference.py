"""Regenerate mtcnn_reference.safetensors from facenet-pytorch's own P-, R- and O-Nets and their bundled weights.

facenet-pytorch 2.6.0 cannot be installed beside this project's torch, and its package imports torchvision, which
its nets do not use: so its `models/mtcnn.py` is loaded straight from the unpacked wheel, with torchvision and cv2
stubbed (the nets load their weights from the wheel's data folder themselves).
    pip download facenet-pytorch==2.6.0 --no-deps -d build/facenet
    python tests/reference/make_mtcnn_reference.py build/facenet/facenet_pytorch-2.6.0-py3-none-any.whl
Fixed random inputs in [-1, 1) (the nets' input scale), and each net's outputs for them.
"""
import importlib.util
import sys
import tempfile
import types
import zipfile
from pathlib import Path

import torch
from safetensors.torch import save_file

OUT = Path(__file__).parent / "mtcnn_reference.safetensors"


def facenet_mtcnn(root: Path) -> types.ModuleType:
    """facenet_pytorch/models/mtcnn.py of the unpacked wheel at `root`, without torchvision or cv2."""
    for name in ("torchvision", "torchvision.transforms", "torchvision.transforms.functional", "torchvision.ops",
                 "torchvision.ops.boxes", "cv2"):
        sys.modules[name] = types.ModuleType(name)
    sys.modules["torchvision.ops.boxes"].batched_nms = None
    sys.modules["torchvision.transforms"].functional = sys.modules["torchvision.transforms.functional"]
    for package in ("facenet_pytorch", "facenet_pytorch.models"):
        sys.modules[package] = types.ModuleType(package)
        sys.modules[package].__path__ = [str(root / package.replace(".", "/"))]
    spec = importlib.util.spec_from_file_location("facenet_pytorch.models.mtcnn",
                                                  root / "facenet_pytorch" / "models" / "mtcnn.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        zipfile.ZipFile(sys.argv[1]).extractall(tmp)
        facenet = facenet_mtcnn(Path(tmp))
        g = torch.Generator().manual_seed(0)
        inputs = {"pnet_in": torch.rand(1, 3, 37, 53, generator=g) * 2 - 1,
                  "rnet_in": torch.rand(3, 3, 24, 24, generator=g) * 2 - 1,
                  "onet_in": torch.rand(3, 3, 48, 48, generator=g) * 2 - 1}
        with torch.no_grad():
            pnet, rnet, onet = facenet.PNet().eval(), facenet.RNet().eval(), facenet.ONet().eval()
            outputs = dict(zip(("pnet_box", "pnet_prob"), pnet(inputs["pnet_in"])))
            outputs.update(zip(("rnet_box", "rnet_prob"), rnet(inputs["rnet_in"])))
            outputs.update(zip(("onet_box", "onet_landmarks", "onet_prob"), onet(inputs["onet_in"])))
    save_file({**inputs, **{k: v.contiguous() for k, v in outputs.items()}}, OUT,
              metadata={"source": f"{Path(sys.argv[1]).name}: its PNet, RNet and ONet with their bundled weights"})
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
