"""Attention maps from the graph outputs, as grids and as heat maps over the original photo.

last (main graph, no extra inference):
  ViT/DeiT: the last block's [CLS] (or distillation-token) row over the patches, the ViT paper's map;
  Swin:     the attention each last-stage token receives, averaged over the queries of its window. Swin has
            no [CLS]: its classifier averages the last stage's tokens, and in standard configurations that
            stage is one window, so this is where the average query looks.
rollout (explain graph, ViT/DeiT): Abnar & Zuidema (2020): per layer, heads reduced, 0.5 A + 0.5 I with
  rows renormalised, multiplied from the first layer up; the token's row over the patches.

relevance (relevance graph, every classifier exported with one): the map of one label, the image's top label unless
  the request names another (models/relevance.py): Chefer et al. 2021's rule for ViT/DeiT, Grad-CAM on the final-norm
  tokens for Swin, CAM for CNNs. The heads are combined by the rule.

Heads are averaged (head=mean), maxed (head=max) or one is picked (head=<index>); token=both averages the
[CLS] and distillation-token maps of a distilled DeiT. Grids are normalised to [0, 1].
"""
import io
import json
from functools import cache
from pathlib import Path

import numpy as np
from PIL import Image

from service.core.errors import BadInput

COLORMAPS_PATH = Path(__file__).with_name("colormaps.json")


def reduce_heads(rows: np.ndarray, head: str) -> np.ndarray:
    """[heads, ...] -> [...]"""
    if head == "mean":
        return rows.mean(axis=0)
    if head == "max":
        return rows.max(axis=0)
    index = int(head)
    if not 0 <= index < rows.shape[0]:
        raise BadInput(f"head {index} is out of range: this model has {rows.shape[0]} heads", "bad_head")
    return rows[index]


def _tokens(attention: dict, token: str) -> list[str]:
    """Which map kinds a `token` request reads, as keys of the manifest's attention outputs."""
    outputs = attention["outputs"]
    if "received" in outputs:
        return ["received"]
    wanted = ["cls", "dist"] if token == "both" else [token]
    missing = [t for t in wanted if t not in outputs]
    if missing:
        raise BadInput(f"this model has no {missing[0]} token; tokens: {', '.join(outputs)}", "bad_token")
    return wanted


def normalise(grid: np.ndarray) -> np.ndarray:
    low, high = float(grid.min()), float(grid.max())
    return (grid - low) / (high - low) if high > low else np.zeros_like(grid)


def last_layer_grid(outputs: dict[str, np.ndarray], attention: dict, token: str, head: str) -> np.ndarray:
    """One image's main-graph attention outputs -> [gh, gw] in [0, 1]."""
    maps = [reduce_heads(outputs[attention["outputs"][t]], head) for t in _tokens(attention, token)]
    return normalise(np.mean(maps, axis=0).reshape(attention["grid"]))


def check_rollout(attention: dict) -> None:
    if "received" in attention["outputs"]:
        raise BadInput("rollout follows a [CLS] token through the layers: it is defined for ViT/DeiT models; use "
                       "method=last for Swin", "rollout_unavailable")


def rollout_grid(layers: list[np.ndarray], attention: dict, token: str, head: str) -> np.ndarray:
    """One image's per-layer attention [heads, N, N] (explain graph) -> rollout [gh, gw] in [0, 1]."""
    check_rollout(attention)
    n = layers[0].shape[-1]
    rollout = np.eye(n)
    for probs in layers:
        a = 0.5 * reduce_heads(probs.astype(np.float64), head) + 0.5 * np.eye(n)
        rollout = (a / a.sum(axis=-1, keepdims=True)) @ rollout
    prefix = n - int(np.prod(attention["grid"]))
    rows = [rollout[{"cls": 0, "dist": 1}[t], prefix:] for t in _tokens(attention, token)]
    return normalise(np.mean(rows, axis=0).reshape(attention["grid"]))


LABELS_NAMED = 20  # an unknown label's error names this many of the model's labels at most


def relevance_target(labels: list[str], label: str | None, index: int | None) -> tuple[np.ndarray, int | None]:
    """The relevance graph's target for one image, float32 [classes]: one-hot at the label asked for, by name or by
    index, or zeros for the image's top label; and that label's index (None: the top one)."""
    if label is not None and index is not None:
        raise BadInput("name the label to explain by label= or by class=, not both", "bad_label")
    if label is not None:
        if label not in labels:
            named = ", ".join(labels[:LABELS_NAMED]) + (f" ... ({len(labels)} in all: GET /models lists them)"
                                                        if len(labels) > LABELS_NAMED else "")
            raise BadInput(f"{label!r} is not a label of this model; its labels: {named}", "bad_label")
        index = labels.index(label)
    elif index is not None and not 0 <= index < len(labels):
        raise BadInput(f"class {index} is out of range: this model's classes are 0 to {len(labels) - 1}", "bad_class")
    target = np.zeros(len(labels), np.float32)
    if index is not None:
        target[index] = 1
    return target, index


def relevance_grid(rows: np.ndarray, relevance: dict, token: str) -> np.ndarray:
    """One image's relevance graph output [rows, cells] -> [gh, gw] in [0, 1]: the token's row (ViT/DeiT: token=both
    averages the two), or the grid's own row (Swin, CNNs)."""
    names = relevance["rows"]
    if names == ["grid"]:
        return normalise(rows[0].reshape(relevance["grid"]))
    wanted = ["cls", "dist"] if token == "both" else [token]
    if missing := [t for t in wanted if t not in names]:
        raise BadInput(f"this model has no {missing[0]} token; tokens: {', '.join(names)}", "bad_token")
    return normalise(np.mean([rows[names.index(t)] for t in wanted], axis=0).reshape(relevance["grid"]))


@cache
def colormap(name: str) -> np.ndarray:
    tables = json.loads(COLORMAPS_PATH.read_text())
    if name not in tables or name == "source":
        raise BadInput(f"unknown colormap {name!r}; colormaps: {', '.join(k for k in tables if k != 'source')}",
                       "bad_colormap")
    return np.frombuffer(bytes.fromhex(tables[name]), np.uint8).reshape(256, 3)


def fit_within(photo: np.ndarray, box: tuple[float, float, float, float],
               max_side: int) -> tuple[np.ndarray, tuple[float, float, float, float]]:
    """The photo scaled down (and the box with it) so that its longest side is at most `max_side`: a map of an
    8000 x 6000 upload renders in milliseconds, not seconds, and is not a 17 MB PNG."""
    h, w = photo.shape[:2]
    scale = max_side / max(h, w)
    if scale >= 1:
        return photo, box
    size = (max(1, round(w * scale)), max(1, round(h * scale)))
    small = np.asarray(Image.fromarray(photo).resize(size, Image.BILINEAR, reducing_gap=2.0))
    return small, tuple(v * scale for v in box)


def render_png(photo: np.ndarray, grid: np.ndarray, box: tuple[float, float, float, float], overlay: bool,
               alpha: float, cmap: str, max_side: int) -> bytes:
    """The grid upsampled (bilinear) over the region the model saw (`box`, in the photo's pixels), coloured,
    over the photo (uint8 [h, w, 3]) or alone, its longest side at most `max_side`."""
    photo, box = fit_within(photo, box, max_side)
    lut = colormap(cmap)
    x0, y0, x1, y1 = (round(v) for v in box)
    heat = Image.fromarray(grid.astype(np.float32), mode="F").resize((x1 - x0, y1 - y0), Image.BILINEAR)
    heat = lut[(np.clip(np.asarray(heat), 0, 1) * 255).round().astype(np.uint8)]
    if overlay:
        canvas = photo.astype(np.float32)
        region = canvas[y0:y1, x0:x1]
        canvas[y0:y1, x0:x1] = (1 - alpha) * region + alpha * heat[: region.shape[0], : region.shape[1]]
        out = Image.fromarray(canvas.round().astype(np.uint8))
    else:
        out = Image.fromarray(heat)
    buf = io.BytesIO()
    out.save(buf, format="PNG", compress_level=1)  # zlib's fastest: a 451 x 300 map in 8 ms, not 35, 5% larger
    return buf.getvalue()
