"""ImageFolder datasets for training: DIR/<label>/*.{jpg,png,...}, one sub-folder per class.

A data folder holds either `train/` and `val/` (or `test/`) ImageFolders, or a single ImageFolder from
which a seeded fraction is held out. `labels.txt` (one label per line) fixes the class order; without
it the sub-folders are taken in sorted order.
"""
import random
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageOps
from torch.utils.data import Dataset

IMAGE_SUFFIXES = {".jpg", ".jpeg", ".png", ".bmp", ".webp", ".tif", ".tiff"}


class DataError(ValueError):
    """A data folder that cannot be trained on."""


def read_labels(data_dir: Path) -> list[str]:
    listed = data_dir / "labels.txt"
    if listed.is_file():
        return [line.strip() for line in listed.read_text().splitlines() if line.strip()]
    root = data_dir / "train" if (data_dir / "train").is_dir() else data_dir
    return sorted(p.name for p in root.iterdir() if p.is_dir())


def list_images(folder: Path, labels: list[str]) -> list[tuple[Path, int]]:
    """(path, class index) for every image under folder/<label>/, in a stable order."""
    return [(p, i) for i, label in enumerate(labels) if (folder / label).is_dir()
            for p in sorted((folder / label).iterdir()) if p.suffix.lower() in IMAGE_SUFFIXES]


def find_splits(data_dir: Path, val_fraction: float, seed: int) -> tuple[list[str], list, list]:
    """labels, training items, held-out items; fails with a clear message on data it cannot use."""
    if not data_dir.is_dir():
        raise DataError(f"no data folder at {data_dir}")
    labels = read_labels(data_dir)
    if len(labels) < 2:
        raise DataError(f"{data_dir} has {len(labels)} class folder(s) ({', '.join(labels) or 'none'}); "
                        "training needs at least two, one sub-folder per class")
    if (data_dir / "train").is_dir():
        val_dir = next((data_dir / n for n in ("val", "test") if (data_dir / n).is_dir()), None)
        if val_dir is None:
            raise DataError(f"{data_dir} has train/ but no val/ or test/ to hold out")
        train, val = list_images(data_dir / "train", labels), list_images(val_dir, labels)
    else:
        items = list_images(data_dir, labels)
        random.Random(seed).shuffle(items)
        n_val = max(1, round(len(items) * val_fraction))
        train, val = items[n_val:], items[:n_val]
    empty = [label for i, label in enumerate(labels) if not any(c == i for _, c in train)]
    if empty:
        raise DataError(f"no training images for class(es) {', '.join(empty)} under {data_dir}")
    if not val:
        raise DataError(f"no held-out images in {data_dir}")
    return labels, train, val


def preprocess(image: Image.Image, size: int, crop_pct: float, interpolation: str,
               resize_to: tuple[int, int] | None = None) -> torch.Tensor:
    """RGB image -> uint8 [3, size, size]: resize the short side to size / crop_pct (or to exactly resize_to,
    (height, width), the aspect not kept), then centre-crop.

    The same policy the exporter writes into the manifest and the service applies.
    """
    short = round(size / crop_pct)
    w, h = image.size
    scale = short / min(w, h)
    kept = (max(short, round(w * scale)), max(short, round(h * scale)))
    image = image.resize((resize_to[1], resize_to[0]) if resize_to else kept, Image.Resampling[interpolation.upper()])
    left, top = (image.width - size) // 2, (image.height - size) // 2
    image = image.crop((left, top, left + size, top + size))
    return torch.from_numpy(np.asarray(image).copy()).permute(2, 0, 1)


def load_image(path: Path, size: int, crop_pct: float, interpolation: str,
               resize_to: tuple[int, int] | None = None) -> torch.Tensor:
    """Decode, apply the EXIF orientation, convert to RGB and `preprocess`."""
    with Image.open(path) as im:
        image = ImageOps.exif_transpose(im).convert("RGB")
    return preprocess(image, size, crop_pct, interpolation, resize_to)


def normalise(x: torch.Tensor, spec) -> torch.Tensor:
    """Float images in [0, 1] -> the model's input, (x - mean) / std per channel."""
    mean = torch.tensor(spec.mean, dtype=x.dtype).view(1, 3, 1, 1)
    std = torch.tensor(spec.std, dtype=x.dtype).view(1, 3, 1, 1)
    return (x - mean) / std


class ImageFolder(Dataset):
    def __init__(self, items: list[tuple[Path, int]], size: int, crop_pct: float = 1.0, interpolation: str = "bicubic",
                 resize_to: tuple[int, int] | None = None):
        self.items, self.size, self.crop_pct, self.interpolation = items, size, crop_pct, interpolation
        self.resize_to = resize_to

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        path, label = self.items[i]
        return load_image(path, self.size, self.crop_pct, self.interpolation, self.resize_to), label
