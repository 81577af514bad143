"""A whole CLIP or SigLIP folder's text tower and tokenizer (CLIPModel, SiglipModel): what zero-shot labels and text
search are made of. The image tower of the same folder is read by models.hf_folder.

    folder/config.json         text_config (the tower), projection_dim, logit_scale_init_value
    folder/model.safetensors   text_model.*, text_projection.weight (SigLIP: text_model.head.*), logit_scale (and
                               SigLIP's logit_bias), beside vision_model.*
    folder/tokenizer.json      the tokenizer, as the `tokenizers` library reads it; or, for CLIP, vocab.json +
                               merges.txt, which `clip_tokenizer` turns into one as transformers' CLIPTokenizer builds
                               it; for SigLIP, spiece.model, which `siglip_tokenizer` turns into one as transformers'
                               SiglipTokenizer tokenizes

`read_text_tower` gives the architecture of models.text_transformer and a state dict in its names, and what scores
a label: softmax(logit_scale * cos) over the labels (CLIP), or each label's sigmoid(logit_scale * cos + logit_bias)
(SigLIP). Every setting this cannot serve exactly is refused with one sentence naming it, as models.hf_folder refuses.
"""
import json
import math
import re
import string
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers, processors, trainers
from tokenizers.models import BPE, Unigram

from .hf_folder import _CLIP_BLOCK, _encoder, _json, _refuse, _renamed, weight_files
from .text_transformer import TextTransformer
from .weights import WeightsError, read_state_dict

TEMPLATE = "a photo of a {}."  # CLIP's prompt for ImageNet's labels (Radford et al. 2021, section 3.1.4)
SIGLIP_TEMPLATE = "This is a photo of {}."  # transformers' SigLIP zero-shot example's prompt
BOS, EOS = "<|startoftext|>", "<|endoftext|>"
# transformers' CLIPTokenizer (5.23): its pre-tokenizer's split
_WORDS = r"""<\|startoftext\|>|<\|endoftext\|>|'s|'t|'re|'ve|'m|'ll|'d|[\p{L}]+|[\p{N}]|[^\s\p{L}\p{N}]+"""


@dataclass(frozen=True)
class TextTower:
    arch: dict  # TextTransformer's arguments
    state_dict: dict[str, torch.Tensor]  # its names, float32
    logit_scale: float  # exp of the folder's logit_scale: what multiplies a cosine into a logit
    tokenizer: Tokenizer  # truncating to the context length, as transformers truncates with max_length
    pad_id: int  # what fills each text's ids to the context length
    scores: str = "softmax"  # a label's score: the softmax over the labels (CLIP), or its own sigmoid (SigLIP)
    logit_bias: float = 0.0  # SigLIP's, added to every logit
    template: str = TEMPLATE

    def build(self) -> TextTransformer:
        model = TextTransformer(**self.arch)
        missing, unexpected = model.load_state_dict(self.state_dict, strict=False)
        if missing or unexpected:
            problem = f"missing {missing[0]}" if missing else f"unexpected {unexpected[0]}"
            raise WeightsError(f"the text tower's weights do not fit its config: {problem}")
        return model.eval()


def read_text_tower(folder: str | Path) -> TextTower:
    """A CLIPModel or SiglipModel folder's text tower, projection, logit scale (and bias) and tokenizer; WeightsError
    naming what cannot be served as it is."""
    folder = Path(folder)
    config = _json(folder / "config.json")
    kind = config.get("model_type")
    if kind == "siglip2":
        raise WeightsError(f"{folder}: model_type 'siglip2' (NaFlex: patches of any aspect ratio, with their own "
                           "mask) is not served; SigLIP 2's fixed-resolution folders (model_type siglip) are")
    if kind not in ("clip", "siglip"):
        raise WeightsError(f"{folder}: model_type {kind!r} has no text tower here; CLIP's and SigLIP's do")
    siglip = kind == "siglip"
    text = config.get("text_config") or {}
    activations = {"gelu_pytorch_tanh": "gelu_tanh"} if siglip else {"quick_gelu": "quick_gelu", "gelu": "gelu"}
    act = text.get("hidden_act", next(iter(activations)))
    _refuse(act not in activations, "text_config.hidden_act", act, f"only {' and '.join(activations)} served")
    projection = "head.weight" if siglip else "text_projection.weight"
    state = {k.removeprefix("text_model."): v.float() for path in weight_files(folder)
             for k, v in read_state_dict(path).items()
             if k.startswith(("text_model.", "text_projection.", "logit_")) and not k.endswith("position_ids")}
    if projection not in state or "logit_scale" not in state or (siglip and "logit_bias" not in state):
        raise WeightsError(f"{folder}: no {projection}, logit_scale{' or logit_bias' if siglip else ''}: not a whole "
                           f"{'SiglipModel' if siglip else 'CLIPModel'}")
    logit_scale = math.exp(float(state.pop("logit_scale")))
    logit_bias = float(state.pop("logit_bias")) if siglip else 0.0
    depth, dim = text["num_hidden_layers"], text["hidden_size"]
    state["token_embed.weight"] = state.pop("embeddings.token_embedding.weight")
    state["pos_embed"] = state.pop("embeddings.position_embedding.weight")[None]
    rules = _encoder(state, depth, "encoder.layers", "self_attn.", ("q_proj", "k_proj", "v_proj"), _CLIP_BLOCK)
    rules += [(r"final_layer_norm\.(weight|bias)", r"norm.\1"), (r"text_projection\.weight", "proj.weight"),
              (r"head\.(weight|bias)", r"proj.\1")]
    eos = text.get("eos_token_id", 2)
    context, eps = (64, 1e-6) if siglip else (77, 1e-5)  # the configs' defaults
    arch = dict(vocab_size=text["vocab_size"], context_length=text.get("max_position_embeddings", context),
                embed_dim=dim, depth=depth, num_heads=text["num_attention_heads"],
                mlp_ratio=text["intermediate_size"] / dim, norm_eps=text.get("layer_norm_eps", eps),
                act_layer=activations[act], proj_dim=state[projection].shape[0])
    if siglip:  # every token sees every other, the last position's vector the text's
        arch.update(causal=False, pool="last", proj_bias=True)
    else:
        arch.update(eos_token_id=None if eos == 2 else eos)  # 2: before transformers' PR #24773, the largest id ends
    tokenizer = folder_tokenizer(folder)
    tokenizer.no_padding()  # a saved tokenizer.json can carry the padding of the last call that saved it
    tokenizer.enable_truncation(arch["context_length"])
    if siglip:
        return TextTower(arch, _renamed(state, rules), logit_scale, tokenizer, text.get("pad_token_id", 1),
                         "sigmoid", logit_bias, SIGLIP_TEMPLATE)
    return TextTower(arch, _renamed(state, rules), logit_scale, tokenizer, tokenizer.token_to_id(EOS))


def folder_tokenizer(folder: Path) -> Tokenizer:
    """The folder's tokenizer.json, or one made from its spiece.model (siglip_tokenizer) or its vocab.json and
    merges.txt (clip_tokenizer)."""
    if (folder / "tokenizer.json").is_file():
        try:
            return Tokenizer.from_file(str(folder / "tokenizer.json"))
        except Exception as e:  # the library's own error types are not exported
            raise WeightsError(f"{folder}/tokenizer.json: not a tokenizer the tokenizers library reads ({e})") from None
    if (folder / "spiece.model").is_file():
        return siglip_tokenizer(folder)
    if not (folder / "vocab.json").is_file() or not (folder / "merges.txt").is_file():
        raise WeightsError(f"{folder}: no tokenizer.json, and no vocab.json and merges.txt (CLIP's) or spiece.model "
                           "(SigLIP's) to make one from")
    special = _json_if(folder / "special_tokens_map.json")
    for role, default in (("bos_token", BOS), ("eos_token", EOS), ("unk_token", EOS)):
        token = _token(special.get(role), default)
        _refuse(token != default, f"special_tokens_map.json's {role}", token,
                f"CLIP's tokenizer is made with {default}")
    merges = [line for line in (folder / "merges.txt").read_text(encoding="utf-8").splitlines()
              if line and not line.startswith("#version")]
    return clip_tokenizer(_json(folder / "vocab.json"), [tuple(m.split(" ")) for m in merges])


def clip_tokenizer(vocab: dict[str, int], merges: list[tuple[str, str]]) -> Tokenizer:
    """transformers' CLIPTokenizer (5.23) in the tokenizers library: NFC, runs of whitespace to one space, lower case;
    split into words, byte-level; BPE with </w> ending each word; <|startoftext|> ... <|endoftext|> around."""
    for token in (BOS, EOS):
        if token not in vocab:
            raise WeightsError(f"vocab.json has no {token}")
    tokenizer = Tokenizer(BPE(vocab=vocab, merges=merges, continuing_subword_prefix="", end_of_word_suffix="</w>",
                              fuse_unk=False, unk_token=EOS))
    _clip_words(tokenizer)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([BOS, EOS])
    tokenizer.post_processor = processors.RobertaProcessing((EOS, vocab[EOS]), (BOS, vocab[BOS]),
                                                            trim_offsets=False, add_prefix_space=False)
    return tokenizer


def siglip_tokenizer(folder: Path) -> Tokenizer:
    """transformers' SiglipTokenizer (5.23) from the folder's spiece.model, in the tokenizers library. SiglipTokenizer
    makes a text "▁" + the text (its "▁" read as spaces), lower case, without its ASCII punctuation, whitespace
    runs as one space, stripped (canonicalize_text), and gives that to SentencePiece without a prefix of its own: so
    here a text begun by spaces or punctuation begins "▁", one begun by a word gets "▁" before it (Metaspace's
    first), and a text's part after a special token gets none. Then SentencePiece's own normalisation (the model's
    precompiled charsmap), its Unigram pieces, and </s> after; eos, unk and pad are split out wherever they are, the
    spaces around them dropped."""
    from sentencepiece import sentencepiece_model_pb2  # the export's alone: the service reads the tokenizer.json

    config = {**_json_if(folder / "special_tokens_map.json"), **_json_if(folder / "tokenizer_config.json")}
    _refuse(config.get("tokenizer_class", "SiglipTokenizer") != "SiglipTokenizer", "tokenizer_config.json's "
            "tokenizer_class", config.get("tokenizer_class"), "only SiglipTokenizer's spiece.model is converted")
    extra = config.get("additional_special_tokens") or config.get("extra_special_tokens")
    _refuse(bool(extra), "additional_special_tokens", extra, "SiglipTokenizer's own special tokens alone are converted")
    proto = sentencepiece_model_pb2.ModelProto()
    try:
        proto.ParseFromString((folder / "spiece.model").read_bytes())
    except Exception as e:  # protobuf's DecodeError
        raise WeightsError(f"{folder}/spiece.model: not a SentencePiece model ({e})") from None
    _refuse(proto.trainer_spec.model_type != proto.trainer_spec.UNIGRAM, "spiece.model's model_type",
            proto.trainer_spec.model_type, "only a Unigram model (SigLIP's) is converted")
    eos, unk, pad = (_token(config.get(role), default) for role, default in
                     (("eos_token", "</s>"), ("unk_token", "<unk>"), ("pad_token", "</s>")))
    tokenizer = Tokenizer(Unigram([(p.piece, p.score) for p in proto.pieces], unk_id=proto.trainer_spec.unk_id,
                                  byte_fallback=proto.trainer_spec.byte_fallback))
    punctuation = re.escape(string.punctuation)
    steps = [normalizers.Replace("▁", " ")]
    steps += [normalizers.Lowercase()] if config.get("do_lower_case", True) else []
    steps += [normalizers.Replace(Regex(rf"^[\s{punctuation}]+(?=[^\s{punctuation}])"), "▁"),
              normalizers.Replace(Regex(f"[{punctuation}]"), ""), normalizers.Replace(Regex(r"\s+"), " "),
              normalizers.Strip(left=False, right=True)]
    if proto.normalizer_spec.precompiled_charsmap:  # (it can make spaces again: its runs are one, as SentencePiece's)
        steps += [normalizers.Precompiled(proto.normalizer_spec.precompiled_charsmap),
                  normalizers.Replace(Regex(" {2,}"), " ")]
    tokenizer.normalizer = normalizers.Sequence(steps)
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=True)
    tokenizer.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first", split=True)
    tokenizer.add_special_tokens([AddedToken(token, lstrip=True, rstrip=True, normalized=False, special=True)
                                  for token in dict.fromkeys((eos, unk, pad))])
    if tokenizer.token_to_id(eos) is None:
        raise WeightsError(f"{folder}/spiece.model has no {eos}")
    tokenizer.post_processor = processors.TemplateProcessing(single=f"$A {eos}",
                                                             special_tokens=[(eos, tokenizer.token_to_id(eos))])
    return tokenizer


def _json_if(path: Path) -> dict:
    return _json(path) if path.is_file() else {}


def _token(value, default: str) -> str:
    """A special token as tokenizer_config.json gives it: a string, or an AddedToken's dict."""
    value = default if value is None else value
    return value.get("content", default) if isinstance(value, dict) else value


def _clip_words(tokenizer: Tokenizer) -> None:
    """CLIP's normaliser and pre-tokenizer on `tokenizer`: NFC, runs of whitespace to one space, lower case; words,
    byte-level."""
    tokenizer.normalizer = normalizers.Sequence([normalizers.NFC(), normalizers.Replace(Regex(r"\s+"), " "),
                                                 normalizers.Lowercase()])
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_WORDS), behavior="removed", invert=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False)])


def clip_vocabulary(texts: Iterable[str], size: int) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """A byte-level BPE of at most `size` tokens learnt from `texts` with CLIP's normaliser and pre-tokenizer, laid out
    as CLIP's vocab.json is: the merges' tokens, every byte alone and ending a word, the start and end of text last."""
    tokenizer = Tokenizer(BPE(continuing_subword_prefix="", end_of_word_suffix="</w>"))
    _clip_words(tokenizer)
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tokenizer.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=size, initial_alphabet=alphabet,
                                                             end_of_word_suffix="</w>", show_progress=False))
    vocab = tokenizer.get_vocab()
    for byte in sorted(alphabet):
        vocab.setdefault(byte + "</w>", len(vocab))
    vocab[BOS], vocab[EOS] = len(vocab), len(vocab) + 1
    return vocab, [tuple(pair) for pair in json.loads(tokenizer.to_str())["model"]["merges"]]


def save_vocabulary(folder: Path, vocab: dict[str, int], merges: list[tuple[str, str]]) -> None:
    """vocab.json and merges.txt, as CLIP's folders hold them (what transformers' CLIPTokenizer reads)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    (folder / "merges.txt").write_text("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges), encoding="utf-8")


def token_ids(tokenizer: Tokenizer, texts: list[str]) -> list[list[int]]:
    """Each text's ids, begun and ended by the model's tokens and truncated to the tokenizer's context length."""
    return [encoding.ids for encoding in tokenizer.encode_batch(texts)]


def padded(ids: list[list[int]], pad: int, length: int | None = None) -> np.ndarray:
    """int64 [texts, length] (length: the longest text's by default), each text's ids and then `pad`."""
    batch = np.full((len(ids), length or max(map(len, ids))), pad, np.int64)
    for row, text in zip(batch, ids):
        row[:len(text)] = text
    return batch

