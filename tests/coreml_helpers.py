"""Core ML test pieces shared by several test modules (no test module imports another)."""

import torch


class Wrapper(torch.nn.Module):
    """What one traces: the UNet as `self.unet` (its names then start with `unet_`), returning the sample."""

    def __init__(self, unet):
        super().__init__()
        self.unet = unet

    def forward(self, x, t, c):
        return self.unet(x, t, c, return_dict=False)[0]
