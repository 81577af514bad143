"""Decode + preprocess cost per megapixel: what an upload costs the service before inference.

    python bench/decode_speed.py

A real photograph (scikit-image's astronaut) resized to several sizes and encoded as JPEG (quality 90) and
PNG, then run through the service's own decoding for a 224 px model (resize the short side to 248, centre-crop
224, uint8 out: the graph normalises). JPEG is timed with draft mode (what the service does: the decoder skips
detail the model would throw away) and at full size; medians over rounds, alternating.
"""
import io
import random
import statistics
import sys
import time
from pathlib import Path

from PIL import Image
from skimage import data as photos

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from repository import InputPolicy  # noqa: E402
from service.decode import decode, model_input  # noqa: E402

POLICY = InputPolicy((224, 224), 248, "bicubic", (0.485, 0.456, 0.406), (0.229, 0.224, 0.225))
SIZES = [(800, 600), (1600, 1200), (3264, 2448), (4032, 3024)]


def encoded(size: tuple[int, int], fmt: str) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(photos.astronaut()).resize(size, Image.BICUBIC).save(buf, format=fmt, quality=90)
    return buf.getvalue()


def prepare(data: bytes, short_side: int | None) -> None:
    model_input(decode(data, short_side, 10**9).image, POLICY)


def main(rounds: int = 9) -> None:
    print(f"{'image':>11} {'MP':>5} {'format':>6} {'KiB':>6} {'ms (service)':>13} {'ms/MP':>7} {'ms full-size':>13}")
    for w, h in SIZES:
        mp = w * h / 1e6
        for fmt in ("JPEG", "PNG"):
            data = encoded((w, h), fmt)
            calls = {"service": lambda: prepare(data, POLICY.resize_short_side)}
            if fmt == "JPEG":
                calls["full"] = lambda: prepare(data, None)
            times = {k: [] for k in calls}
            for _ in range(rounds):
                for k in random.sample(list(calls), len(calls)):
                    start = time.perf_counter()
                    calls[k]()
                    times[k].append(time.perf_counter() - start)
            served = statistics.median(times["service"]) * 1e3
            full = f"{statistics.median(times['full']) * 1e3:>13.1f}" if "full" in times else f"{'-':>13}"
            print(f"{f'{w}x{h}':>11} {mp:>5.1f} {fmt:>6} {len(data) / 1024:>6.0f} {served:>13.1f} {served / mp:>7.1f} {full}")


if __name__ == "__main__":
    main()
