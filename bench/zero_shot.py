"""What a whole CLIP's routes cost (issue 76): zero-shot POST /classify with 6 and with 1,000 labels, kept from an
earlier request (the label cache; the 1,000 as form fields and in the query), against POST /embed of the same JPEG
on the same model, and POST /v1/embeddings of one text, under wrk at 1 and 32 clients, every case interleaved in
each round; medians. CPU per request from /proc (bench/http_floor.py's reader): the HTTP side's and the inference
side's.

    python bench/zero_shot.py --rounds 3 --seconds 5

The model is the tests' tiny CLIP (tests/clip_folder.py: 16-float vectors, 2 blocks a tower, 32 px images), so the
figures are the routes' own cost, the labels' parsing, cache and scoring, more than a model's.
"""
import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path
from urllib.parse import urlencode

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "bench"))
import httpx  # noqa: E402
import wrk  # noqa: E402
from clip_folder import LABELS, save_clip_folder  # noqa: E402
from http_floor import cpu_reader, measure  # noqa: E402
from service_process import photo_bytes, service_and_process  # noqa: E402

from export.__main__ import main as export_main  # noqa: E402
from service.loadtest import BOUNDARY  # noqa: E402

SIX = ["star", "heart", "circle", "square", "triangle", "cross"]


def form(jpeg: bytes, labels: list[str]) -> bytes:
    """A multipart body: the JPEG as `file`, each label a `labels` field."""
    parts = [f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="labels"\r\n\r\n{label}\r\n'.encode()
             for label in labels]
    parts.append(f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="file"; filename="photo.jpg"\r\n'
                 "Content-Type: image/jpeg\r\n\r\n".encode() + jpeg + b"\r\n")
    return b"".join(parts) + f"--{BOUNDARY}--\r\n".encode()


def requests(jpeg: bytes) -> dict[str, wrk.Request]:
    thousand = list(dict.fromkeys(LABELS.read_text().splitlines()))[:1000]
    multipart = {"Content-Type": f"multipart/form-data; boundary={BOUNDARY}"}
    return {"embed": wrk.classify_request(jpeg, 1, "/embed", "model=clip"),
            "zero-shot, 6 labels": wrk.Request("/classify?model=clip", multipart, form(jpeg, SIX)),
            f"zero-shot, {len(thousand)} labels": wrk.Request("/classify?model=clip", multipart, form(jpeg, thousand)),
            f"zero-shot, {len(thousand)} in query": wrk.classify_request(
                jpeg, 1, "/classify", urlencode([("model", "clip"), *(("labels", label) for label in thousand)])),
            "v1/embeddings, 1 text": wrk.Request("/v1/embeddings", {"Content-Type": "application/json"}, json.dumps(
                {"model": "clip", "input": "a small dark red star in the top left"}).encode())}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--clients", nargs="+", type=int, default=[1, 32], help="wrk connections")
    p.add_argument("--seconds", type=float, default=5.0)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--backend", choices=["thread", "process"], default="process")
    args = p.parse_args()
    if not wrk.available():
        raise SystemExit("wrk is not installed: apt-get install wrk")
    jpeg = photo_bytes("chelsea", "JPEG", quality=90)
    runs: dict[tuple[str, int], list[dict]] = {}
    with tempfile.TemporaryDirectory() as folder:
        save_clip_folder(Path(folder) / "clip")
        export_main([str(Path(folder) / "clip"), "--out", str(Path(folder) / "repository"), "--no-explain"])
        with service_and_process(model_repository=Path(folder) / "repository", backend=args.backend, workers=1,
                                 access_log=False, cpu_plan="onnxruntime:fp32") as (url, proc):
            read = cpu_reader(args.backend, proc.pid)
            cases = requests(jpeg)
            for name, request in cases.items():  # each answers, and its labels are kept from here on
                answer = httpx.post(url + request.path, content=request.body, headers=request.headers, timeout=60)
                assert answer.status_code == 200, (name, answer.text[:300])
                wrk.run(url, request, max(args.clients), 1)  # warm-up
            for _ in range(args.rounds):
                for clients in args.clients:
                    for name, request in cases.items():
                        runs.setdefault((name, clients), []).append(
                            measure(url, read, request, clients, args.seconds))
    print(f"the tests' tiny CLIP on onnxruntime:fp32, the chelsea JPEG, {args.backend} backend with one HTTP worker, "
          f"wrk on the same {os.cpu_count()} cores; medians of {args.rounds} rounds of {args.seconds:g}s")
    print(f"{'request':<26} {'clients':>7} {'req/s':>7} {'p50 ms':>6} {'errors':>6} | {'http ms/req':>11} "
          f"{'inference ms/req':>16}")
    for (name, clients), rounds in runs.items():
        m = {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}
        print(f"{name:<26} {clients:>7} {m['requests_per_s']:>7,.0f} {m['p50']:>6.2f} {m['errors']:>6.0f} | "
              f"{m['http']:>11.3f} {m['inference']:>16.3f}")


if __name__ == "__main__":
    main()
