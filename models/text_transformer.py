"""CLIP's text tower: "Learning Transferable Visual Models From Natural Language Supervision", Radford et al. 2021,
https://arxiv.org/abs/2103.00020.

The tokens (byte-level BPE ids, begun by a start-of-text id and ended by an end-of-text id) are embedded, a learnable
position embedding added, and the sequence goes through pre-norm blocks whose attention is causal: each token sees
itself and those before it. After the final norm, the end-of-text token's vector is the text's, projected (no bias)
into the space of the image tower's embeddings. Causal attention is why padding after the end-of-text token changes
nothing: no token before it sees the padding.

Which token ends the text, as transformers finds it: the first `eos_token_id` where the config names one, or (the
configs saved before transformers' PR #24773, whose eos_token_id is 2) the largest id, end-of-text being the last of
CLIP's vocabulary.

SigLIP's text tower ("Sigmoid Loss for Language Image Pre-Training", Zhai et al. 2023,
https://arxiv.org/abs/2303.15343) is the same transformer with three differences, each an option here: its attention
is not causal (`causal=False`: every token sees every other, padding included, so its texts are always padded to the
context length, as it was trained), the text's vector is the last position's (`pool="last"`), and its projection
(`head`) has a bias (`proj_bias`).
"""
import torch
from torch import nn

from .layers import init_weights
from .vision_transformer import Block


class TextTransformer(nn.Module):
    def __init__(self, vocab_size: int, context_length: int, embed_dim: int, depth: int, num_heads: int,
                 mlp_ratio: float = 4.0, norm_eps: float = 1e-5, act_layer: str = "quick_gelu", proj_dim: int = 0,
                 eos_token_id: int | None = None, causal: bool = True, pool: str = "eot", proj_bias: bool = False):
        super().__init__()
        if pool not in ("eot", "last"):
            raise ValueError(f"pool {pool!r}: 'eot' (the end-of-text token) or 'last' (the last position)")
        self.context_length, self.eos_token_id, self.pool = context_length, eos_token_id, pool
        self.token_embed = nn.Embedding(vocab_size, embed_dim)
        self.pos_embed = nn.Parameter(torch.zeros(1, context_length, embed_dim))
        self.blocks = nn.Sequential(*[Block(embed_dim, num_heads, mlp_ratio, norm_eps=norm_eps, act_layer=act_layer,
                                            causal=causal) for _ in range(depth)])
        self.norm = nn.LayerNorm(embed_dim, eps=norm_eps)
        self.proj = nn.Linear(embed_dim, proj_dim, bias=proj_bias) if proj_dim else nn.Identity()
        self.embed_dim = proj_dim or embed_dim
        self.apply(init_weights)

    def end_of_text(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[B, L] ids -> [B]: the position of each text's end-of-text token."""
        if self.eos_token_id is None:
            return input_ids.argmax(dim=-1)
        return (input_ids == self.eos_token_id).int().argmax(dim=-1)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[B, L] token ids (L at most context_length) -> [B, embed_dim]: the texts' embeddings, not normalised."""
        x = self.token_embed(input_ids) + self.pos_embed[:, :input_ids.shape[1]]
        x = self.norm(self.blocks(x))
        if self.pool == "last":
            return self.proj(x[:, -1])
        return self.proj(x[torch.arange(x.shape[0]), self.end_of_text(input_ids)])
