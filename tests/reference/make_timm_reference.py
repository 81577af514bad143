"""Regenerate timm_reference.safetensors and timm_keys.json from timm itself.

Run in an environment with timm (it needs torchvision, which cannot sit beside this project's torch):
    python -m venv /tmp/ref && /tmp/ref/bin/pip install torch==2.14.1 torchvision==0.29.1 timm safetensors numpy
    /tmp/ref/bin/python tests/reference/make_timm_reference.py
Recorded with timm 1.0.31, torch 2.14.1.
"""
import json
import sys
from pathlib import Path

import timm
import torch
from safetensors.torch import save_file

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
from cases import CASES, case_id  # noqa: E402
from fill import deterministic_input, deterministic_state_dict  # noqa: E402


def shapes(model: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def main() -> None:
    logits, keys = {}, {}
    for case in CASES:
        kwargs = case.get("timm_kwargs", {})
        model = timm.create_model(case["timm"], **kwargs).eval()
        source = case.get("source_img_size")
        if source:  # weights shaped for another input size, through timm's own checkpoint filter
            src_model = timm.create_model(case["timm"], **{**kwargs, "img_size": source})
            weights = deterministic_state_dict(shapes(src_model))
            weights = timm.models.vision_transformer.checkpoint_filter_fn(weights, model)
        else:
            weights = deterministic_state_dict(shapes(model))
        model.load_state_dict(weights, strict=True)
        img_size = model.pretrained_cfg["input_size"][-1] if "img_size" not in kwargs else kwargs["img_size"]
        with torch.no_grad():
            out = model(deterministic_input(2, img_size))
        cid = case_id(case)
        logits[cid] = out.contiguous()
        keys[cid] = [[k, list(s)] for k, s in shapes(model).items()]
        print(f"{cid}: logits {tuple(out.shape)} |max| {out.abs().max():.2f}", file=sys.stderr)
    save_file(logits, HERE / "timm_reference.safetensors",
              metadata={"timm": timm.__version__, "torch": torch.__version__})
    (HERE / "timm_keys.json").write_text(json.dumps(keys, indent=0) + "\n")


if __name__ == "__main__":
    main()
