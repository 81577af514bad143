"""Export a model to ONNX with fused attention, verify it, and write it into a model repository.

    python -m export deit_small_patch16_224 --weights deit_small.pth --labels imagenet.txt --out model_repository
    python -m export vit_micro_patch8_96 --weights models/demo/vit_micro_patch8_96/model.safetensors --precision int8

    python -m export mtcnn --out model_repository

    python -m export vit_micro_patch8_96 --weights runs/retrained/model.safetensors --name shapes-vit --version next

    python -m export path/to/hugging-face-folder --out model_repository    # config.json, model.safetensors, ...

Writes OUT/NAME/model.onnx, OUT/NAME/explain.onnx (ViT/DeiT: every block's attention, for rollout) and
OUT/NAME/manifest.json (with --version, into OUT/NAME/N/ instead); `mtcnn` writes the face detector that
/expression uses (OUT/mtcnn/{pnet,rnet,onet}.onnx, from models/pretrained/mtcnn.safetensors). Progress goes to
stderr; a failed check exits non-zero and leaves nothing behind.
"""
import argparse
import sys
from pathlib import Path

from jsonschema import ValidationError

from models import WeightsError
from models.data import DataError
from models.hf_folder import POOLINGS

from .face_detector import export_face_detector
from .parity import ParityError
from .pipeline import ExportError, export_model
from .precision import PRECISIONS


def version_number(text: str) -> str:
    if text != "next" and not (text.isdigit() and int(text) > 0):
        raise argparse.ArgumentTypeError(f"{text!r} is neither a positive number nor next")
    return text


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m export", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", help="a registry name (python -c 'import models; print(models.list_models())'), "
                                 "mtcnn: the face detector, or a Hugging Face transformers folder (ViT, DeiT, Swin "
                                 "classifiers, or embedding models: base ViT/DeiT/Swin, DINOv2, CLIP's image tower; "
                                 "its config, weights, labels and image processor; docs/export.md)")
    p.add_argument("--weights", type=Path, help="checkpoint: .pth/.pt (timm or official layout) or .safetensors")
    p.add_argument("--random-init", action="store_true", help="export untrained weights (benchmarks, tests)")
    p.add_argument("--replace-head", action="store_true",
                   help="--weights has other classes than --labels: keep its backbone, start a new (untrained) "
                        "classifier; fine-tune it (python -m models.train --replace-head) before serving")
    p.add_argument("--num-classes", type=int, help="classes of the classifier (default: from the labels)")
    p.add_argument("--labels", type=Path, help="a file with one label per line, in class-index order")
    p.add_argument("--img-size", type=int, help="input size (default: the weights' or the model's)")
    p.add_argument("--precision", choices=PRECISIONS, default="fp32",
                   help="fp32 (any provider), fp16 (CUDA), int8 (dynamic quantization, CPU), auto (fp32, and the CPU "
                        "plans that pass the gate beside it: OpenVINO fp32 and bf16, int8 on both runtimes)")
    p.add_argument("--task", choices=["classification", "expression"], help="default: the model's")
    p.add_argument("--name", help="the model's name in the repository (default: MODEL[-PRECISION])")
    p.add_argument("--out", type=Path, default=Path("model_repository"), help="the model repository folder")
    p.add_argument("--version", type=version_number, metavar="N|next",
                   help="write OUT/NAME/N, a version of the model beside the others (next: one past the latest); "
                        "a server loads the latest (POST /v2/repository/models/NAME/load, or polling)")
    p.add_argument("--eval-data", type=Path, help="held-out ImageFolder for accuracy and the fp16/int8 gate")
    p.add_argument("--no-explain", action="store_true",
                   help="skip the explain and relevance graphs (rollout and class-specific maps)")
    p.add_argument("--pooling", choices=list(POOLINGS),
                   help="a Hugging Face folder's embedding, in place of the model's own (its pooler_output, or CLIP's "
                        "image_embeds): the final-norm [CLS] token, the mean of the patch tokens, both side by side "
                        "(DINOv2's linear probes), or the ViT/DeiT pooler; the manifest's embedding.pooling says which")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    try:
        if args.model == "mtcnn":
            export_face_detector(args.out, args.name or "mtcnn")
        else:
            export_model(args)
    except KeyError as e:
        sys.exit(f"error: {e.args[0]}")
    except (ExportError, ParityError, WeightsError, DataError, ValidationError) as e:
        sys.exit(f"error: {e}")


if __name__ == "__main__":
    main()
