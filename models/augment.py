"""Training augmentations on whole batches, written with torch ops (no torchvision).

Input and output are float images in [0, 1], [B, 3, H, W]; each sample draws its own parameters.
"""
import math

import torch
import torch.nn.functional as F


def random_resized_crop(x: torch.Tensor, scale: tuple[float, float], ratio: tuple[float, float] = (3 / 4, 4 / 3),
                        flip: float = 0.5) -> torch.Tensor:
    """Crop a random area fraction `scale` with aspect `ratio`, resize it back, and mirror with p = `flip`.

    One affine sampling grid per sample, so the whole batch is one grid_sample call.
    """
    B = x.shape[0]
    area = torch.empty(B).uniform_(*scale)
    log_ratio = torch.empty(B).uniform_(math.log(ratio[0]), math.log(ratio[1]))
    w = torch.sqrt(area * torch.exp(log_ratio)).clamp(max=1.0)  # crop size as a fraction of the image
    h = torch.sqrt(area / torch.exp(log_ratio)).clamp(max=1.0)
    cx = (torch.rand(B) * 2 - 1) * (1 - w)  # crop centre in [-1, 1] grid coordinates, crop inside the image
    cy = (torch.rand(B) * 2 - 1) * (1 - h)
    mirror = torch.where(torch.rand(B) < flip, -1.0, 1.0)
    theta = torch.zeros(B, 2, 3)
    theta[:, 0, 0], theta[:, 0, 2] = w * mirror, cx
    theta[:, 1, 1], theta[:, 1, 2] = h, cy
    grid = F.affine_grid(theta.to(x), list(x.shape), align_corners=False)
    return F.grid_sample(x, grid, mode="bilinear", padding_mode="reflection", align_corners=False)


def color_jitter(x: torch.Tensor, brightness: float, contrast: float, saturation: float) -> torch.Tensor:
    """Scale brightness, contrast (about each image's mean) and saturation (about its grey) by 1 +- amount."""
    B = x.shape[0]

    def factor(amount: float) -> torch.Tensor:
        return torch.empty(B, 1, 1, 1).uniform_(1 - amount, 1 + amount).to(x)

    x = x * factor(brightness)
    mean = x.mean(dim=(1, 2, 3), keepdim=True)
    x = (x - mean) * factor(contrast) + mean
    grey = (0.299 * x[:, 0:1] + 0.587 * x[:, 1:2] + 0.114 * x[:, 2:3])
    x = (x - grey) * factor(saturation) + grey
    return x.clamp(0, 1)


def augment(x: torch.Tensor, crop_scale: float, jitter: float) -> torch.Tensor:
    x = random_resized_crop(x, scale=(crop_scale, 1.0))
    return color_jitter(x, jitter, jitter, jitter) if jitter else x
