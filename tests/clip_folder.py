"""A tiny random CLIPModel folder, saved by transformers with a small real tokenizer: a byte-level BPE trained here on
ImageNet's class names with CLIP's normaliser and pre-tokenizer (1,200 merges and tokens; CLIP's own has 49,408), so
that unicode, case, punctuation and long words exercise every step of the tokenizer. For tests/test_hf_clip.py and
the services that serve it."""
from pathlib import Path

import torch
import transformers

from models.hf_clip import clip_vocabulary, save_vocabulary

LABELS = Path(__file__).resolve().parent.parent / "models" / "imagenet_1k_labels.txt"
CONTEXT = 24  # the text tower's context length (CLIP's is 77)


def save_clip_folder(folder: Path, legacy_eos: bool = False, seed: int = 0) -> None:
    """A CLIPModel with random weights (large enough that texts differ by far more than the tolerance), its
    tokenizer (tokenizer.json beside vocab.json and merges.txt) and image processor. `legacy_eos`: a config from
    before transformers' PR #24773 (eos_token_id 2), which pools at the largest id."""
    save_vocabulary(folder, *clip_vocabulary(LABELS.read_text().splitlines(), 1200))
    tokenizer = transformers.CLIPTokenizer.from_pretrained(folder)
    tokenizer.save_pretrained(folder)
    ids = {} if legacy_eos else dict(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                                     pad_token_id=tokenizer.pad_token_id)
    config = transformers.CLIPConfig(
        text_config=dict(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, max_position_embeddings=CONTEXT, **ids,
                         **({"eos_token_id": 2} if legacy_eos else {})),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                           image_size=32, patch_size=8),
        projection_dim=16)
    model = transformers.CLIPModel(config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for key, p in model.named_parameters():
            if key != "logit_scale":
                p.copy_(torch.randn(p.shape, generator=generator) * (0.05 if "embedding" in key or "bias" in key
                                                                     else 0.3))
    model.save_pretrained(folder)
    transformers.CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}
                                    ).save_pretrained(folder)
