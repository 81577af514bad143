"""What an embedding costs beside a classification: the same JPEG (the 451 x 300 chelsea photo) to POST /classify
(top_k 5), POST /embed (JSON floats) and POST /embed?encoding=base64 on one model, and, with --baseline, /classify
on another checkout's server (the commit before the graphs had an `embeddings` output), under wrk on the same
cores, every route and server interleaved in each round; medians. CPU per request from /proc (bench/http_floor.py's
reader): the HTTP side's and the inference side's.

    python bench/embed.py --model shapes-deit
    git worktree add /tmp/before HEAD~1 && python bench/embed.py --baseline /tmp/before --clients 1 32 --rounds 5
    python bench/embed.py --encoding-only   # what encoding one answer costs the event loop, by vector size
    python bench/embed.py --neighbours 1200  # what the vectors mean: held-out shapes' nearest neighbours' labels

The served demo models' vectors are 128 and 192 floats; --encoding-only times the route's own encoding (normalise,
JSON floats or base64, json.dumps) for the 384 and 768 of DeiT-S and ViT-B too, on this process's one core.
"""
import argparse
import json
import os
import statistics
import sys
import timeit
from contextlib import ExitStack
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "bench"))
import numpy as np  # noqa: E402
import onnxruntime as ort  # noqa: E402
import wrk  # noqa: E402
from http_floor import cpu_reader, measure  # noqa: E402
from service_process import photo_bytes, service_and_process  # noqa: E402

from models.synthetic.shapes import shapes  # noqa: E402
from repository import InputPolicy, graph_inputs, read_entry  # noqa: E402
from service.http.routes.embed import Encoding, encoded, normalized  # noqa: E402
from service.images.decode import model_input  # noqa: E402

SHAPE_MODELS = ("shapes-vit", "shapes-deit", "shapes-swin")


def neighbours(count: int) -> None:
    """Per demo model, the share of `count` held-out shapes (seed 1: the images `make models` scores them on, the
    classes balanced) whose nearest other image by cosine of their embeddings has their label."""
    samples = shapes(seed=1, count=count)
    labels = np.array([s.label for s in samples])
    for name in SHAPE_MODELS:
        entry = read_entry(ROOT / "model_repository" / name)
        policy = InputPolicy.from_manifest(entry.manifest["input"])
        session = ort.InferenceSession(entry.path(), providers=["CPUExecutionProvider"])
        x = np.stack([model_input(s.image, policy) for s in samples])
        vectors = np.concatenate([session.run([entry.embedding["output"]], graph_inputs(x[i:i + 100]))[0]
                                  for i in range(0, count, 100)])
        similarity = normalized(vectors) @ normalized(vectors).T
        np.fill_diagonal(similarity, -np.inf)
        agreement = (labels[similarity.argmax(1)] == labels).mean()
        print(f"{name:<12} {count} held-out shapes: nearest neighbour of the same class {agreement:.1%}")


def encoding_costs(sizes: tuple[int, ...] = (128, 384, 768), images: tuple[int, ...] = (1, 8)) -> None:
    """µs per image to normalise and encode a request's vectors and dump its JSON body, and its bytes per image."""
    print(f"{'size':>5} {'images':>6} {'encoding':>8} {'us/image':>9} {'bytes/image':>11}")
    rng = np.random.default_rng(0)
    for size in sizes:
        for n in images:
            vectors = rng.standard_normal((n, size)).astype(np.float32)
            for encoding in Encoding:
                def answer(vectors: np.ndarray = vectors, encoding: Encoding = encoding) -> bytes:
                    rows = encoded(normalized(vectors), encoding)
                    return json.dumps({"results": [{"embedding": r} for r in rows]}, separators=(",", ":")).encode()
                runs = timeit.repeat(answer, number=200, repeat=5)
                print(f"{size:>5} {n:>6} {encoding:>8} {min(runs) / 200 / n * 1e6:>9.1f} {len(answer()) / n:>11,.0f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="shapes-deit")
    p.add_argument("--clients", nargs="+", type=int, default=[1, 32], help="wrk connections")
    p.add_argument("--seconds", type=float, default=5.0)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--backend", choices=["thread", "process"], default="process")
    p.add_argument("--plan", default="onnxruntime:fp32", help="VITSERVE_CPU_PLAN of every server: one plan for all, "
                                                              "not each start's own measurement's pick")
    p.add_argument("--baseline", type=Path, help="another checkout whose server's /classify is measured beside")
    p.add_argument("--encoding-only", action="store_true", help="time the answer's encoding alone, no server")
    p.add_argument("--neighbours", type=int, metavar="N", help="the demo models' retrieval on N held-out shapes")
    args = p.parse_args()
    if args.encoding_only:
        return encoding_costs()
    if args.neighbours:
        return neighbours(args.neighbours)
    if not wrk.available():
        raise SystemExit("wrk is not installed: apt-get install wrk")
    jpeg = photo_bytes("chelsea", "JPEG", quality=90)
    requests = {"classify": ("/classify", "top_k=5"), "embed json": ("/embed", ""),
                "embed base64": ("/embed", "encoding=base64")}
    runs: dict[tuple[str, int], list[dict]] = {}
    with ExitStack() as stack:
        servers = {"": ROOT, **({"before: ": args.baseline.resolve()} if args.baseline else {})}
        cases = []
        for tag, root in servers.items():
            url, proc = stack.enter_context(service_and_process(root=root, backend=args.backend, workers=1,
                                                                access_log=False, cpu_plan=args.plan))
            read = cpu_reader(args.backend, proc.pid)
            for name, (path, query) in requests.items():
                if tag and name != "classify":
                    continue
                request = wrk.classify_request(jpeg, 1, path, "&".join(filter(None, [f"model={args.model}", query])))
                wrk.run(url, request, max(args.clients), 1)  # warm-up
                cases.append((tag + name, url, read, request))
        for _ in range(args.rounds):
            for clients in args.clients:
                for name, url, read, request in cases:
                    runs.setdefault((name, clients), []).append(measure(url, read, request, clients, args.seconds))
    print(f"{args.model} on {args.plan}, the same JPEG each time, {args.backend} backend with one HTTP worker, wrk on "
          f"the same {os.cpu_count()} cores; medians of {args.rounds} rounds of {args.seconds:g}s")
    print(f"{'route':<18} {'clients':>7} {'req/s':>7} {'p50 ms':>6} {'errors':>6} | {'http ms/req':>11} "
          f"{'inference ms/req':>16}")
    for (name, clients), rounds in runs.items():
        m = {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}
        print(f"{name:<18} {clients:>7} {m['requests_per_s']:>7,.0f} {m['p50']:>6.2f} {m['errors']:>6.0f} | "
              f"{m['http']:>11.3f} {m['inference']:>16.3f}")


if __name__ == "__main__":
    main()
