"""Training-side models: ViT, DeiT and Swin with timm-compatible parameter names, and the FER2013 mini-Xception CNN."""
from .flops import flops
from .registry import ModelSpec, create_model, get_spec, list_models
from .weights import WeightsError, load_weights, read_state_dict

__all__ = ["ModelSpec", "WeightsError", "create_model", "flops", "get_spec", "list_models", "load_weights",
           "read_state_dict"]
