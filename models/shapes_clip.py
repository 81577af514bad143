"""The embedded CLIP: a small CLIP trained here, contrastively, on the synthetic shapes with captions made from what
the generator knows of each image ("a photo of a small dark red star in the top left."), saved as a Hugging Face
CLIPModel folder, so that it is exported and served as any whole CLIP folder is (docs/models.md#the-embedded-clip):

    python -m models.shapes_clip --out models/demo/shapes-clip
    python -m export models/demo/shapes-clip --name shapes-clip --out model_repository

The image tower starts from the shapes ViT (--image-tower): its blocks as they are, a pre-norm added as CLIP's image
tower has, and its patch bias folded into the patches' position embedding (CLIP's patch projection has none). The
text tower (models.text_transformer) and both projections start from scratch. Both towers learn by CLIP's symmetric
contrastive loss with a learned temperature (Radford et al. 2021, figure 3, https://arxiv.org/abs/2103.00020), every
caption of a batch that is true of an image counted as its match (as in supervised contrastive learning, Khosla et
al. 2020, https://arxiv.org/abs/2004.11362), so that "a photo of a star." is not taught as false of every star of the
batch but one. Each caption leaves out its size, its colour
and its position, each at random, so that CLIP's zero-shot prompt ("a photo of a star.") is a caption too.

Held out: the shapes' validation images (seed 1, data/shapes/val's): the zero-shot accuracy with the six class names
in CLIP's template, and text->image recall@1 of their whole captions among the 1,200 images (the very image, and an
image whose caption reads the same). OUT/summary.json records them with the command.
"""
import argparse
import colorsys
import hashlib
import json
import math
import shlex
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn
from tqdm import tqdm

from .data import normalise as normalise_by
from .hf_clip import (EOS, TEMPLATE, clip_tokenizer, clip_vocabulary, padded, read_text_tower, save_vocabulary,
                      token_ids)
from .hf_folder import read_folder
from .labels import SHAPE_LABELS
from .registry import get_spec
from .synthetic import Sample, sample_rng
from .synthetic.shapes import render_shape
from .text_transformer import TextTransformer
from .train import lr_factor, param_groups
from .vision_transformer import VisionTransformer
from .weights import WeightsError, read_state_dict

IMAGE_TOWER = "vit_micro_patch8_96"
SIZE = 96
EMBED = 64  # the shared space's size
TEXT = dict(context_length=32, embed_dim=128, depth=2, num_heads=4, mlp_ratio=4.0, act_layer="gelu")
# the hue (degrees) each name runs up to; a colour of little saturation is grey, or black where dark
HUES = ((15, "red"), (45, "orange"), (70, "yellow"), (165, "green"), (200, "teal"), (260, "blue"), (300, "purple"),
        (335, "pink"), (360, "red"))
SMALL, LARGE = 0.335, 0.395  # the shape's extent over the image's side: the terciles of the generator's sizes


@dataclass(frozen=True)
class Shape:
    label: int
    box: tuple[int, int, int, int]
    colour: tuple[float, float, float]


def colour_name(rgb: tuple[float, float, float]) -> str:
    hue, saturation, value = colorsys.rgb_to_hsv(*rgb)
    if saturation < 0.3:
        return "black" if value < 0.2 else "grey"
    name = next(name for end, name in HUES if hue * 360 < end)
    return f"dark {name}" if value < 0.3 else name


def position(box: tuple[int, int, int, int], size: int = SIZE) -> str:
    """Where the box's centre is, by thirds of each axis: 'in the top left', 'at the top', 'on the left', 'in the
    middle', ..."""
    x, y, w, h = box
    column = ("left", "", "right")[min(2, int(3 * (x + w / 2) / size))]
    row = ("top", "", "bottom")[min(2, int(3 * (y + h / 2) / size))]
    if row and column:
        return f"in the {row} {column}"
    return f"at the {row}" if row else f"on the {column}" if column else "in the middle"


def attributes(shape: Shape) -> tuple[str, str, str, str]:
    """What a whole caption says of the shape: its class, size, colour and position."""
    extent = max(shape.box[2:]) / SIZE
    return (SHAPE_LABELS[shape.label], "small" if extent < SMALL else "large" if extent > LARGE else "",
            colour_name(shape.colour), position(shape.box))


def stated(shape: Shape, keep: tuple[bool, bool, bool] = (True, True, True)) -> tuple[str | None, ...]:
    """What the caption that keeps the size, colour and position where `keep` says tells of the shape (attributes'
    order; None: not told, as a medium size never is)."""
    label, size_word, colour, where = attributes(shape)
    return label, (size_word or None) if keep[0] else None, colour if keep[1] else None, where if keep[2] else None


def caption(shape: Shape, keep: tuple[bool, bool, bool] = (True, True, True)) -> str:
    """The shape's caption in CLIP's template, with its size, colour and position where `keep` says."""
    label, size_word, colour, where = stated(shape, keep)
    text = " ".join(w for w in (size_word, colour, label) if w)
    return TEMPLATE.format(text + (f" {where}" if where else ""))


def describes(told: list[tuple[str | None, ...]], shapes: list[Shape]) -> torch.Tensor:
    """[images, captions]: 1 where what the caption tells (stated) is true of the image's shape."""
    truth = [attributes(shape) for shape in shapes]
    return torch.tensor([[all(t is None or t == a for t, a in zip(tells, true)) for tells in told] for true in truth],
                        dtype=torch.float32)


def _render(seed: int, index: int) -> tuple[np.ndarray, Shape]:
    sample: Sample = render_shape(sample_rng(seed, index), SIZE, label=index % len(SHAPE_LABELS))
    return np.asarray(sample.image), Shape(sample.label, sample.box, sample.colour)


def render(seed: int, count: int, workers: int = 2) -> tuple[torch.Tensor, list[Shape]]:
    """Shapes i < count of `seed` (models.synthetic's: seed 0 is data/shapes/train's, 1 its val's): uint8
    [count, 3, SIZE, SIZE] and what each holds."""
    with ProcessPoolExecutor(workers) as pool:
        done = list(pool.map(_render, [seed] * count, range(count), chunksize=64))
    pixels = torch.from_numpy(np.stack([image for image, _ in done])).permute(0, 3, 1, 2).contiguous()
    return pixels, [shape for _, shape in done]


class ShapesClip(nn.Module):
    def __init__(self, vocab_size: int, eos_token_id: int):
        super().__init__()
        self.vision = VisionTransformer(img_size=SIZE, num_classes=0, pre_norm=True, proj_dim=EMBED,
                                        **get_spec(IMAGE_TOWER).arch)
        self.text = TextTransformer(vocab_size, proj_dim=EMBED, eos_token_id=eos_token_id, **TEXT)
        self.logit_scale = nn.Parameter(torch.tensor(math.log(1 / 0.07)))  # CLIP's initial temperature

    def no_weight_decay(self) -> set[str]:
        return {f"vision.{k}" for k in self.vision.no_weight_decay()} | {"text.pos_embed"}

    def image_embeds(self, pixels: torch.Tensor) -> torch.Tensor:
        return image_embeds(self.vision, pixels)

    def loss(self, pixels: torch.Tensor, ids: torch.Tensor, matches: torch.Tensor) -> torch.Tensor:
        """CLIP's symmetric cross-entropy over the batch's image-text pairs, each image's targets spread over the
        captions that describe it and each caption's over the images it describes (`matches` [B, B], describes'):
        "a photo of a star." is as true of every star of the batch."""
        images = F.normalize(self.image_embeds(pixels), dim=-1)
        texts = F.normalize(self.text(ids), dim=-1)
        logits = self.logit_scale.clamp(max=math.log(100)).exp() * images @ texts.T
        return (F.cross_entropy(logits, matches / matches.sum(1, keepdim=True))
                + F.cross_entropy(logits.T, matches.T / matches.T.sum(1, keepdim=True))) / 2


def image_embeds(vision: VisionTransformer, pixels: torch.Tensor) -> torch.Tensor:
    """CLIP's image_embeds: the final-norm [CLS], projected."""
    return vision.forward_head(vision.forward_features(pixels), pre_logits=True)


def start_image_tower(model: VisionTransformer, path: Path) -> None:
    """The shapes ViT's weights in the pre-norm tower: patch bias into the patches' position embedding, no head."""
    state = {k: v for k, v in read_state_dict(path).items() if not k.startswith("head")}
    state["pos_embed"] = state["pos_embed"].clone()
    state["pos_embed"][:, 1:] += state.pop("patch_embed.proj.bias")
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or set(missing) != {"norm_pre.weight", "norm_pre.bias", "proj.weight"}:
        raise WeightsError(f"{path}: not the {IMAGE_TOWER} weights ({(unexpected or missing)[:3]})")


def normalise(pixels: torch.Tensor) -> torch.Tensor:
    """uint8 images -> the image tower's input (the shapes ViT's mean and std)."""
    return normalise_by(pixels.float() / 255, get_spec(IMAGE_TOWER))


@torch.no_grad()
def embed(model: ShapesClip, pixels: torch.Tensor, ids: torch.Tensor, batch: int = 200
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Unit image and text embeddings."""
    model.eval()
    images = torch.cat([model.image_embeds(normalise(pixels[i:i + batch])) for i in range(0, len(pixels), batch)])
    texts = torch.cat([model.text(ids[i:i + batch]) for i in range(0, len(ids), batch)])
    return F.normalize(images, dim=-1), F.normalize(texts, dim=-1)


def held_out(model: ShapesClip, tokenizer, pixels: torch.Tensor, shapes: list[Shape]) -> dict:
    """Zero-shot accuracy with the class names; for each whole caption, the nearest image: the very one (recall@1),
    one whose caption reads the same, and how often it has the caption's class, size, colour and position."""
    pad = tokenizer.token_to_id(EOS)
    names = [TEMPLATE.format(label) for label in SHAPE_LABELS]
    captions = [caption(shape) for shape in shapes]
    images, texts = embed(model, pixels, torch.from_numpy(padded(token_ids(tokenizer, names + captions), pad)))
    zero_shot = (images @ texts[:len(names)].T).argmax(1)
    found = (texts[len(names):] @ images.T).argmax(1).tolist()
    fits = np.array([[a == b for a, b in zip(attributes(shapes[j]), attributes(s))] for j, s in zip(found, shapes)])
    return {"images": len(shapes),
            "zero_shot_accuracy": float((zero_shot == torch.tensor([s.label for s in shapes])).float().mean()),
            "recall_at_1": float(np.mean([j == i for i, j in enumerate(found)])),
            "caption_match_at_1": float(np.mean([captions[j] == c for j, c in zip(found, captions)])),
            "found_fits": dict(zip(("shape", "size", "colour", "position"), map(float, fits.mean(0))))}


def hf_blocks(state: dict[str, torch.Tensor], depth: int, prefix: str) -> dict[str, torch.Tensor]:
    """Our blocks.i in transformers' CLIP names (CLIPEncoderLayer): q, k and v apart, as models.hf_folder joins them."""
    out = {}
    for i in range(depth):
        theirs, ours = f"{prefix}.{i}", f"blocks.{i}"
        for kind in ("weight", "bias"):
            for name, part in zip(("q_proj", "k_proj", "v_proj"), state[f"{ours}.attn.qkv.{kind}"].chunk(3)):
                out[f"{theirs}.self_attn.{name}.{kind}"] = part
            for hf, mine in (("self_attn.out_proj", "attn.proj"), ("layer_norm1", "norm1"), ("layer_norm2", "norm2"),
                             ("mlp.fc1", "mlp.fc1"), ("mlp.fc2", "mlp.fc2")):
                out[f"{theirs}.{hf}.{kind}"] = state[f"{ours}.{mine}.{kind}"]
    return out


def hf_state(model: ShapesClip) -> dict[str, torch.Tensor]:
    """The model as CLIPModel's state dict: vision_model.*, visual_projection, text_model.*, text_projection and
    logit_scale (models.hf_folder and models.hf_clip read them back)."""
    vision, text = model.vision.state_dict(), model.text.state_dict()
    v, t = "vision_model.", "text_model."
    out = {f"{v}embeddings.class_embedding": vision["cls_token"].reshape(-1),
           f"{v}embeddings.patch_embedding.weight": vision["patch_embed.proj.weight"],
           f"{v}embeddings.position_embedding.weight": vision["pos_embed"][0],
           **{f"{v}pre_layrnorm.{k}": vision[f"norm_pre.{k}"] for k in ("weight", "bias")},
           **{f"{v}post_layernorm.{k}": vision[f"norm.{k}"] for k in ("weight", "bias")},
           "visual_projection.weight": vision["proj.weight"],
           f"{t}embeddings.token_embedding.weight": text["token_embed.weight"],
           f"{t}embeddings.position_embedding.weight": text["pos_embed"][0],
           **{f"{t}final_layer_norm.{k}": text[f"norm.{k}"] for k in ("weight", "bias")},
           "text_projection.weight": text["proj.weight"],
           "logit_scale": model.logit_scale.detach().clone(),
           **hf_blocks(vision, len(model.vision.blocks), f"{v}encoder.layers"),
           **hf_blocks(text, len(model.text.blocks), f"{t}encoder.layers")}
    return {k: t.detach().contiguous() for k, t in out.items()}


def hf_config(vocab_size: int, eos: int, bos: int) -> dict:
    """CLIPConfig's fields for these towers (transformers' defaults elsewhere)."""
    arch = get_spec(IMAGE_TOWER).arch
    vision = {"model_type": "clip_vision_model", "hidden_size": arch["embed_dim"], "num_channels": 3,
              "intermediate_size": 4 * arch["embed_dim"], "num_hidden_layers": arch["depth"],
              "num_attention_heads": arch["num_heads"], "image_size": SIZE, "patch_size": arch["patch_size"],
              "hidden_act": "gelu", "layer_norm_eps": 1e-6, "projection_dim": EMBED}
    text = {"model_type": "clip_text_model", "vocab_size": vocab_size, "hidden_size": TEXT["embed_dim"],
            "intermediate_size": int(TEXT["mlp_ratio"] * TEXT["embed_dim"]), "num_hidden_layers": TEXT["depth"],
            "num_attention_heads": TEXT["num_heads"], "max_position_embeddings": TEXT["context_length"],
            "hidden_act": "gelu", "layer_norm_eps": 1e-5, "bos_token_id": bos, "eos_token_id": eos,
            "pad_token_id": eos, "projection_dim": EMBED}
    return {"architectures": ["CLIPModel"], "model_type": "clip", "projection_dim": EMBED,
            "logit_scale_init_value": math.log(1 / 0.07), "text_config": text, "vision_config": vision}


def save_folder(model: ShapesClip, vocab: dict[str, int], merges: list[tuple[str, str]], out: Path) -> None:
    """A CLIPModel folder as transformers saves one: weights, config, image processor and tokenizer."""
    save_vocabulary(out, vocab, merges)
    clip_tokenizer(vocab, merges).save(str(out / "tokenizer.json"))
    special = {"bos_token": "<|startoftext|>", "eos_token": EOS, "unk_token": EOS, "pad_token": EOS}
    (out / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")
    (out / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "CLIPTokenizer", "model_max_length": TEXT["context_length"], **special}, indent=2) + "\n")
    spec = get_spec(IMAGE_TOWER)
    processor = {"image_processor_type": "CLIPImageProcessor", "do_resize": True, "size": {"shortest_edge": SIZE},
                 "resample": 3, "do_center_crop": True, "crop_size": {"height": SIZE, "width": SIZE},
                 "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True, "image_mean": list(spec.mean),
                 "image_std": list(spec.std), "do_convert_rgb": True}
    (out / "preprocessor_config.json").write_text(json.dumps(processor, indent=2) + "\n")
    (out / "config.json").write_text(json.dumps(hf_config(len(vocab), vocab[EOS], vocab["<|startoftext|>"]),
                                                indent=2) + "\n")
    save_file(hf_state(model), out / "model.safetensors", metadata={"format": "pt"})


def check_folder(model: ShapesClip, out: Path, pixels: torch.Tensor, ids: torch.Tensor) -> None:
    """The saved folder, read as the export reads it, answers as the trained model: else WeightsError."""
    model.eval()
    with torch.no_grad():
        pairs = [(image_embeds(read_folder(out).build(), normalise(pixels)), model.image_embeds(normalise(pixels))),
                 (read_text_tower(out).build()(ids), model.text(ids))]
    for got, want in pairs:
        if got.shape != want.shape or (got - want).abs().max() > 1e-5:
            raise WeightsError(f"{out}: the saved folder does not answer as the trained model")


def train(args: argparse.Namespace) -> dict:
    torch.manual_seed(args.seed)
    started = time.time()
    pixels, shapes = render(0, args.images)
    val_pixels, val_shapes = render(1, args.val)
    vocab, merges = clip_vocabulary([caption(s) for s in shapes] + list(SHAPE_LABELS), 1000)
    tokenizer = clip_tokenizer(vocab, merges)
    tokenizer.enable_truncation(TEXT["context_length"])
    pad = vocab[EOS]
    model = ShapesClip(len(vocab), pad)
    start_image_tower(model.vision, args.image_tower)
    optimizer = torch.optim.AdamW(param_groups(model, 0.05), lr=args.lr)
    steps_per_epoch = math.ceil(len(shapes) / args.batch_size)
    total = args.epochs * steps_per_epoch
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, total // 20, total, 0.01))
    rng = np.random.default_rng(args.seed)
    history = []
    for epoch in range(args.epochs):
        model.train()
        losses = []
        order = torch.randperm(len(shapes))
        bar = tqdm(order.split(args.batch_size), desc=f"epoch {epoch + 1}/{args.epochs}", file=sys.stderr, leave=False)
        for rows in bar:
            batch = [shapes[i] for i in rows.tolist()]
            keeps = [tuple(rng.random(3) < args.keep) for _ in batch]
            captions = [caption(shape, keep) for shape, keep in zip(batch, keeps)]
            matches = describes([stated(shape, keep) for shape, keep in zip(batch, keeps)], batch)
            ids = torch.from_numpy(padded(token_ids(tokenizer, captions), pad))
            loss = model.loss(normalise(pixels[rows]), ids, matches)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            losses.append(loss.item())
            bar.set_postfix(loss=f"{loss.item():.3f}")
        scores = held_out(model, tokenizer, val_pixels, val_shapes)
        history.append({"epoch": epoch + 1, "loss": float(np.mean(losses)), **scores})
        print(f"epoch {epoch + 1}/{args.epochs}: {history[-1]}", file=sys.stderr)
    args.out.mkdir(parents=True, exist_ok=True)
    save_folder(model, vocab, merges, args.out)
    probe = [caption(s) for s in val_shapes[:8]]
    check_folder(model, args.out, val_pixels[:8], torch.from_numpy(padded(token_ids(tokenizer, probe), pad)))
    summary = {"model": "shapes-clip", "command": args.command, "labels": list(SHAPE_LABELS),
               "train_images": len(shapes), "held_out": history[-1], "history": history,
               "seconds": round(time.time() - started, 1),
               "image_tower": {"path": str(args.image_tower),
                               "sha256": hashlib.sha256(args.image_tower.read_bytes()).hexdigest()}}
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m models.shapes_clip", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="the CLIPModel folder to write")
    p.add_argument("--image-tower", type=Path, default=Path(f"models/demo/{IMAGE_TOWER}/model.safetensors"),
                   help=f"the {IMAGE_TOWER} weights the image tower starts from")
    p.add_argument("--images", type=int, default=16000, help="training shapes (data/shapes/train's first)")
    p.add_argument("--val", type=int, default=1200, help="held-out shapes (data/shapes/val's)")
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--keep", type=float, default=0.5,
                   help="the chance that a caption tells each of the shape's size, colour and position")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    args.command = "python -m models.shapes_clip " + shlex.join(sys.argv[1:] if argv is None else argv)
    print(json.dumps(train(args)["held_out"]), file=sys.stderr)


if __name__ == "__main__":
    main()
