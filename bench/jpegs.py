"""The JPEGs the GPU benches decode: scikit-image's chelsea photo at any size, what a phone sends, and a mix of sizes
as uploads come (bench/gpu.py, bench/jpeg_engines.py)."""
import io

import numpy as np
from PIL import Image
from skimage import data as photos

# sizes as uploads come: thumbnails to phone photos
MIXED = [(451, 300), (640, 480), (1024, 768), (1280, 960), (1920, 1080), (3000, 2000)]


def jpeg(size: tuple[int, int]) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(photos.chelsea()).resize(size, Image.BICUBIC).save(buf, format="JPEG", quality=90)
    return buf.getvalue()


def phone_photo() -> bytes:
    """What a phone sends: 4032 x 3024, 4:2:0, quality 92, about 2.3 MB (scikit-image's astronaut enlarged, with
    a sensor's grain, which is what makes a real photo's entropy decoding cost what it does)."""
    pixels = np.asarray(Image.fromarray(photos.astronaut()).resize((4032, 3024), Image.BICUBIC), np.int16)
    grain = np.random.default_rng(0).normal(0, 3, (*pixels.shape[:2], 1)).astype(np.int16)
    buf = io.BytesIO()
    Image.fromarray(np.clip(pixels + grain, 0, 255).astype(np.uint8)).save(buf, format="JPEG", quality=92)
    return buf.getvalue()
