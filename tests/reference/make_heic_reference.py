"""Regenerate chelsea_iphone.heic: scikit-image's chelsea as an iPhone held upright stores a photo, its pixels turned
(HEVC in HEIF) with the turn that shows it upright in the file's own transform (irot) and in EXIF orientation 6.

The service decodes HEIC with pi-heif, which cannot encode; pillow-heif (x265) makes the file, in an environment of
its own (its libheif beside pi-heif's in one process is asking for trouble):
    python -m venv /tmp/heic && /tmp/heic/bin/pip install pillow-heif scikit-image
    /tmp/heic/bin/python tests/reference/make_heic_reference.py
Recorded with pillow-heif 1.8.1 (libheif 1.23.6, x265 4.3), quality 60: 26 KB.
"""
from pathlib import Path

import pillow_heif
from PIL import Image
from skimage import data

pillow_heif.register_heif_opener()
stored = Image.fromarray(data.chelsea()).transpose(Image.Transpose.ROTATE_90)  # the sensor's rows, not upright
exif = Image.Exif()
exif[0x0112] = 6  # turn 90 degrees clockwise to view; pillow-heif writes it as the file's irot as well
stored.save(Path(__file__).parent / "chelsea_iphone.heic", quality=60, exif=exif.tobytes())
