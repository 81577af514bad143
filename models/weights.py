"""Load checkpoints into registry models: timm files, official DeiT/Swin release files, our safetensors.

`.pth`/`.pt` files are read with `torch.load(weights_only=True)`, so a pickle that carries code is refused
before any of it runs.
"""
import argparse
import pickle
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from torch import nn

from . import swin_transformer, vision_transformer
from .mini_xception import MiniXception

# The parts of each architecture that belong to the classifier, i.e. depend on num_classes.
_FILTERS = {
    vision_transformer.VisionTransformer: (vision_transformer.checkpoint_filter_fn, ("head.", "head_dist.")),
    swin_transformer.SwinTransformer: (swin_transformer.checkpoint_filter_fn, ("head.fc.",)),
    MiniXception: (lambda state_dict, model: state_dict, ("head.",)),
}


class WeightsError(ValueError):
    """A checkpoint that cannot be read, or that does not fit the model."""


def read_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    """The tensors of a checkpoint file, unwrapped from `{"model": ...}` / `{"state_dict": ...}`."""
    path = Path(path)
    if not path.is_file():
        raise WeightsError(f"{path}: no such file")
    try:
        if path.suffix == ".safetensors":
            obj = load_file(path)
        else:
            obj = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        first_line = str(e).strip().splitlines()[0]
        raise WeightsError(f"{path}: refused, it holds pickled objects other than tensors ({first_line})") from None
    except (SafetensorError, RuntimeError, EOFError, OSError) as e:
        raise WeightsError(f"{path}: not a readable checkpoint, the file may be truncated ({e})") from None
    for wrapper in ("model", "state_dict"):
        if isinstance(obj, dict) and isinstance(obj.get(wrapper), dict):
            obj = obj[wrapper]
    if not isinstance(obj, dict) or not all(isinstance(v, torch.Tensor) for v in obj.values()):
        raise WeightsError(f"{path}: not a state dict (a mapping of parameter names to tensors)")
    # DistributedDataParallel saves every name with a "module." prefix.
    if obj and all(k.startswith("module.") for k in obj):
        obj = {k.removeprefix("module."): v for k, v in obj.items()}
    return obj


def _problems(state_dict: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], strict: bool) -> list[str]:
    """What keeps `state_dict` from loading: missing and unexpected keys (if strict), then wrong shapes."""
    problems = []
    if strict:
        problems += [f"missing key {k!r} (shape {list(v.shape)})" for k, v in expected.items() if k not in state_dict]
        problems += [f"unexpected key {k!r}" for k in state_dict if k not in expected]
    problems += [f"{k!r} has shape {list(state_dict[k].shape)} in the file, the model {list(v.shape)}"
                 for k, v in expected.items() if k in state_dict and state_dict[k].shape != v.shape]
    return problems


def load_weights(model: nn.Module, path: str | Path, *, strict: bool = True, replace_head: bool = False) -> nn.Module:
    """Load a checkpoint into `model` in place and return it.

    The position embedding (ViT/DeiT) and relative position bias tables (Swin) are resized when the model
    was built for another image or window size. A classifier of another class count is an error unless
    `replace_head=True`, which keeps the model's freshly initialised head and loads everything else.
    With `strict=False`, keys missing from the file keep their initial values and unknown keys are
    ignored, but every shape must still fit.
    """
    try:
        filter_fn, head_prefixes = _FILTERS[type(model)]
    except KeyError:
        raise WeightsError(f"no checkpoint loader for {type(model).__name__}") from None
    state_dict = read_state_dict(path)
    try:
        state_dict = filter_fn(state_dict, model)
    except ValueError as e:
        raise WeightsError(f"{path}: {e}") from None
    expected = model.state_dict()
    head = {k for k in state_dict if k.startswith(head_prefixes)}
    file_classes = next((state_dict[k].shape[0] for k in sorted(head) if k.endswith("weight")), None)
    if file_classes not in (None, model.num_classes) and not replace_head:
        raise WeightsError(
            f"{path}: the checkpoint's classifier has {file_classes} classes, the model {model.num_classes}; "
            "pass --replace-head (python -m models.train or python -m export; replace_head=True in Python) to "
            "start a new classifier")
    if replace_head:
        state_dict = {k: v for k, v in state_dict.items() if k not in head}
        state_dict.update({k: v for k, v in expected.items() if k.startswith(head_prefixes)})
    problems = _problems(state_dict, expected, strict)
    if problems:
        name = model.spec.name if hasattr(model, "spec") else type(model).__name__
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise WeightsError(f"{path} does not fit {name}: {problems[0]}{more}")
    model.load_state_dict({k: v for k, v in state_dict.items() if k in expected}, strict=strict)
    return model


def convert_wheel_main(prog: str, description: str, wheel: str, convert: Callable[[Path, Path], None], out: Path,
                       argv: list[str] | None = None) -> None:
    """The command line of a one-off conversion of the weights a wheel ships into a committed safetensors file."""
    parser = argparse.ArgumentParser(prog=prog, description=description,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("wheel", type=Path, help=wheel)
    parser.add_argument("--out", type=Path, default=out)
    args = parser.parse_args(argv)
    convert(args.wheel, args.out)
    print(f"wrote {args.out}")
