"""A Hugging Face transformers folder as a registry model, read without transformers: ViT, DeiT (both heads, or
the fine-tuned single head) and Swin v1 classifiers, and embedding models (no classifier): the base ViTModel,
DeiTModel and SwinModel, Dinov2Model, Dinov2WithRegistersModel, CLIPVisionModel and CLIPVisionModelWithProjection,
and a whole CLIPModel's or SiglipModel's image tower (its text tower: models.hf_clip).

    folder/config.json                 the architecture, id2label, layer_norm_eps, hidden_act, problem_type
    folder/model.safetensors           (or model.safetensors.index.json with its shards, or pytorch_model.bin)
    folder/preprocessor_config.json    how the images were resized and normalised (ViT/DeiT/Bit/CLIPImageProcessor)

`read_folder` turns it into a `ModelSpec` (the architecture from the config, the labels from id2label, the input
policy from the image processor) and a state dict in timm's names: q, k and v joined into qkv, the rest renamed
(the key map: docs/export.md, "From Hugging Face" and "Embedding folders"). A folder without classifier weights is
an embedding model: no labels, task "embedding", num_classes 0, its embedding what transformers gives as the
model's own: `pooler_output` (the ViT and DeiT pooler, where the folder has one; DINOv2's final-norm [CLS]; Swin's
mean of the last tokens), or CLIP's `image_embeds`; `pooling` (python -m export --pooling) chooses another.
Every setting this cannot serve exactly is refused with one sentence naming the key and its value, so that a model
never answers differently from transformers in silence.
"""
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from .registry import ModelSpec
from .swin_transformer import SwinTransformer
from .vision_transformer import VisionTransformer
from .weights import WeightsError, read_state_dict

# transformers' PILImageResampling values, as the processor's `resample` stores them
RESAMPLE = {0: "nearest", 1: "lanczos", 2: "bilinear", 3: "bicubic", 4: "box", 5: "hamming"}
SERVED_RESAMPLE = ("nearest", "bilinear", "bicubic", "lanczos")
CLIP_MEAN, CLIP_STD = (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)
_SHORT_SIDE_CROP = dict(do_resize=True, size={"shortest_edge": 224}, resample=3, do_center_crop=True,
                        crop_size={"height": 224, "width": 224}, do_rescale=True, rescale_factor=1 / 255,
                        do_normalize=True, image_mean=CLIP_MEAN, image_std=CLIP_STD)
# each processor's defaults where its file leaves a key out (transformers' classes'). BitImageProcessor's are CLIP's:
# DINOv2's folders set their own (shortest_edge 256, crop 224, ImageNet's mean and std)
PROCESSOR_DEFAULTS = {
    "ViTImageProcessor": dict(do_resize=True, size={"height": 224, "width": 224}, resample=2, do_center_crop=False,
                              do_rescale=True, rescale_factor=1 / 255, do_normalize=True,
                              image_mean=[0.5] * 3, image_std=[0.5] * 3),
    "DeiTImageProcessor": dict(do_resize=True, size={"height": 256, "width": 256}, resample=3, do_center_crop=True,
                               crop_size={"height": 224, "width": 224}, do_rescale=True, rescale_factor=1 / 255,
                               do_normalize=True, image_mean=[0.485, 0.456, 0.406], image_std=[0.229, 0.224, 0.225]),
    "BitImageProcessor": _SHORT_SIDE_CROP,
    "CLIPImageProcessor": _SHORT_SIDE_CROP,
    "SiglipImageProcessor": dict(do_resize=True, size={"height": 224, "width": 224}, resample=3, do_center_crop=False,
                                 do_rescale=True, rescale_factor=1 / 255, do_normalize=True,
                                 image_mean=[0.5] * 3, image_std=[0.5] * 3),
}
SERVED = ("vit", "deit", "swin", "dinov2", "dinov2_with_registers", "clip_vision_model", "siglip_vision_model")
WHOLE = {"clip": "clip_vision_model", "siglip": "siglip_vision_model"}  # image and text: the image tower's type
# each type's activations, by transformers' names (ours: models.layers.ACTIVATIONS), the default first
ACTIVATIONS = {"clip_vision_model": {"quick_gelu": "quick_gelu", "gelu": "gelu"},
               "siglip_vision_model": {"gelu_pytorch_tanh": "gelu_tanh"}}
# --pooling's choices: an embedding folder's pooling by another name than the model's own (VisionTransformer's
# global_pool); Swin's is its tokens' mean alone
POOLINGS = {"cls": "token", "mean": "avg", "cls+mean": "token_avg", "pooler": "pooler"}
EXPRESSIONS = {"angry", "anger", "disgust", "disgusted", "fear", "fearful", "happy", "happiness", "sad", "sadness",
               "surprise", "surprised", "neutral", "contempt"}
# per block, transformers' module path -> ours (timm's), after q, k and v are joined
_VIT_BLOCK = {"attention.output.dense": "attn.proj", "layernorm_before": "norm1", "layernorm_after": "norm2",
              "intermediate.dense": "mlp.fc1", "output.dense": "mlp.fc2"}
_VIT_EMBEDDINGS = {"cls_token": "cls_token", "distillation_token": "dist_token", "position_embeddings": "pos_embed",
                   "patch_embeddings.projection": "patch_embed.proj"}
_SWIN_BLOCK = {**_VIT_BLOCK, "attention.self.relative_position_bias_table": "attn.relative_position_bias_table"}
_DINOV2_BLOCK = {"attention.output.dense": "attn.proj", "norm1": "norm1", "norm2": "norm2", "mlp.fc1": "mlp.fc1",
                 "mlp.fc2": "mlp.fc2"}
_CLIP_BLOCK = {"self_attn.out_proj": "attn.proj", "layer_norm1": "norm1", "layer_norm2": "norm2", "mlp.fc1": "mlp.fc1",
               "mlp.fc2": "mlp.fc2"}


@dataclass(frozen=True)
class HFModel:
    spec: ModelSpec
    state_dict: dict[str, torch.Tensor]  # timm's names, float32
    scores: str  # softmax, or sigmoid for problem_type multi_label_classification (each label on its own)
    source: dict  # for the manifest: where the folder came from
    files: list[Path]  # the weight files read

    def build(self) -> torch.nn.Module:
        """The model with the folder's weights, in eval mode, `spec` attached as create_model does."""
        model = self.spec.builder(img_size=self.spec.img_size, num_classes=self.spec.num_classes, **self.spec.arch)
        model.spec = self.spec
        expected = model.state_dict()
        problems = [f"missing {k}" for k in expected if k not in self.state_dict]
        problems += [f"unexpected {k}" for k in self.state_dict if k not in expected]
        problems += [f"{k} is {list(v.shape)} in the folder, {list(expected[k].shape)} in the model"
                     for k, v in self.state_dict.items() if k in expected and v.shape != expected[k].shape]
        if problems:
            raise WeightsError(f"{self.source['folder']}: the weights do not fit the config: {problems[0]}"
                               + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""))
        model.load_state_dict(self.state_dict)
        return model.eval()


def is_folder(path: str | Path) -> bool:
    return (Path(path) / "config.json").is_file()


def read_folder(folder: str | Path, task: str | None = None, pooling: str | None = None) -> HFModel:
    """The folder as a spec and weights in our names, its embedding pooled as the model pools it, or by `pooling`
    (POOLINGS); WeightsError naming what cannot be served as it is."""
    folder = Path(folder)
    config = _json(folder / "config.json")
    kind = config.get("model_type")
    whole = kind if kind in WHOLE else None  # its image tower here; its text tower is models.hf_clip's
    if whole:
        config = {**(config.get("vision_config") or {}), "model_type": WHOLE[whole],
                  **{k: config[k] for k in ("architectures", "transformers_version") if k in config}}
        kind = WHOLE[whole]
    if kind not in SERVED:
        raise WeightsError(f"{folder}: model_type {kind!r} is not served; ViT, DeiT, Swin (v1), DINOv2, CLIP's and "
                           "SigLIP's image towers are")
    activations = ACTIVATIONS.get(kind, {"gelu": "gelu"})
    _refuse(config.get("hidden_act", next(iter(activations))) not in activations, "hidden_act",
            config.get("hidden_act"), f"only {' and '.join(activations)} {'are' if len(activations) > 1 else 'is'} "
            "served")
    _refuse(config.get("num_channels", 3) != 3, "num_channels", config.get("num_channels"), "images are RGB")
    files = weight_files(folder)
    state = {k: v.float() for path in files for k, v in read_state_dict(path).items()
             if not (whole and k.startswith(("text_model.", "text_projection.", "logit_scale", "logit_bias")))}
    dinov2 = kind.startswith("dinov2")
    # DINOv2 interpolates its position embedding to whatever it is given: it serves its processor's size
    img_size, policy = _policy(folder / "preprocessor_config.json", None if dinov2 else config["image_size"])
    if kind == "swin":
        arch, state = _swin(config, state)
    elif kind == "clip_vision_model":
        arch, state = _clip(config, state)
    elif kind == "siglip_vision_model":
        arch, state = _siglip(config, state)
    elif dinov2:
        arch, state = _dinov2(config, state, img_size)
    else:
        arch, state = _vit(config, state)
    if pooling is not None:
        arch, state = _pooled(kind, arch, state, pooling)
    name = (config.get("architectures") or [kind])[0]
    if not any(k.startswith("head.") for k in state):  # no classifier: an embedding model
        if task not in (None, "embedding"):
            raise WeightsError(f"--task {task}: the folder holds a base model without a classifier, an embedding model")
        labels, task = [], "embedding"
    else:
        labels = _labels(config)
        expression = task == "expression" or (task is None and {label.lower() for label in labels} <= EXPRESSIONS)
        task = "expression" if expression else "classification"
    spec = ModelSpec(name, SwinTransformer if kind == "swin" else VisionTransformer, arch, img_size=img_size,
                     num_classes=len(labels), labels=tuple(labels), task=task, timm=False, **policy)
    source = {"folder": str(folder), "model_type": whole or kind,
              "architectures": config.get("architectures", []),
              **({"transformers_version": config["transformers_version"]} if "transformers_version" in config else {})}
    scores = "sigmoid" if config.get("problem_type") == "multi_label_classification" else "softmax"
    return HFModel(spec, state, scores, source, files)


def _pooled(kind: str, arch: dict, state: dict[str, torch.Tensor], pooling: str) -> tuple[dict, dict]:
    """The architecture pooling its embedding by `pooling` (POOLINGS) in place of the model's own, the pooler's
    weights left out where it is not used; WeightsError where the folder cannot pool so."""
    if pooling not in POOLINGS:
        raise WeightsError(f"--pooling {pooling}: one of {', '.join(POOLINGS)}")
    if kind == "swin":
        if pooling != "mean":
            raise WeightsError(f"--pooling {pooling}: Swin has no [CLS] token and no pooler; its embedding is the "
                               "mean of its last tokens (--pooling mean)")
        return arch, state
    if arch.get("global_pool") == "map":
        raise WeightsError(f"--pooling {pooling}: SigLIP's image tower has no [CLS]; its embedding is its "
                           "attention-pooling head's (pooler_output)")
    if arch.get("proj_dim") and pooling != "cls":
        raise WeightsError(f"--pooling {pooling}: CLIP's visual projection reads the final-norm [CLS] alone "
                           "(--pooling cls, its image_embeds)")
    if pooling == "pooler" and "pooler.0.weight" not in state:
        raise WeightsError("--pooling pooler: the folder has no pooler (pooler.dense); --pooling cls, mean or cls+mean")
    kept = {k: v for k, v in state.items() if pooling == "pooler" or not k.startswith("pooler.")}
    return {**arch, "global_pool": POOLINGS[pooling]}, kept


def _refuse(condition: bool, key: str, value, why: str) -> None:
    if condition:
        raise WeightsError(f"{key} = {value!r} in the folder's config: {why}")


def _json(path: Path) -> dict:
    if not path.is_file():
        raise WeightsError(f"{path.parent}: no {path.name}")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise WeightsError(f"{path}: not JSON ({e})") from None


def weight_files(folder: Path) -> list[Path]:
    """model.safetensors, its shards (model.safetensors.index.json), or pytorch_model.bin."""
    if (index := folder / "model.safetensors.index.json").is_file():
        return [folder / shard for shard in sorted(set(_json(index)["weight_map"].values()))]
    for name in ("model.safetensors", "pytorch_model.bin"):
        if (folder / name).is_file():
            return [folder / name]
    raise WeightsError(f"{folder}: no model.safetensors or pytorch_model.bin")


def _labels(config: dict) -> list[str]:
    id2label = config.get("id2label") or {}
    if not id2label:
        raise WeightsError("the folder's config has no id2label: the classes have no names")
    indices = sorted(int(i) for i in id2label)
    if indices != list(range(len(indices))):
        raise WeightsError(f"id2label's keys are {indices[:5]}..., not 0 to {len(indices) - 1}")
    return [str(id2label[str(i)]) for i in indices]


def _joined(state: dict[str, torch.Tensor], prefix: str, names: tuple[str, str, str]) -> dict[str, torch.Tensor]:
    """q, k and v at `prefix` + each of `names`, concatenated into one qkv weight (and bias, where they have one)."""
    out = {"weight": torch.cat([state.pop(f"{prefix}{n}.weight") for n in names])}
    if f"{prefix}{names[0]}.bias" in state:
        out["bias"] = torch.cat([state.pop(f"{prefix}{n}.bias") for n in names])
    return out


def _encoder(state: dict[str, torch.Tensor], depth: int, layer: str, attention: str, qkv: tuple[str, str, str],
             block: dict[str, str]) -> list[tuple[str, str]]:
    """The `depth` blocks at `layer`.i: their q, k and v (at `attention` + each of `qkv`) joined into blocks.i.attn.qkv
    in `state`, and the rules renaming the rest of each block (`block`: its module paths -> ours)."""
    for i in range(depth):
        joined = _joined(state, f"{layer}.{i}.{attention}", qkv)
        state.update({f"blocks.{i}.attn.qkv.{k}": v for k, v in joined.items()})
    return [(rf"{re.escape(layer)}\.(\d+)\.{re.escape(theirs)}\.(weight|bias)", rf"blocks.\1.{ours}.\2")
            for theirs, ours in block.items()]


def _renamed(state: dict[str, torch.Tensor], rules: list[tuple[str, str]]) -> dict[str, torch.Tensor]:
    """Every key through the first matching (regex, replacement); a key no rule matches is left as it is (and then
    refused as unexpected by HFModel.build)."""
    out = {}
    for key, value in state.items():
        for pattern, replacement in rules:
            if re.fullmatch(pattern, key):
                key = re.sub(pattern, replacement, key)
                break
        out[key] = value
    return out


def _vit(config: dict, state: dict[str, torch.Tensor]) -> tuple[dict, dict[str, torch.Tensor]]:
    """ViT or DeiT: the architecture's arguments and the state dict in our names."""
    prefix = next((p for p in ("vit.", "deit.") if any(k.startswith(p) for k in state)), "")
    # the base model's pooler (dense + tanh on [CLS]) makes its pooler_output, the embedding where there is one
    state = {k.removeprefix(prefix): v for k, v in state.items() if not k.startswith(f"{prefix}embeddings.mask_token")}
    classifier = any(k in state for k in ("classifier.weight", "cls_classifier.weight"))
    depth, dim = config["num_hidden_layers"], config["hidden_size"]
    if "pooler.dense.weight" in state:  # the embedding: transformers' ViTPooler / DeiTPooler, as this builds it
        _refuse(config.get("pooler_act", "tanh") != "tanh", "pooler_act", config.get("pooler_act"),
                "the pooler is built with tanh")
        _refuse(config.get("pooler_output_size", dim) != dim, "pooler_output_size", config.get("pooler_output_size"),
                f"the pooler is built to hidden_size {dim}")
    rules = _encoder(state, depth, "encoder.layer", "attention.attention.", ("query", "key", "value"), _VIT_BLOCK)
    rules += [(rf"embeddings\.{re.escape(theirs)}(\.weight|\.bias|)", rf"{ours}\1")
              for theirs, ours in _VIT_EMBEDDINGS.items()]
    rules += [(r"layernorm\.(weight|bias)", r"norm.\1"), (r"(cls_)?classifier\.(weight|bias)", r"head.\2"),
              (r"distillation_classifier\.(weight|bias)", r"head_dist.\1"),
              (r"pooler\.dense\.(weight|bias)", r"pooler.0.\1")]
    distilled = "embeddings.distillation_token" in state
    arch = dict(patch_size=config["patch_size"], embed_dim=dim, depth=depth, num_heads=config["num_attention_heads"],
                mlp_ratio=config["intermediate_size"] / dim, qkv_bias=config.get("qkv_bias", True),
                # a base DeiT pools both tokens: timm's pre-logits of the distilled DeiT
                distilled=distilled, dist_head="distillation_classifier.weight" in state or not classifier,
                norm_eps=config.get("layer_norm_eps", 1e-12),
                global_pool="pooler" if "pooler.dense.weight" in state else "token")
    return arch, _renamed(state, rules)


def _swin(config: dict, state: dict[str, torch.Tensor]) -> tuple[dict, dict[str, torch.Tensor]]:
    """Swin v1: the architecture's arguments and the state dict in our names (downsampling at the start of the
    next stage, as the official release and timm place it)."""
    _refuse(config.get("use_absolute_embeddings", False), "use_absolute_embeddings", True,
            "absolute position embeddings are not served")
    _refuse(config.get("layer_norm_eps", 1e-5) != 1e-5, "layer_norm_eps", config.get("layer_norm_eps"),
            "Swin is served with 1e-5")
    depths, window = config["depths"], config["window_size"]
    grid = config["image_size"] // config["patch_size"]
    for i in range(len(depths)):
        stage = -(-grid // 2**i)
        _refuse(stage > window and stage % window, "window_size", window,
                f"stage {i}'s {stage}x{stage} grid is not a multiple of it, and transformers pads such a grid "
                "before the shift where this model pads after: pick an image_size whose grids divide")
    state = {k.removeprefix("swin."): v for k, v in state.items()
             if not k.endswith(("relative_position_index", "attn_mask")) and not k.startswith("swin.pooler")}
    for i, depth in enumerate(depths):
        for j in range(depth):
            qkv = _joined(state, f"encoder.layers.{i}.blocks.{j}.attention.self.", ("query", "key", "value"))
            state.update({f"layers.{i}.blocks.{j}.attn.qkv.{k}": v for k, v in qkv.items()})
    rules = [(rf"encoder\.layers\.(\d+)\.blocks\.(\d+)\.{re.escape(theirs)}(\.weight|\.bias|)",
              rf"layers.\1.blocks.\2.{ours}\3") for theirs, ours in _SWIN_BLOCK.items()]
    rules += [(r"embeddings\.patch_embeddings\.projection\.(weight|bias)", r"patch_embed.proj.\1"),
              (r"embeddings\.norm\.(weight|bias)", r"patch_embed.norm.\1"),
              (r"layernorm\.(weight|bias)", r"norm.\1"), (r"classifier\.(weight|bias)", r"head.fc.\1")]
    state = _renamed(state, rules)
    # transformers ends stage i with the merging that our stage i + 1 begins with
    state = {re.sub(r"^encoder\.layers\.(\d+)\.downsample", lambda m: f"layers.{int(m[1]) + 1}.downsample", k): v
             for k, v in state.items()}
    arch = dict(patch_size=config["patch_size"], window_size=window, embed_dim=config["embed_dim"],
                depths=tuple(depths), num_heads=tuple(config["num_heads"]), mlp_ratio=config.get("mlp_ratio", 4.0),
                qkv_bias=config.get("qkv_bias", True))
    return arch, state


def _dinov2(config: dict, state: dict[str, torch.Tensor], img_size: int) -> tuple[dict, dict[str, torch.Tensor]]:
    """Dinov2Model or Dinov2WithRegistersModel: the architecture's arguments (layer scale, registers; the embedding
    its pooler_output, the final-norm [CLS]) and the state dict in our names, the position embedding resized to
    `img_size`'s grid as transformers resizes it on every call."""
    registers = config["model_type"] == "dinov2_with_registers"
    _refuse(config.get("use_swiglu_ffn", False), "use_swiglu_ffn", True,
            "the SwiGLU MLP (DINOv2's ViT-g) is not built; the MLP of ViT-S, B and L is")
    dim, heads, patch = config["hidden_size"], config["num_attention_heads"], config["patch_size"]
    _refuse(config.get("head_dim", dim // heads) * heads != dim, "head_dim", config.get("head_dim"),
            f"the heads must split hidden_size {dim} evenly")
    # options transformers 5.23 does not have, and whose effect on the resize this would not reproduce
    for key, value in config.items():
        _refuse(key.startswith("interpolat"), key, value, "the position embedding is resized as transformers 5.23 "
                "resizes it (bicubic to the grid's size, no offset), which has no such option")
    _refuse(not isinstance(patch, int), "patch_size", patch, "square patches alone are served")
    _refuse(img_size % patch, "patch_size", patch,
            f"the processor's {img_size}x{img_size} images are not a whole number of patches")
    if "classifier.weight" in state:
        raise WeightsError("classifier.weight in a DINOv2 folder: Dinov2ForImageClassification is not served, its "
                           "base Dinov2Model is (an embedding model)")
    depth = config["num_hidden_layers"]
    state = {k: v for k, v in state.items() if k != "embeddings.mask_token"}
    state["pos_embed"] = interpolated_pos_embed(state.pop("embeddings.position_embeddings"), img_size // patch,
                                                antialias=registers)
    rules = _encoder(state, depth, "encoder.layer", "attention.attention.", ("query", "key", "value"), _DINOV2_BLOCK)
    rules += [(r"encoder\.layer\.(\d+)\.layer_scale([12])\.lambda1", r"blocks.\1.ls\2.gamma"),
              (r"embeddings\.cls_token", "cls_token"), (r"embeddings\.register_tokens", "reg_token"),
              (r"embeddings\.patch_embeddings\.projection\.(weight|bias)", r"patch_embed.proj.\1"),
              (r"layernorm\.(weight|bias)", r"norm.\1")]
    arch = dict(patch_size=patch, embed_dim=dim, depth=depth, num_heads=heads, mlp_ratio=config.get("mlp_ratio", 4),
                qkv_bias=config.get("qkv_bias", True), norm_eps=config.get("layer_norm_eps", 1e-6),
                init_values=1.0,  # any: the folder's lambda1 replace it
                reg_tokens=config.get("num_register_tokens", 4) if registers else 0)
    return arch, _renamed(state, rules)


def interpolated_pos_embed(pos_embed: torch.Tensor, grid: int, antialias: bool) -> torch.Tensor:
    """transformers' DINOv2 `interpolate_pos_encoding` (5.23), done once for the served grid: [CLS]'s kept, the patch
    positions resized bicubically to grid x grid (a size, not a scale factor; align_corners False; antialias in
    Dinov2WithRegisters alone) in float32; left as they are where the grid is already theirs, as transformers
    leaves them."""
    cls, patches = pos_embed[:, :1], pos_embed[:, 1:]
    old = math.isqrt(patches.shape[1])
    if old * old != patches.shape[1]:
        raise WeightsError(f"the position embedding's {patches.shape[1]} patch positions are not a square grid")
    if old == grid:
        return pos_embed
    patches = patches.reshape(1, old, old, -1).permute(0, 3, 1, 2).float()
    patches = F.interpolate(patches, size=(grid, grid), mode="bicubic", align_corners=False, antialias=antialias)
    return torch.cat([cls, patches.permute(0, 2, 3, 1).reshape(1, grid * grid, -1)], dim=1)


def _clip(config: dict, state: dict[str, torch.Tensor]) -> tuple[dict, dict[str, torch.Tensor]]:
    """CLIPVisionModel or CLIPVisionModelWithProjection: a pre-norm ViT (quick-GELU, no patch bias) whose
    post_layernorm is our final norm and whose visual_projection, where there is one, is `proj`."""
    # transformers 5 saves CLIPVisionModel without the vision_model. prefix, 4.x and WithProjection with it
    state = {k.removeprefix("vision_model."): v for k, v in state.items() if not k.endswith("position_ids")}
    depth, dim = config["num_hidden_layers"], config["hidden_size"]
    state["cls_token"] = state.pop("embeddings.class_embedding").reshape(1, 1, -1)
    state["pos_embed"] = state.pop("embeddings.position_embedding.weight")[None]
    rules = _encoder(state, depth, "encoder.layers", "self_attn.", ("q_proj", "k_proj", "v_proj"), _CLIP_BLOCK)
    rules += [(r"embeddings\.patch_embedding\.weight", "patch_embed.proj.weight"),
              (r"pre_layrnorm\.(weight|bias)", r"norm_pre.\1"), (r"post_layernorm\.(weight|bias)", r"norm.\1"),
              (r"visual_projection\.weight", "proj.weight")]
    projection = state.get("visual_projection.weight")
    arch = dict(patch_size=config["patch_size"], embed_dim=dim, depth=depth, num_heads=config["num_attention_heads"],
                mlp_ratio=config["intermediate_size"] / dim, norm_eps=config.get("layer_norm_eps", 1e-5),
                pre_norm=True, act_layer=config.get("hidden_act", "quick_gelu"),
                proj_dim=0 if projection is None else projection.shape[0])
    return arch, _renamed(state, rules)


def _siglip(config: dict, state: dict[str, torch.Tensor]) -> tuple[dict, dict[str, torch.Tensor]]:
    """SiglipVisionModel: a ViT without [CLS] (tanh GELU, a patch bias) whose post_layernorm is our final norm and
    whose head, attention pooling (nn.MultiheadAttention's packed in_proj split into q and kv), is `attn_pool`."""
    _refuse(not config.get("vision_use_head", True), "vision_use_head", False,
            "the embedding is the attention-pooling head's (pooler_output)")
    state = {k.removeprefix("vision_model."): v for k, v in state.items() if not k.endswith("position_ids")}
    depth, dim = config["num_hidden_layers"], config["hidden_size"]
    state["pos_embed"] = state.pop("embeddings.position_embedding.weight")[None]
    state["head.probe"] = state["head.probe"].reshape(1, 1, -1)
    for part in ("weight", "bias"):
        q, k, v = state.pop(f"head.attention.in_proj_{part}").chunk(3)
        state[f"attn_pool.q.{part}"], state[f"attn_pool.kv.{part}"] = q, torch.cat([k, v])
    rules = _encoder(state, depth, "encoder.layers", "self_attn.", ("q_proj", "k_proj", "v_proj"), _CLIP_BLOCK)
    rules += [(r"embeddings\.patch_embedding\.(weight|bias)", r"patch_embed.proj.\1"),
              (r"post_layernorm\.(weight|bias)", r"norm.\1"), (r"head\.probe", "attn_pool.latent"),
              (r"head\.attention\.out_proj\.(weight|bias)", r"attn_pool.proj.\1"),
              (r"head\.layernorm\.(weight|bias)", r"attn_pool.norm.\1"),
              (r"head\.mlp\.(fc1|fc2)\.(weight|bias)", r"attn_pool.mlp.\1.\2")]
    arch = dict(patch_size=config["patch_size"], embed_dim=dim, depth=depth, num_heads=config["num_attention_heads"],
                mlp_ratio=config["intermediate_size"] / dim, norm_eps=config.get("layer_norm_eps", 1e-6),
                act_layer="gelu_tanh", class_token=False, global_pool="map")
    return arch, _renamed(state, rules)


def _square(size, key: str) -> tuple[int, int]:
    """A processor size as (height, width): an integer is a square."""
    if isinstance(size, int):
        return size, size
    if isinstance(size, dict) and {"height", "width"} <= size.keys():
        return size["height"], size["width"]
    raise WeightsError(f"{key} = {size!r} in preprocessor_config.json: expected an integer or height and width")


def _policy(path: Path, image_size: int | None) -> tuple[int, dict]:
    """The served input size and the ModelSpec's input fields (mean, std, interpolation, crop_pct or resize_to) from
    the image processor. The processor must give `image_size` x `image_size` images; `image_size` None: any square,
    served as it is (a model that interpolates its position embedding to the input, DINOv2)."""
    found = _json(path)
    kind = re.sub(r"(Fast|Pil)$", "", found.get("image_processor_type", ""))
    if kind not in PROCESSOR_DEFAULTS:
        raise WeightsError(f"image_processor_type = {found.get('image_processor_type')!r} in {path.name}: "
                           f"{', '.join(PROCESSOR_DEFAULTS)} are served")
    p = {**PROCESSOR_DEFAULTS[kind], **found}
    _refuse(not p["do_resize"], "do_resize", False, "the service resizes every photo to the model's input")
    _refuse(not p["do_rescale"] or abs(p["rescale_factor"] - 1 / 255) > 1e-9, "rescale_factor",
            p["rescale_factor"] if p["do_rescale"] else None, "pixels are scaled by 1/255 in the graph")
    interpolation = RESAMPLE.get(p["resample"], str(p["resample"]))
    _refuse(interpolation not in SERVED_RESAMPLE, "resample", p["resample"],
            f"{interpolation} is not served; {', '.join(SERVED_RESAMPLE)} are")
    mean, std = (p["image_mean"], p["image_std"]) if p["do_normalize"] else ([0.0] * 3, [1.0] * 3)
    fields = dict(mean=tuple(mean), std=tuple(std), interpolation=interpolation)
    size = p["size"]
    out = _square(p["crop_size"], "crop_size") if p["do_center_crop"] else None
    if isinstance(size, dict) and "shortest_edge" in size:  # the short side, the aspect kept: crop_pct's policy
        # without the crop (or with a longest_edge) the input's shape would follow the photo's
        _refuse(out is None or len(size) > 1, "size", size, "a shortest_edge resize is served with a centre crop alone")
        _refuse(max(out) > size["shortest_edge"], "crop_size", out,
                f"the crop is larger than the shortest_edge {size['shortest_edge']}, and transformers pads it")
        fields.update(crop_pct=out[0] / size["shortest_edge"], processor_resize=True)
    else:
        resize = _square(size, "size")
        fields.update(resize_to=resize, crop_pct=1.0)
        out = out or resize
    served = image_size or out[0]
    _refuse(out != (served, served), "crop_size" if p["do_center_crop"] else "size", out,
            f"the processor gives {out[0]}x{out[1]} images and the model's image_size is {served}"
            if image_size else "the model is served square images")
    return served, fields
