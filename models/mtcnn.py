"""MTCNN (Zhang et al., 2016, "Joint Face Detection and Alignment using Multi-task Cascaded Convolutional
Networks"): three small CNNs that find faces and their five landmarks (eyes, nose, mouth corners).

P-Net is fully convolutional: over each scale of an image pyramid it gives, per 12 x 12 window (stride 2), a face
probability and the window's box offsets. R-Net refines the candidates as 24 x 24 crops, O-Net as 48 x 48 crops,
and O-Net adds the landmarks, as fractions of the box. Every net returns its box offsets first and, last, the
softmax over (no face, face); inputs are RGB scaled as the nets were trained, (x - 127.5) / 128, NCHW.

The parameter names are those of facenet-pytorch's checkpoints (pnet.pt, rnet.pt, onet.pt in its wheel, MIT
licence), which were converted from the paper's Caffe models: the dense layers read the last conv's features in
Caffe's order, width before height. facenet-pytorch itself cannot be installed beside this project's torch (its
2.6.0 wants torch < 2.3, numpy < 2, Pillow < 10.3), so its weights are converted once into one committed file,
models/pretrained/mtcnn.safetensors (its licence beside it):

    pip download facenet-pytorch==2.6.0 --no-deps -d build/facenet
    python -m models.mtcnn build/facenet/facenet_pytorch-2.6.0-py3-none-any.whl
"""
import hashlib
import tempfile
import zipfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from .weights import convert_wheel_main, read_state_dict

PRETRAINED = Path(__file__).parent / "pretrained" / "mtcnn.safetensors"
NETS = ("pnet", "rnet", "onet")


def caffe_flatten(x: torch.Tensor) -> torch.Tensor:
    """[B, C, H, W] -> [B, W * H * C], the order the converted dense layers read."""
    return x.permute(0, 3, 2, 1).flatten(1)


class PNet(nn.Module):
    """12 x 12 windows, stride 2: [B, 3, H, W] -> (box offsets [B, 4, h, w], probabilities [B, 2, h, w])."""

    def __init__(self):
        super().__init__()
        self.conv1, self.prelu1 = nn.Conv2d(3, 10, 3), nn.PReLU(10)
        self.pool1 = nn.MaxPool2d(2, 2, ceil_mode=True)
        self.conv2, self.prelu2 = nn.Conv2d(10, 16, 3), nn.PReLU(16)
        self.conv3, self.prelu3 = nn.Conv2d(16, 32, 3), nn.PReLU(32)
        self.conv4_1 = nn.Conv2d(32, 2, 1)  # face or not
        self.conv4_2 = nn.Conv2d(32, 4, 1)  # box offsets

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.pool1(self.prelu1(self.conv1(x)))
        x = self.prelu3(self.conv3(self.prelu2(self.conv2(x))))
        return self.conv4_2(x), self.conv4_1(x).softmax(dim=1)


class RNet(nn.Module):
    """[B, 3, 24, 24] -> (box offsets [B, 4], probabilities [B, 2])."""

    def __init__(self):
        super().__init__()
        self.conv1, self.prelu1 = nn.Conv2d(3, 28, 3), nn.PReLU(28)
        self.pool1 = nn.MaxPool2d(3, 2, ceil_mode=True)
        self.conv2, self.prelu2 = nn.Conv2d(28, 48, 3), nn.PReLU(48)
        self.pool2 = nn.MaxPool2d(3, 2, ceil_mode=True)
        self.conv3, self.prelu3 = nn.Conv2d(48, 64, 2), nn.PReLU(64)
        self.dense4, self.prelu4 = nn.Linear(576, 128), nn.PReLU(128)
        self.dense5_1 = nn.Linear(128, 2)
        self.dense5_2 = nn.Linear(128, 4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.pool1(self.prelu1(self.conv1(x)))
        x = self.pool2(self.prelu2(self.conv2(x)))
        x = self.prelu4(self.dense4(caffe_flatten(self.prelu3(self.conv3(x)))))
        return self.dense5_2(x), self.dense5_1(x).softmax(dim=1)


class ONet(nn.Module):
    """[B, 3, 48, 48] -> (box offsets [B, 4], landmarks [B, 10]: five x then five y, as fractions of the box,
    probabilities [B, 2])."""

    def __init__(self):
        super().__init__()
        self.conv1, self.prelu1 = nn.Conv2d(3, 32, 3), nn.PReLU(32)
        self.pool1 = nn.MaxPool2d(3, 2, ceil_mode=True)
        self.conv2, self.prelu2 = nn.Conv2d(32, 64, 3), nn.PReLU(64)
        self.pool2 = nn.MaxPool2d(3, 2, ceil_mode=True)
        self.conv3, self.prelu3 = nn.Conv2d(64, 64, 3), nn.PReLU(64)
        self.pool3 = nn.MaxPool2d(2, 2, ceil_mode=True)
        self.conv4, self.prelu4 = nn.Conv2d(64, 128, 2), nn.PReLU(128)
        self.dense5, self.prelu5 = nn.Linear(1152, 256), nn.PReLU(256)
        self.dense6_1 = nn.Linear(256, 2)
        self.dense6_2 = nn.Linear(256, 4)
        self.dense6_3 = nn.Linear(256, 10)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        x = self.pool1(self.prelu1(self.conv1(x)))
        x = self.pool2(self.prelu2(self.conv2(x)))
        x = self.pool3(self.prelu3(self.conv3(x)))
        x = self.prelu5(self.dense5(caffe_flatten(self.prelu4(self.conv4(x)))))
        return self.dense6_2(x), self.dense6_3(x), self.dense6_1(x).softmax(dim=1)


def create_mtcnn(path: Path = PRETRAINED) -> dict[str, nn.Module]:
    """The three nets, in eval mode, with the weights of `path` (one file, each net's under its name)."""
    tensors = load_file(path)
    nets = {"pnet": PNet(), "rnet": RNet(), "onet": ONet()}
    for name, net in nets.items():
        net.load_state_dict({k.removeprefix(f"{name}."): v for k, v in tensors.items() if k.startswith(f"{name}.")})
        net.eval()
    return nets


def convert(wheel: Path, out: Path = PRETRAINED) -> None:
    """facenet-pytorch's wheel -> one safetensors file of the three nets' weights (read with weights_only, checked
    against the nets here), with where they came from in its metadata, and the wheel's licence beside it."""
    with tempfile.TemporaryDirectory() as tmp, zipfile.ZipFile(wheel) as archive:
        archive.extractall(tmp)
        data = Path(tmp) / "facenet_pytorch" / "data"
        (licence,) = Path(tmp).glob("facenet_pytorch-*.dist-info/LICENSE*")
        tensors, metadata = {}, {"source": wheel.name, "licence": "MIT (mtcnn.LICENSE.md)"}
        for name, net in zip(NETS, (PNet(), RNet(), ONet())):
            state = read_state_dict(data / f"{name}.pt")
            net.load_state_dict(state)  # every parameter, no more
            tensors.update({f"{name}.{k}": v.contiguous() for k, v in state.items()})
            metadata[f"{name}.pt sha256"] = hashlib.sha256((data / f"{name}.pt").read_bytes()).hexdigest()
        out.parent.mkdir(parents=True, exist_ok=True)
        save_file(tensors, out, metadata=metadata)
        out.with_name("mtcnn.LICENSE.md").write_text(licence.read_text())


def main(argv: list[str] | None = None) -> None:
    convert_wheel_main("python -m models.mtcnn", __doc__, "facenet_pytorch-2.6.0-py3-none-any.whl", convert,
                       PRETRAINED, argv)


if __name__ == "__main__":
    main()
