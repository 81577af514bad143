import numpy as np
import pytest
import torch
from PIL import Image

from models.augment import color_jitter, random_resized_crop
from models.data import DataError, find_splits, load_image


def test_full_crop_is_identity_and_flip_mirrors():
    x = torch.rand(4, 3, 16, 16)
    torch.testing.assert_close(random_resized_crop(x, (1.0, 1.0), (1.0, 1.0), flip=0.0), x)
    torch.testing.assert_close(random_resized_crop(x, (1.0, 1.0), (1.0, 1.0), flip=1.0), x.flip(-1))


def test_crop_zooms_in():
    x = torch.zeros(2, 3, 32, 32)
    x[..., 8:24, 8:24] = 1  # a centred square covering a quarter of the image
    out = random_resized_crop(x, (0.25, 0.25), (1.0, 1.0), flip=0.0)
    assert out.mean() > x.mean()


def test_jitter_keeps_range_and_zero_is_identity():
    x = torch.rand(4, 3, 8, 8)
    torch.testing.assert_close(color_jitter(x, 0, 0, 0), x)
    y = color_jitter(x, 0.5, 0.5, 0.5)
    assert y.min() >= 0 and y.max() <= 1 and not torch.allclose(x, y)


def test_load_image_applies_exif_orientation_and_crops(tmp_path):
    pixels = np.zeros((40, 80, 3), np.uint8)
    pixels[:, :40] = (255, 0, 0)  # left half red, right half blue
    pixels[:, 40:] = (0, 0, 255)
    exif = Image.Exif()
    exif[0x0112] = 3  # rotate 180 degrees on display
    Image.fromarray(pixels).save(tmp_path / "rotated.jpg", exif=exif, quality=95)
    out = load_image(tmp_path / "rotated.jpg", 32, crop_pct=1.0, interpolation="bilinear")
    assert out.shape == (3, 32, 32) and out.dtype == torch.uint8
    assert out[2, :, :8].float().mean() > 200 and out[0, :, -8:].float().mean() > 200  # blue now on the left


def _folder(root, classes, per_class=3):
    for c in classes:
        (root / c).mkdir(parents=True)
        for i in range(per_class):
            Image.new("RGB", (8, 8)).save(root / c / f"{i}.png")


def test_single_folder_is_split_by_seed(tmp_path):
    _folder(tmp_path, ["b", "a"], per_class=10)
    labels, train, val = find_splits(tmp_path, 0.2, seed=0)
    assert labels == ["a", "b"] and len(train) == 16 and len(val) == 4
    assert find_splits(tmp_path, 0.2, seed=0)[2] == val


def test_labels_txt_fixes_class_order(tmp_path):
    _folder(tmp_path / "train", ["sad", "happy"])
    _folder(tmp_path / "test", ["sad", "happy"])
    (tmp_path / "labels.txt").write_text("sad\nhappy\n")
    labels, train, _ = find_splits(tmp_path, 0.1, seed=0)
    assert labels == ["sad", "happy"] and {c for _, c in train} == {0, 1}


def test_unusable_data_is_a_clear_error(tmp_path):
    with pytest.raises(DataError, match="no data folder"):
        find_splits(tmp_path / "absent", 0.1, 0)
    _folder(tmp_path / "one", ["only"])
    with pytest.raises(DataError, match="has 1 class folder.*at least two"):
        find_splits(tmp_path / "one", 0.1, 0)
