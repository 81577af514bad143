"""Fine-tune (or train from scratch) any registry model on an ImageFolder.

    python -m models.train vit_micro_patch8_96 --data data/shapes --out runs/vit_shapes
    python -m models.train deit_small_distilled_patch16_224 --img-size 112 --data raf-basic \\
        --weights deit_small_distilled_patch16_224.pth --replace-head --teacher runs/teacher/model.safetensors
    python -m models.train deit_micro_distilled_patch16_fer_112 --data data/faces \
        --teacher model_repository/expression-fer2013

AdamW with a linear warm-up then cosine decay, label smoothing, random-resized-crop / flip / colour
jitter on the batch, scenes of two shapes added to every batch for the shapes models (--two-shapes), and DeiT's
hard distillation with --teacher (the student must be a distilled DeiT):
    loss = 1/2 CE(class head, label) + 1/2 CE(distillation head, argmax of the teacher's logits).
The teacher is weights of a registry model (a ViT, a Swin, or the mini-Xception CNN) or an exported model, run
by ONNX Runtime; it sees each augmented batch at its own size and normalisation (the CNN makes it grey itself),
and its classes are matched to the data's by name.

Writes OUT/model.safetensors (its metadata names the model, image size and labels), OUT/labels.txt,
OUT/summary.json (the command, per-epoch loss and held-out accuracy) and OUT/checkpoint.pt, from which
--resume continues an interrupted run.
"""
import argparse
import dataclasses
import json
import math
import shlex
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn
from torch.utils.data import DataLoader
from tqdm import tqdm

from repository import RepositoryError, graph_inputs, read_entry

from .augment import augment
from .data import DataError, ImageFolder, find_splits, normalise
from .labels import SHAPE_LABELS
from .mini_xception import MiniXception
from .registry import create_model, get_spec
from .synthetic.shapes import two_shapes
from .weights import WeightsError, load_weights


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m models.train", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", help="a registry name (python -c 'import models; print(models.list_models())')")
    p.add_argument("--data", type=Path, required=True, help="ImageFolder: DIR/train|val/<label>/ or DIR/<label>/")
    p.add_argument("--out", type=Path, help="output folder (default runs/MODEL)")
    p.add_argument("--weights", type=Path, help="initial weights (.pth/.pt/.safetensors, timm or official layout)")
    p.add_argument("--replace-head", action="store_true",
                   help="start a new classifier when --weights has other classes")
    p.add_argument("--img-size", type=int, help="input size (default: the model's)")
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=5e-4, help="peak learning rate")
    p.add_argument("--min-lr", type=float, default=1e-6)
    p.add_argument("--weight-decay", type=float, default=0.05)
    p.add_argument("--warmup-epochs", type=float, default=2.0)
    p.add_argument("--label-smoothing", type=float, default=0.1)
    p.add_argument("--drop-path", type=float, default=0.1, help="stochastic depth rate")
    p.add_argument("--crop-scale", type=float, default=0.5, help="smallest area fraction of a random crop")
    p.add_argument("--jitter", type=float, default=0.3, help="brightness/contrast/saturation jitter")
    p.add_argument("--two-shapes", type=int, default=0, metavar="N",
                   help="shapes data: N scenes of two shapes of two classes added to every batch, drawn anew, each "
                        "labelled half one class and half the other (models.synthetic.shapes.two_shapes)")
    p.add_argument("--multi-label", action="store_true",
                   help="score each label on its own: a sigmoid per class and binary cross-entropy, a two-shape "
                        "scene's two labels both present (the served scores stay the softmax of the same logits)")
    p.add_argument("--teacher", type=Path, help="teacher for hard distillation: weights, or an exported model "
                                                "(a model repository folder, e.g. model_repository/expression-fer2013)")
    p.add_argument("--teacher-model", help="teacher's registry name (default: from the teacher file's metadata)")
    p.add_argument("--val-fraction", type=float, default=0.1, help="held out when DATA has no val/ split")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workers", type=int, default=1, help="image-decoding worker processes")
    p.add_argument("--max-steps", type=int, help="stop after this many optimiser steps (smoke tests)")
    p.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint.pt")
    args = p.parse_args(argv)
    args.out = args.out or Path("runs") / args.model
    args.command = "python -m models.train " + shlex.join(sys.argv[1:] if argv is None else argv)
    return args


def lr_factor(step: int, warmup: int, total: int, min_ratio: float) -> float:
    """Linear warm-up to 1, then cosine decay to min_ratio."""
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """No weight decay on biases, norms, tokens, position embeddings and bias tables."""
    skip = model.no_weight_decay()
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (no_decay if p.ndim <= 1 or name in skip else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def _in_student_order(teacher_labels: list[str] | None, labels: list[str], path: Path) -> torch.Tensor:
    """For each of the teacher's classes, the student's class of the same name (by position where the teacher
    names none)."""
    if not teacher_labels:
        return torch.arange(len(labels))
    if sorted(teacher_labels) != sorted(labels):
        raise DataError(f"the teacher {path} knows {', '.join(teacher_labels)}; the data {', '.join(labels)}")
    return torch.tensor([labels.index(label) for label in teacher_labels])


def _resized(x: torch.Tensor, size: int) -> torch.Tensor:
    if x.shape[-1] == size:
        return x
    return F.interpolate(x, size=(size, size), mode="bilinear", antialias=True, align_corners=False)


def load_teacher(path: Path, name: str | None, labels: list[str]) -> Callable[[torch.Tensor], torch.Tensor]:
    """A frozen teacher, as a function from the augmented batch (float [B, 3, H, W] in [0, 1]) to its hard labels
    in the student's class order; fed in its own size and normalisation. Either an exported model (a model
    repository folder, or the model.onnx in one: run by ONNX Runtime) or weights, whose architecture comes from
    --teacher-model or from our safetensors metadata."""
    if path.is_dir() or path.suffix == ".onnx":
        return _exported_teacher(path.parent if path.suffix == ".onnx" else path, labels)
    meta = {}
    if path.suffix == ".safetensors" and path.is_file():
        with safe_open(path, "pt") as f:
            meta = f.metadata() or {}
    name = name or meta.get("model")
    if name is None:
        raise DataError(f"cannot tell the teacher's architecture from {path}; pass --teacher-model")
    img_size = int(meta["img_size"]) if "img_size" in meta else None
    teacher = load_weights(create_model(name, num_classes=len(labels), img_size=img_size), path)
    teacher.eval().requires_grad_(False)
    order = _in_student_order(json.loads(meta["labels"]) if "labels" in meta else None, labels, path)

    def targets(x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return order[teacher(normalise(_resized(x, teacher.spec.img_size), teacher.spec)).argmax(dim=1)]

    return targets


def _exported_teacher(folder: Path, labels: list[str]) -> Callable[[torch.Tensor], torch.Tensor]:
    """A model repository folder's graph as a teacher, fed its float `pixel_values` input."""
    import onnxruntime as ort  # only an exported teacher needs it

    try:
        entry = read_entry(folder)
    except (RepositoryError, OSError) as e:
        raise DataError(f"{folder} is not an exported model (python -m export writes one): {e}") from None
    session = ort.InferenceSession(str(entry.path()), providers=["CPUExecutionProvider"])
    names, (size, _) = (entry.manifest["input"]["name"], entry.manifest["tensor_input"]["name"]), entry.policy.size
    order = _in_student_order(entry.labels, labels, folder)

    def targets(x: torch.Tensor) -> torch.Tensor:
        pixels = normalise(_resized(x, size), entry.policy).numpy()
        return order[torch.from_numpy(session.run(["logits"], graph_inputs(pixels, names))[0]).argmax(dim=1)]

    return targets


def with_two_shapes(images: torch.Tensor, targets: torch.Tensor, labels: list[str], n: int, seed: list[int]
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch (uint8 [B, 3, S, S], labels [B]) and n scenes of two shapes of two classes, one in each half, drawn
    from `seed`: the labels as probabilities over `labels` (the data's), a scene's half each. A model that saw one
    shape per image learned no answer for two, and its maps for either label spread over both
    (docs/attention.md#why-this-label)."""
    scenes = [two_shapes(np.random.default_rng([*seed, i]), images.shape[-1]) for i in range(n)]
    pixels = torch.stack([torch.from_numpy(np.asarray(image).copy()).permute(2, 0, 1) for image, _, _ in scenes])
    halves = torch.zeros(n, len(labels))
    for i, (_, drawn, _) in enumerate(scenes):
        halves[i, [labels.index(SHAPE_LABELS[k]) for k in drawn]] = 0.5
    return torch.cat([images, pixels]), torch.cat([F.one_hot(targets, len(labels)).float(), halves])


def multi_label_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Binary cross-entropy of each label's sigmoid against its presence: no label's logit rises by lowering
    another's, so the evidence for one shape is not evidence against the other (docs/attention.md#why-this-label)."""
    present = targets > 0 if targets.is_floating_point() else F.one_hot(targets, logits.shape[1]).bool()
    return F.binary_cross_entropy_with_logits(logits, present.float())


def taught_labels(taught: torch.Tensor, targets: torch.Tensor, classes: int) -> torch.Tensor:
    """--multi-label's distillation targets: the teacher's label present, but in a scene of two shapes (a target row
    of two labels) the scene's two: a teacher that names one of them would teach the distillation token to see one."""
    one = F.one_hot(taught, classes).float()
    if not targets.is_floating_point():
        return one
    present = (targets > 0).float()
    return torch.where(present.sum(1, keepdim=True) > 1, present, one)


@torch.no_grad()
def evaluate(model: nn.Module, loader: DataLoader) -> float:
    model.eval()
    correct = total = 0
    for images, labels in loader:
        logits = model(normalise(images.float() / 255, model.spec))
        correct += (logits.argmax(dim=1) == labels).sum().item()
        total += len(labels)
    return correct / total


def save_model(model: nn.Module, labels: list[str], out: Path) -> None:
    meta = {"model": model.spec.name, "img_size": str(model.spec.img_size), "labels": json.dumps(labels)}
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    save_file(state, out / "model.safetensors", metadata=meta)
    (out / "labels.txt").write_text("\n".join(labels) + "\n")


def train(args: argparse.Namespace) -> dict:
    get_spec(args.model)  # an unknown name fails here, before any data is read
    labels, train_items, val_items = find_splits(args.data, args.val_fraction, args.seed)
    torch.manual_seed(args.seed)
    # stochastic depth is the transformers' (the CNN has none)
    depth = {"drop_path_rate": args.drop_path} if get_spec(args.model).builder is not MiniXception else {}
    model = create_model(args.model, num_classes=len(labels), img_size=args.img_size, **depth)
    model.spec = dataclasses.replace(model.spec, labels=tuple(labels))
    started_from = None  # our trainer's run that made --weights, where its summary is beside them
    if args.weights:
        load_weights(model, args.weights, replace_head=args.replace_head)
        if (before := args.weights.parent / "summary.json").is_file():
            earlier = json.loads(before.read_text())
            started_from = {k: earlier.get(k) for k in ("command", "val_accuracy", "started_from")}
    if args.two_shapes and sorted(labels) != sorted(SHAPE_LABELS):
        raise DataError(f"--two-shapes draws shapes of {', '.join(SHAPE_LABELS)}; the data's classes are "
                        f"{', '.join(labels)}")
    teacher = None
    if args.teacher:
        if not getattr(model, "distilled", False):
            raise DataError(f"--teacher needs a distilled student (a deit_*_distilled_* model), not {args.model}")
        teacher = load_teacher(args.teacher, args.teacher_model, labels)
        model.distilled_training = True

    spec = model.spec
    load = dict(size=spec.img_size, crop_pct=spec.crop_pct, interpolation=spec.interpolation)
    # Training images keep their whole centre square (no crop_pct margin): the random crop is the augmentation.
    train_set = ImageFolder(train_items, spec.img_size, 1.0, spec.interpolation)
    val_loader = DataLoader(ImageFolder(val_items, **load), batch_size=args.batch_size * 2, num_workers=args.workers)
    steps_per_epoch = math.ceil(len(train_set) / args.batch_size)
    total_steps = args.epochs * steps_per_epoch
    optimizer = torch.optim.AdamW(param_groups(model, args.weight_decay), lr=args.lr)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(
        s, round(args.warmup_epochs * steps_per_epoch), total_steps, args.min_lr / args.lr))
    criterion = multi_label_loss if args.multi_label else nn.CrossEntropyLoss(label_smoothing=args.label_smoothing)

    args.out.mkdir(parents=True, exist_ok=True)
    checkpoint_path = args.out / "checkpoint.pt"
    history, start_epoch, step = [], 0, 0
    if args.resume and checkpoint_path.is_file():
        state = torch.load(checkpoint_path, map_location="cpu", weights_only=True)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        history, start_epoch, step = state["history"], state["epoch"] + 1, state["step"]
        print(f"resuming after epoch {start_epoch} (step {step})", file=sys.stderr)

    started = time.time()
    for epoch in range(start_epoch, args.epochs):
        torch.manual_seed(args.seed + epoch)  # data order and augmentation replay exactly on --resume
        loader = DataLoader(train_set, batch_size=args.batch_size, shuffle=True, drop_last=False,
                            num_workers=args.workers, persistent_workers=False)
        model.train()
        losses = []
        bar = tqdm(loader, desc=f"epoch {epoch + 1}/{args.epochs}", file=sys.stderr, leave=False)
        for images, targets in bar:
            if args.two_shapes:
                images, targets = with_two_shapes(images, targets, labels, args.two_shapes, [args.seed, epoch, step])
            x = augment(images.float() / 255, args.crop_scale, args.jitter)
            out = model(normalise(x, spec))
            if teacher is not None:
                cls_logits, dist_logits = out
                taught = teacher(x)
                if args.multi_label:
                    distilled = multi_label_loss(dist_logits, taught_labels(taught, targets, len(labels)))
                else:
                    distilled = F.cross_entropy(dist_logits, taught)
                loss = 0.5 * criterion(cls_logits, targets) + 0.5 * distilled
            else:
                loss = criterion(out, targets)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            step += 1
            losses.append(loss.item())
            bar.set_postfix(loss=f"{loss.item():.3f}", lr=f"{scheduler.get_last_lr()[0]:.2e}")
            if args.max_steps and step >= args.max_steps:
                break
        accuracy = evaluate(model, val_loader)
        history.append({"epoch": epoch + 1, "loss": sum(losses) / len(losses), "val_accuracy": accuracy})
        print(f"epoch {epoch + 1}/{args.epochs}: loss {history[-1]['loss']:.4f}, held-out accuracy {accuracy:.4f}",
              file=sys.stderr)
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                    "scheduler": scheduler.state_dict(), "history": history, "epoch": epoch, "step": step},
                   checkpoint_path)
        if args.max_steps and step >= args.max_steps:
            break

    save_model(model, labels, args.out)
    summary = {
        "model": args.model,
        "command": args.command,
        "labels": labels,
        "train_images": len(train_set),
        "val_images": len(val_items),
        "val_accuracy": history[-1]["val_accuracy"] if history else None,
        "history": history,
        "seconds": round(time.time() - started, 1),
        **({"started_from": started_from} if started_from else {}),
    }
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    try:
        summary = train(args)
    except (DataError, WeightsError, KeyError) as e:
        sys.exit(f"error: {e.args[0] if isinstance(e, KeyError) else e}")
    print(f"held-out accuracy {summary['val_accuracy']:.4f}; weights in {args.out / 'model.safetensors'}",
          file=sys.stderr)


if __name__ == "__main__":
    main()
