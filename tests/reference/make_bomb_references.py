"""Regenerate the pixel bombs' honest halves: large flat photos in few bytes, which the tests make lie about their
size by patching the `ispe` box (tests/test_client_mistakes.py):
    flat_12000.avif: 12000 x 12000 grey, AV1 in AVIF (Pillow's encoder, libavif): 144 MP, 2 KB
    flat_4000.heic: 4000 x 4000 grey, HEVC in HEIF (pillow-heif's x265): 16 MP, 4 KB
Encoding 144 MP takes seconds and half a gigabyte, which each test run would pay. pillow-heif, in an environment of
its own as for chelsea_iphone.heic (make_heic_reference.py), with the Pillow it brings:
    python -m venv /tmp/heic && /tmp/heic/bin/pip install pillow-heif
    /tmp/heic/bin/python tests/reference/make_bomb_references.py
Recorded with pillow-heif 1.8.1 (libheif 1.23.6, x265 4.3) and Pillow 13.0.0 (libavif 1.4.2).
"""
from pathlib import Path

import pillow_heif
from PIL import Image

HERE = Path(__file__).parent
GREY = (120, 130, 140)

pillow_heif.register_heif_opener()
Image.new("RGB", (12000, 12000), GREY).save(HERE / "flat_12000.avif", quality=10, speed=10)
Image.new("RGB", (4000, 4000), GREY).save(HERE / "flat_4000.heic", quality=10)
