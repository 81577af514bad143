"""What an upload costs the service on one core before inference: the JPEG decode, then the crop's resample, the
service's (OpenCV's bilinear warp: service/images/decode.py model_input) against Pillow's bicubic (resize_and_crop, the
reference and the service's path until 2026-11-27), and the service's whole path (upload_input: JPEGs decoded by
simplejpeg straight into numpy since 2026-11-27, the same pixels) against the two before it; and the whole path
of a Hugging Face folder's policy ("HF": resized to exactly size x size with Pillow's bicubic from a full-size decode,
as its image processor does: docs/export.md#from-hugging-face).

    python bench/decode_speed.py
    python bench/decode_speed.py --rounds 50 --size 224 --short-side 249     # DeiT/ViT-B's 224 px input

The images: scikit-image's chelsea as it is (451 x 300, the GPU check's photo) and its astronaut resized to larger
photo sizes, each saved as JPEG (quality 90) and PNG. Each round runs decode, both resamples of the decoded photo
and the three whole paths once, in a shuffled order, in this process pinned to one core; medians over rounds.
Last, the JPEG's header read, Pillow's against service.images.jpeg_header's, without EXIF and with a camera's.
"""
import argparse
import io
import os
import random
import statistics
import sys
import time
import timeit
from pathlib import Path

from PIL import Image
from skimage import data as photos

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from repository import InputPolicy  # noqa: E402
from service.images.decode import decode, model_input, resize_and_crop, upload_input  # noqa: E402
from service.images.jpeg_header import jpeg_header  # noqa: E402

SIZES = [(800, 600), (1600, 1200), (4032, 3024)]


def encoded(image: Image.Image, fmt: str, exif: Image.Exif | None = None) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt, quality=90, **({"exif": exif} if exif else {}))
    return buffer.getvalue()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--size", type=int, default=224, help="the model's input side")
    p.add_argument("--short-side", type=int, default=249, help="resize_short_side of the policy")
    args = p.parse_args()
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    policy = InputPolicy((args.size, args.size), args.short_side, "bicubic", (0.5,) * 3, (0.5,) * 3)
    squash = InputPolicy((args.size, args.size), args.size, "bicubic", (0.5,) * 3, (0.5,) * 3, (args.size,) * 2)
    images = [Image.fromarray(photos.chelsea())] + [Image.fromarray(photos.astronaut()).resize(s, Image.BICUBIC)
                                                     for s in SIZES]
    print(f"one core; input {args.size} px, short side {args.short_side}; ms per image, medians of {args.rounds} "
          "rounds")
    print(f"{'image':>10} {'format':>6} {'KiB':>5} {'decode':>7} {'Pillow resample':>15} {'OpenCV warp':>11} "
          f"{'Pillow+Pillow':>13} {'Pillow+OpenCV':>13} {'now':>6} {'now / Pillow+Pillow':>19} {'HF':>6}")
    for image in images:
        for fmt in ("JPEG", "PNG"):
            data = encoded(image, fmt)
            photo = decode(data, args.short_side, 10**9).image
            calls = {"decode": lambda: decode(data, args.short_side, 10**9),
                     "pillow": lambda: resize_and_crop(photo, policy),
                     "opencv": lambda: model_input(photo, policy),
                     "before": lambda: resize_and_crop(decode(data, args.short_side, 10**9).image, policy),
                     "pillow+opencv": lambda: model_input(decode(data, args.short_side, 10**9).image, policy),
                     "now": lambda: upload_input(data, policy, 10**9),
                     "hf": lambda: upload_input(data, squash, 10**9)}
            times = {k: [] for k in calls}
            for _ in range(args.rounds):
                for k in random.sample(list(calls), len(calls)):
                    start = time.perf_counter()
                    calls[k]()
                    times[k].append(time.perf_counter() - start)
            ms = {k: statistics.median(v) * 1e3 for k, v in times.items()}
            print(f"{'%dx%d' % image.size:>10} {fmt:>6} {len(data) / 1024:>5.0f} {ms['decode']:>7.2f} "
                  f"{ms['pillow']:>15.2f} {ms['opencv']:>11.2f} {ms['before']:>13.2f} {ms['pillow+opencv']:>13.2f} "
                  f"{ms['now']:>6.2f} {ms['now'] / ms['before']:>19.2f} {ms['hf']:>6.2f}")
    headers(images[0], args.rounds)


def headers(image: Image.Image, rounds: int, calls: int = 200) -> None:
    """The header read of the 451 x 300 JPEG, plain and with a camera's EXIF: Pillow's (open and getexif, the
    service's until 2026-11-27) against jpeg_header's, interleaved."""
    exif = Image.Exif()
    exif.update({0x010F: "Maker", 0x0110: "Model X", 0x0132: "2026:11:27 10:00:00", 0x0112: 6})
    print(f"\nthe JPEG's header (size and EXIF orientation), µs per image, medians of {rounds} rounds of {calls}")
    print(f"{'EXIF':>28} {'Pillow':>7} {'jpeg_header':>11} {'ratio':>6}")
    for what, data in (("none", encoded(image, "JPEG")), ("a camera's (4 tags)", encoded(image, "JPEG", exif))):
        reads = {"pillow": lambda: Image.open(io.BytesIO(data)).getexif().get(0x0112),
                 "ours": lambda: jpeg_header(data)}
        times = {k: [] for k in reads}
        for _ in range(rounds):
            for k in random.sample(list(reads), len(reads)):
                times[k].append(timeit.timeit(reads[k], number=calls) / calls)
        us = {k: statistics.median(v) * 1e6 for k, v in times.items()}
        print(f"{what:>28} {us['pillow']:>7.1f} {us['ours']:>11.1f} {us['ours'] / us['pillow']:>6.2f}")


if __name__ == "__main__":
    main()
