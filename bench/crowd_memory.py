"""What a crowd of faces costs /expression: the face detector's time on a 20-face photo with ONNX Runtime's memory
arena and without it (interleaved, in this process), and the server's memory (thread backend: its RSS; process
backend: its HTTP worker's) after one such photo, then after requests of 20 of them, refused for their faces (413).

    python bench/crowd_memory.py                       # this checkout
    python bench/crowd_memory.py --root /tmp/before    # another (a git worktree of an older commit), to compare
"""
import argparse
import io
import statistics
import sys
import time
from pathlib import Path

import httpx
from PIL import Image
from skimage import data as photos

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
from face_scenes import astronaut_face, paste  # noqa: E402
from service_process import role_pids, service_and_process  # noqa: E402

from repository import face_detector  # noqa: E402
from service.engine.runtime import CPU  # noqa: E402
from service.pipeline import faces  # noqa: E402


def crowd() -> Image.Image:
    """20 astronaut faces of 150 pixels over gravel, 1600 x 1200."""
    scene = Image.fromarray(photos.gravel()).convert("RGB").resize((1600, 1200))
    for i in range(20):
        paste(scene, astronaut_face(), 160 + (i % 5) * 320, 150 + (i // 5) * 300, 150, 0)
    return scene


def rss_mb(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text().splitlines()
    return int(next(line for line in status if line.startswith("VmRSS")).split()[1]) >> 10


def detection(scene: Image.Image, rounds: int) -> None:
    entry, _ = face_detector(ROOT / "model_repository")
    opened = faces.open_session
    detectors = {}
    for arena in (True, False):
        faces.open_session = lambda *args, arena=arena, **kw: opened(*args, **{**kw, "memory_arena": arena})
        detectors[arena] = faces.FaceDetector(entry, [CPU], 1)
    faces.open_session = opened
    times = {arena: [] for arena in detectors}
    for _ in range(rounds):
        for arena, detector in detectors.items():
            start = time.perf_counter()
            detector.detect(scene, faces.DetectorSettings(20, 20, 640))
            times[arena].append(time.perf_counter() - start)
    print("the detector on the 20-face photo, one thread, medians of " + ", ".join(
        f"{len(t)}: {'with' if arena else 'without'} the arena {statistics.median(t) * 1e3:.0f} ms"
        for arena, t in times.items()), flush=True)


def served(root: Path, backend: str, photo: bytes, requests: int) -> None:
    with service_and_process(root=root, backend=backend, workers=1) as (url, proc):
        pid = proc.pid if backend == "thread" else role_pids(proc.pid, "vitserve-http")[0]
        one = httpx.post(f"{url}/expression", files={"file": ("c.jpg", photo)}, timeout=120)
        base = rss_mb(pid)
        print(f"{root} {backend}: one photo {one.status_code}, {len(one.json().get('faces', []))} faces: RSS {base} MB",
              flush=True)
        for i in range(requests):
            r = httpx.post(f"{url}/expression", files=[("files", (f"{j}.jpg", photo)) for j in range(20)],
                           timeout=300)
            print(f"  20 photos, #{i + 1}: {r.status_code} {r.json().get('error', {}).get('code')}; RSS "
                  f"{rss_mb(pid)} MB ({rss_mb(pid) - base:+d})", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--root", type=Path, default=ROOT, help="the checkout whose service runs (default: this one)")
    p.add_argument("--requests", type=int, default=4)
    p.add_argument("--rounds", type=int, default=7)
    args = p.parse_args()
    scene = crowd()
    detection(scene, args.rounds)
    buf = io.BytesIO()
    scene.save(buf, "JPEG", quality=90)
    for backend in ("thread", "process"):
        served(args.root, backend, buf.getvalue(), args.requests)


if __name__ == "__main__":
    main()
