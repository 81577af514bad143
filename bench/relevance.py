"""Class-specific relevance maps against the attention maps, on the embedded shapes models: faithfulness, deletion and
cost, each from the repository's own graphs in ONNX Runtime (what the service runs).

    python bench/relevance.py [--models shapes-vit shapes-deit shapes-swin] [--images 100] [--parts two deletion cost]

two:      images with two shapes of two different classes, one in each half (models.synthetic.shapes.two_shapes). For
          each image and each of its two labels, the map for that label passes where it puts more of its mass on that
          label's shape than on the other. A map that is the same for every label (last, rollout) can pass for one
          of the two labels of an image at most: about 50%. And how often the model's two best labels are the two,
          relevance's rate on those scenes and the rest, and its rate with "a rather than b" targets (e_a - e_b).
deletion: held-out single shapes; the grid cells blanked (to the image's mean colour) most relevant first, the true
          label's probability read after each step; the mean over the steps (the area under the curve, Samek et al.
          2017, https://arxiv.org/abs/1509.06321): lower is better, the map found what the answer rests on.
cost:     the relevance graph against the main graph (one forward pass) at batch 1 and 16, interleaved, medians
          (--cuda: on a GPU host).
"""
import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from models.synthetic import sample_rng  # noqa: E402
from models.synthetic.shapes import render_shape, two_shapes  # noqa: E402
from repository import read_entry  # noqa: E402
from service.explain import maps  # noqa: E402

REPOSITORY = Path(__file__).resolve().parent.parent / "model_repository"
SEED = 7_000_000  # held out: the demo data's seeds are 0 (python -m models.synthetic)


class Graphs:
    """A repository folder's graphs in ONNX Runtime (on the CPU, or CUDA), and its maps by method."""

    def __init__(self, folder: Path, cuda: bool = False):
        self.entry = read_entry(folder)
        providers = ["CUDAExecutionProvider", "CPUExecutionProvider"] if cuda else ["CPUExecutionProvider"]
        self.session = {kind: ort.InferenceSession(str(self.entry.path(kind)), providers=providers)
                        for kind in ("model", "explain", "relevance") if self.entry.has(kind)}

    def logits(self, images: np.ndarray) -> np.ndarray:
        h, w = images.shape[1:3]
        return self.session["model"].run(["logits"], {"images": images,
                                                      "pixel_values": np.zeros((0, 3, h, w), np.float32)})[0]

    def maps(self, method: str, images: np.ndarray, targets: np.ndarray) -> np.ndarray:
        """[n, gh, gw] in [0, 1], as the service draws them (token cls, heads averaged)."""
        attention = self.entry.attention
        if method == "relevance":
            _, rows = self.session["relevance"].run(None, {"images": images, "target": targets})
            return np.stack([maps.relevance_grid(r, self.entry.manifest["relevance"], "cls") for r in rows])
        h, w = images.shape[1:3]
        feeds = {"images": images, "pixel_values": np.zeros((0, 3, h, w), np.float32)}
        if method == "rollout":
            layers = self.session["explain"].run(None, feeds)
            return np.stack([maps.rollout_grid([layer[i] for layer in layers], attention, "cls", "mean")
                             for i in range(len(images))])
        session = self.session["model"]
        outputs = dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds)))
        return np.stack([maps.last_layer_grid({k: v[i] for k, v in outputs.items()}, attention, "cls", "mean")
                         for i in range(len(images))])

    @property
    def methods(self) -> list[str]:
        return ["relevance", "last"] + (["rollout"] if "explain" in self.session else [])


def cell_coverage(masks: np.ndarray, grid: tuple[int, int]) -> np.ndarray:
    """[..., S, S] pixel masks -> [..., gh, gw]: each grid cell's share of the shape's pixels."""
    gh, gw = grid
    s = masks.shape[-1]
    cells = masks.reshape(*masks.shape[:-2], gh, s // gh, gw, s // gw).sum(axis=(-3, -1))
    return cells / cells.sum(axis=(-2, -1), keepdims=True)


def two_shape_images(count: int, seed: int = SEED) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """count two-shape images: uint8 [count, 96, 96, 3], their labels [count, 2], their masks [count, 2, 96, 96]."""
    made = [two_shapes(sample_rng(seed, i)) for i in range(count)]
    return (np.stack([np.asarray(image) for image, _, _ in made]), np.array([labels for _, labels, _ in made]),
            np.stack([masks for _, _, masks in made]))


def two_shape_passes(graphs: Graphs, method: str, count: int, seed: int = SEED, rather: bool = False
                     ) -> np.ndarray:
    """[count, 2]: whether the map of each image's each label puts more of its mass on that label's shape than on
    the other's. `rather`: the target is that label less the other (e_a - e_b, "why a rather than b"), a weight
    vector as /v2's target input takes it."""
    images, labels, masks = two_shape_images(count, seed)
    eye = np.eye(len(graphs.entry.labels), dtype=np.float32)
    passed = []
    for j in range(2):  # each image's first label, then its second
        grid = graphs.maps(method, images, eye[labels[:, j]] - rather * eye[labels[:, 1 - j]])
        cover = cell_coverage(masks, grid.shape[1:])  # [count, 2, gh, gw]
        mass = (grid[:, None] * cover).sum(axis=(-2, -1))  # [count, 2]: on each shape
        passed.append(mass[:, j] > mass[:, 1 - j])
    return np.stack(passed, axis=1)


def two_shape_pass_rate(graphs: Graphs, method: str, count: int, seed: int = SEED) -> float:
    """The share of (image, label) pairs that pass (two_shape_passes)."""
    return float(two_shape_passes(graphs, method, count, seed).mean())


def top_two(graphs: Graphs, count: int, seed: int = SEED) -> np.ndarray:
    """[count]: whether a two-shape scene's two labels are the model's two best: what it sees, before any map."""
    images, labels, _ = two_shape_images(count, seed)
    best = np.sort(np.argsort(-graphs.logits(images), axis=1)[:, :2], axis=1)
    return (best == np.sort(labels, axis=1)).all(axis=1)


def deletion_area(graphs: Graphs, method: str, count: int, steps: int = 16, seed: int = SEED + 1) -> float:
    """The true label's probability as the most relevant cells are blanked first, averaged over the steps and the
    images (steps + 1 points, from none blanked to all)."""
    samples = [render_shape(sample_rng(seed, i)) for i in range(count)]
    images = np.stack([np.asarray(s.image) for s in samples])
    labels = np.array([s.label for s in samples])
    grids = graphs.maps(method, images, np.eye(len(graphs.entry.labels), dtype=np.float32)[labels])
    gh, gw = grids.shape[1:]
    side = images.shape[1] // gh
    order = np.argsort(-grids.reshape(count, -1), axis=1, kind="stable")
    fill = images.reshape(count, -1, 3).mean(axis=1).round().astype(np.uint8)
    curve = []
    for k in np.linspace(0, gh * gw, steps + 1).round().astype(int):
        blanked = images.copy()
        for i in range(count):
            for cell in order[i, :k]:
                r, c = divmod(int(cell), gw)
                blanked[i, r * side:(r + 1) * side, c * side:(c + 1) * side] = fill[i]
        logits = graphs.logits(blanked)
        probs = np.exp(logits - logits.max(1, keepdims=True))
        curve.append((probs / probs.sum(1, keepdims=True))[np.arange(count), labels])
    return float(np.mean(curve))


def cost(graphs: Graphs, batch: int, rounds: int = 15) -> tuple[float, float]:
    """Median ms of the main graph and of the relevance graph at `batch`, timed alternately."""
    rng = np.random.default_rng(0)
    size = graphs.entry.policy.size
    images = rng.integers(0, 256, (batch, *size, 3), dtype=np.uint8)
    targets = np.zeros((batch, len(graphs.entry.labels)), np.float32)
    runs = {"model": lambda: graphs.logits(images),
            "relevance": lambda: graphs.session["relevance"].run(None, {"images": images, "target": targets})}
    times = {k: [] for k in runs}
    for _ in range(rounds + 2):
        for name, run in runs.items():
            start = time.perf_counter()
            run()
            times[name].append((time.perf_counter() - start) * 1e3)
    return statistics.median(times["model"][2:]), statistics.median(times["relevance"][2:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["shapes-vit", "shapes-deit", "shapes-swin"])
    parser.add_argument("--repository", type=Path, default=REPOSITORY)
    parser.add_argument("--images", type=int, default=100, help="two-shape images, and deletion's held-out shapes")
    parser.add_argument("--parts", nargs="+", default=["two", "deletion", "cost"], choices=["two", "deletion", "cost"])
    parser.add_argument("--cuda", action="store_true", help="run the graphs on CUDA (a GPU host)")
    args = parser.parse_args()
    for name in args.models:
        graphs = Graphs(args.repository / name, args.cuda)
        rule = graphs.entry.manifest["relevance"]["rule"]
        if "two" in args.parts:
            rates = {m: two_shape_pass_rate(graphs, m, args.images) for m in graphs.methods}
            seen, passes = top_two(graphs, args.images), two_shape_passes(graphs, "relevance", args.images)
            rather = two_shape_passes(graphs, "relevance", args.images, rather=True).mean()
            print(f"{name} ({rule}) two shapes, {2 * args.images} (image, label) pairs on their own shape: "
                  + ", ".join(f"{m} {r:.1%}" for m, r in rates.items())
                  + f"; both labels its top two in {seen.mean():.1%} of the scenes, relevance passing "
                  f"{passes[seen].mean():.1%} of those and {passes[~seen].mean():.1%} of the rest; "
                  f"'a rather than b' targets {rather:.1%}", flush=True)
        if "deletion" in args.parts:
            areas = {m: deletion_area(graphs, m, args.images) for m in graphs.methods}
            print(f"{name} deletion area ({args.images} held-out shapes, lower is better): "
                  + ", ".join(f"{m} {a:.3f}" for m, a in areas.items()), flush=True)
        if "cost" in args.parts:
            provider = graphs.session["relevance"].get_providers()[0]
            for batch in (1, 16):
                forward, explained = cost(graphs, batch)
                print(f"{name} cost at batch {batch} on {provider}: forward {forward:.2f} ms, relevance "
                      f"{explained:.2f} ms, {explained / forward:.2f}x", flush=True)


if __name__ == "__main__":
    main()
