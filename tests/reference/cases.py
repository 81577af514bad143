"""The parity cases: our registry model (name, create_model kwargs) vs timm's (name, create_model kwargs).

`source_img_size`: the weights are made for this input size and resized on load (position embeddings).
"""
MICRO_VIT = dict(patch_size=8, embed_dim=128, depth=4, num_heads=4, img_size=96, num_classes=6)
MICRO_SWIN = dict(embed_dim=48, depths=(2, 2, 2), num_heads=(2, 4, 8), window_size=6, img_size=96, num_classes=6)

CASES = [
    *[dict(ours=f"{f}_{s}_patch16_224", timm=f"{f}_{s}_patch16_224")
      for f in ("vit", "deit") for s in ("tiny", "small", "base")],
    *[dict(ours=f"deit_{s}_distilled_patch16_224", timm=f"deit_{s}_distilled_patch16_224")
      for s in ("tiny", "small", "base")],
    *[dict(ours=f"swin_{s}_patch4_window7_224", timm=f"swin_{s}_patch4_window7_224")
      for s in ("tiny", "small", "base")],
    dict(ours="vit_base_patch16_fer_112", timm="vit_base_patch16_224", timm_kwargs=dict(img_size=112, num_classes=7)),
    dict(ours="vit_micro_patch8_96", timm="vit_tiny_patch16_224", timm_kwargs=MICRO_VIT),
    dict(ours="deit_micro_distilled_patch8_96", timm="deit_tiny_distilled_patch16_224", timm_kwargs=MICRO_VIT),
    dict(ours="swin_micro_patch4_window6_96", timm="swin_tiny_patch4_window7_224", timm_kwargs=MICRO_SWIN),
    dict(ours="vit_micro_patch16_fer_112", timm="vit_tiny_patch16_224",
         timm_kwargs=dict(embed_dim=128, depth=4, num_heads=4, img_size=112, num_classes=7)),
    # A grid that the window does not divide (64, 32, 16, 8 tokens with M = 7) is padded.
    dict(ours="swin_tiny_patch4_window7_224", kwargs=dict(img_size=256), timm="swin_tiny_patch4_window7_224",
         timm_kwargs=dict(img_size=256)),
    # 224 px weights into a 112 px model: the position embedding is resized on load.
    dict(ours="deit_tiny_distilled_patch16_224", kwargs=dict(img_size=112), source_img_size=224,
         timm="deit_tiny_distilled_patch16_224", timm_kwargs=dict(img_size=112)),
]


def case_id(case: dict) -> str:
    extra = "".join(f"-{k}{v}" for k, v in case.get("kwargs", {}).items())
    return case["ours"] + extra
