"""The parity gate: an exported graph must give the model's answers.

fp32 graphs are compared with PyTorch on real photographs (scikit-image's), preprocessed the model's way,
and on random inputs: logits within 1e-4 and attention outputs within 1e-4, through the float `pixel_values`
input, and the photos again as uint8 through the `images` input (the graph's own normalisation). fp16/int8
graphs are compared with the fp32 graph: top-1 agreement >= 99% on a held-out set (--eval-data, as uint8
images, the way the service sends them). Without one (random-init weights, or none given), on the same inputs:
top-1 agreement >= 99%, or the largest logit error at most 5% of the fp32 logits' spread (each input's largest
minus smallest logit, averaged). Untrained logits are near ties (ViT-B/16's two best differ by 0.003 where fp16
errs by 0.0035, in a spread of 3.7), so agreement alone fails sound conversions; an unsound one (a wrong scale,
a broken op) errs by tens of % of the spread.
"""
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnxruntime as ort
import torch
from PIL import Image
from skimage import data as photos

from models.data import ImageFolder, list_images, normalise, preprocess
from repository import graph_inputs

from .graph import EMBEDDINGS, IMAGES, TENSOR

PHOTOS = ("astronaut", "chelsea", "coffee", "rocket", "camera", "hubble_deep_field", "immunohistochemistry", "coins")
FP32_ABS_TOLERANCE = 1e-4
MIN_TOP1_AGREEMENT = 0.99
MIN_EMBEDDING_COSINE = 0.99  # an embedding model's reduced-precision gate (it has no decisions to agree on)
LOGITS = "logits"
MAX_RELATIVE_LOGIT_ERROR = 0.05  # of the logits' spread; measured: fp16 0.1% (ViT-B/16 on an H100), int8 2% (DeiT-Ti)


class ParityError(RuntimeError):
    """The exported graph does not give the model's answers."""


@dataclass
class GateInputs:
    """probe: normalised float [N, 3, S, S], the photos then random inputs; photos: the same photos as uint8
    [P, S, S, 3]; heldout: an optional labelled set, uint8 [M, S, S, 3]."""
    probe: torch.Tensor
    photos: torch.Tensor
    heldout: torch.Tensor | None = None
    heldout_labels: torch.Tensor | None = None
    sources: dict = field(default_factory=dict)


def gate_inputs(spec, eval_data: Path | None = None, seed: int = 0) -> GateInputs:
    size, policy = spec.img_size, (spec.crop_pct, spec.interpolation, spec.resize_to)
    images = [Image.fromarray(getattr(photos, name)()).convert("RGB") for name in PHOTOS]
    pixels = torch.stack([preprocess(im, size, *policy) for im in images])
    noise = torch.randn(4, 3, size, size, generator=torch.Generator().manual_seed(seed))
    inputs = GateInputs(torch.cat([normalise(pixels / 255, spec), noise]), pixels.permute(0, 2, 3, 1).contiguous(),
                        sources={"photos": list(PHOTOS), "random": 4})
    if eval_data is not None:
        items = list_images(eval_data, list(spec.labels))
        if not items:
            raise ParityError(f"no images of the model's classes ({', '.join(spec.labels)}) under {eval_data}")
        dataset = ImageFolder(items, size, *policy)
        inputs.heldout = torch.stack([dataset[i][0] for i in range(len(dataset))]).permute(0, 2, 3, 1).contiguous()
        inputs.heldout_labels = torch.tensor([label for _, label in items])
        inputs.sources["heldout"] = {"path": str(eval_data), "images": len(items)}
    return inputs


def run_session(session: ort.InferenceSession, x: torch.Tensor, batch: int = 64) -> list[np.ndarray]:
    parts = [session.run(None, graph_inputs(x[i:i + batch].numpy(), (IMAGES, TENSOR)))
             for i in range(0, len(x), batch)]
    return [np.concatenate(outs) for outs in zip(*parts)]


def run_torch(module: torch.nn.Module, x: torch.Tensor, batch: int = 64) -> list[np.ndarray]:
    """The exported module on normalised float [N, 3, H, W] pixels."""
    no_images = torch.zeros(0, *x.shape[2:], 3, dtype=torch.uint8)
    with torch.no_grad():
        parts = [[t.numpy() for t in module(no_images, x[i:i + batch])] for i in range(0, len(x), batch)]
    return [np.concatenate(outs) for outs in zip(*parts)]


def _max_diffs(names: list[str], got: list[np.ndarray], want: list[np.ndarray]) -> dict[str, float]:
    return {n: float(np.abs(g - w).max()) for n, g, w in zip(names, got, want)}


def _agreement(a: np.ndarray, b: np.ndarray) -> float:
    return float((a.argmax(1) == b.argmax(1)).mean())


def min_cosine(a: np.ndarray, b: np.ndarray) -> float:
    """The least cosine similarity between the rows of a and b: how far the worst embedding turned."""
    a, b = a.astype(np.float64), b.astype(np.float64)
    return float(((a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))).min())


def _attention(diffs: dict[str, float]) -> dict[str, float]:
    return {name: d for name, d in diffs.items() if name not in (LOGITS, EMBEDDINGS)}


def check_fp32(session: ort.InferenceSession, module: torch.nn.Module, inputs: GateInputs) -> dict:
    """ONNX Runtime against PyTorch, every output; raises ParityError beyond tolerance."""
    names = [o.name for o in session.get_outputs()]
    got, want = run_session(session, inputs.probe), run_torch(module, inputs.probe)
    diffs = _max_diffs(names, got, want)
    # the photos once more, as uint8 through the graph's own normalisation
    from_images = _max_diffs(names, run_session(session, inputs.photos), [w[:len(inputs.photos)] for w in want])
    report = {"reference": "torch", "provider": session.get_providers()[0], "inputs": inputs.sources}
    if LOGITS in names:
        report.update(logits_max_abs_diff=diffs[LOGITS], top1_agreement=_agreement(got[0], want[0]))
    report["attention_max_abs_diff"] = _attention(diffs)
    if EMBEDDINGS in names:
        report["embeddings_max_abs_diff"] = diffs[EMBEDDINGS]
    report["images_input_max_abs_diff"] = from_images
    worst = max([*diffs.values(), *from_images.values()])
    if worst > FP32_ABS_TOLERANCE:
        raise ParityError(f"ONNX Runtime differs from PyTorch by {worst:.3g} (tolerance {FP32_ABS_TOLERANCE}): "
                          f"{report}")
    if inputs.heldout is not None and LOGITS in names:
        logits = run_session(session, inputs.heldout)[0]
        report["heldout_accuracy"] = float((logits.argmax(1) == inputs.heldout_labels.numpy()).mean())
    return report


def check_reduced(session: ort.InferenceSession, fp32: ort.InferenceSession, inputs: GateInputs) -> dict:
    """A reduced-precision graph against the fp32 graph: top-1 agreement, on the held-out set if given; an embedding
    model (no logits) by how far its embeddings turned (min_cosine)."""
    heldout = inputs.heldout is not None
    x = inputs.heldout if heldout else inputs.probe
    names = [o.name for o in session.get_outputs()]
    got, want = run_session(session, x), run_session(fp32, x)
    report = {"reference": "fp32 graph", "provider": session.get_providers()[0], "inputs": inputs.sources,
              "agreement_on": "heldout" if heldout else "probe"}
    diffs = _max_diffs(names, got, want)
    if EMBEDDINGS in names:
        at = names.index(EMBEDDINGS)
        report["embeddings_min_cosine"] = min_cosine(got[at], want[at])
    if LOGITS not in names:
        report["attention_max_abs_diff"] = _attention(diffs)
        if report["embeddings_min_cosine"] < MIN_EMBEDDING_COSINE:
            raise ParityError(f"the reduced-precision graph fails the gate (every embedding within cosine "
                              f"{MIN_EMBEDDING_COSINE} of fp32's): the least is {report['embeddings_min_cosine']:.4f}")
        return report
    report.update(top1_agreement=_agreement(got[0], want[0]), logits_max_abs_diff=diffs[LOGITS],
                  attention_max_abs_diff=_attention(diffs))
    if heldout:
        labels = inputs.heldout_labels.numpy()
        report["heldout_accuracy"] = float((got[0].argmax(1) == labels).mean())
        report["fp32_heldout_accuracy"] = float((want[0].argmax(1) == labels).mean())
    spread = float(np.ptp(want[0], axis=1).mean())
    report["logits_relative_error"] = report["logits_max_abs_diff"] / spread if spread else float("inf")
    if not reduced_precision_passes(report["top1_agreement"], report["logits_relative_error"], heldout):
        rule = (f"top-1 agreement >= {MIN_TOP1_AGREEMENT} on held-out data" if heldout else
                f"top-1 agreement >= {MIN_TOP1_AGREEMENT} or a logit error <= {MAX_RELATIVE_LOGIT_ERROR:.0%} of the "
                "logits' spread (on photos and random inputs; pass --eval-data with held-out images)")
        raise ParityError(f"the reduced-precision graph fails the gate ({rule}): top-1 agreement "
                          f"{report['top1_agreement']:.3f}, logit error {report['logits_relative_error']:.1%} of the "
                          f"spread: {report}")
    return report


def reduced_precision_passes(agreement: float, relative_error: float, heldout: bool) -> bool:
    """The gate for fp16/int8 graphs: trained models are judged by their decisions on held-out data, others by
    their decisions or, where those are near ties, by how far their logits moved (module docstring)."""
    if heldout:
        return agreement >= MIN_TOP1_AGREEMENT
    return agreement >= MIN_TOP1_AGREEMENT or relative_error <= MAX_RELATIVE_LOGIT_ERROR
