"""A tiny random SiglipModel folder, saved by transformers with a small real tokenizer trained here on ImageNet's class
names: a Unigram tokenizer.json (NFKC, Metaspace words, `</s>` ending each text, as SigLIP 2's folders ship one), or
SigLIP's own kind, a SentencePiece spiece.model read by transformers' SiglipTokenizer (SigLIP's has 32,000 pieces).
For tests/test_siglip.py."""
from pathlib import Path

import sentencepiece
import torch
import transformers
from clip_folder import LABELS
from tokenizers import Tokenizer, normalizers, pre_tokenizers, processors, trainers
from tokenizers.models import Unigram

CONTEXT = 16  # the text tower's context length (SigLIP's is 64): every text is padded to it
SPECIAL = ["<pad>", "</s>", "<unk>"]


def siglip_tokenizer(texts: list[str], size: int = 600) -> Tokenizer:
    tokenizer = Tokenizer(Unigram())
    tokenizer.normalizer = normalizers.NFKC()
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.train_from_iterator(texts, trainers.UnigramTrainer(vocab_size=size, special_tokens=SPECIAL,
                                                                 unk_token="<unk>", show_progress=False))
    tokenizer.post_processor = processors.TemplateProcessing(single="$A </s>",
                                                             special_tokens=[("</s>", tokenizer.token_to_id("</s>"))])
    return tokenizer


def save_siglip_folder(folder: Path, spiece: bool = False, seed: int = 0) -> None:
    """A SiglipModel with random weights (large enough that texts differ by far more than the tolerance), its
    tokenizer (tokenizer.json: pad `<pad>`, end `</s>`; or `spiece`: spiece.model, pad and end `</s>`, as SigLIP's)
    and image processor (32 x 32, mean and std 0.5)."""
    folder.mkdir(parents=True, exist_ok=True)
    if spiece:
        sentencepiece.SentencePieceTrainer.train(
            sentence_iterator=iter(LABELS.read_text().splitlines()), model_prefix=str(folder / "trained"),
            vocab_size=600, model_type="unigram", pad_id=0, eos_id=1, unk_id=2, bos_id=-1, minloglevel=2)
        tokenizer = transformers.SiglipTokenizer(str(folder / "trained.model"), model_max_length=CONTEXT)
        (folder / "trained.model").unlink()
        (folder / "trained.vocab").unlink()
    else:
        tokenizer = transformers.PreTrainedTokenizerFast(
            tokenizer_object=siglip_tokenizer(LABELS.read_text().splitlines()), pad_token="<pad>", eos_token="</s>",
            unk_token="<unk>", model_max_length=CONTEXT)
    tokenizer.save_pretrained(folder)
    config = transformers.SiglipConfig(
        text_config=dict(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, max_position_embeddings=CONTEXT, pad_token_id=tokenizer.pad_token_id,
                         eos_token_id=tokenizer.eos_token_id, bos_token_id=None),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                           image_size=32, patch_size=8))
    model = transformers.SiglipModel(config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for key, p in model.named_parameters():
            scale = 0.05 if "embedding" in key or "bias" in key or "probe" in key else 0.3
            p.copy_(torch.randn(p.shape, generator=generator) * scale)
        model.logit_scale.fill_(2.0)  # as SigLIP starts: log 10, and a bias of -10 (here -1, so scores spread)
        model.logit_bias.fill_(-1.0)
    model.save_pretrained(folder)
    transformers.SiglipImageProcessor(size={"height": 32, "width": 32}).save_pretrained(folder)
