"""Deterministic weights and inputs, shared by the timm reference generator and the parity tests.

Weights depend only on each parameter's name and shape (numpy's frozen legacy RandomState, seeded by a
CRC of the name), so two implementations with the same state-dict layout get identical tensors.
"""
import math
import zlib

import numpy as np
import torch


def deterministic_state_dict(shapes: dict[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
    out = {}
    for key, shape in shapes.items():
        x = np.random.RandomState(zlib.crc32(key.encode())).standard_normal(shape).astype(np.float32)
        if key.endswith(".bias"):
            x *= 0.05
        elif key.endswith(".weight") and len(shape) == 1:  # LayerNorm scale
            x = 1.0 + 0.1 * x
        elif key.endswith(".weight"):  # Linear / Conv: keep activations O(1) through the depth
            x *= 0.5 / math.sqrt(math.prod(shape[1:]))
        else:  # tokens, position embeddings, relative position bias tables
            x *= 0.5
        out[key] = torch.from_numpy(x)
    return out


def deterministic_input(batch: int, img_size: int, seed: int = 0) -> torch.Tensor:
    x = np.random.RandomState(seed).standard_normal((batch, 3, img_size, img_size)).astype(np.float32)
    return torch.from_numpy(x)
