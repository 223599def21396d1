"""The low-rank wrappers: LoRALinear around any linear layer, LoRAConv around a 2-D convolution (conv_dims)."""

import mlx.core as mx
import mlx.nn as nn

from ..formats.quantized import linear_rows


class LoRALinear(nn.Module):
    """base(x) + sum_i scale_i * (x @ A_i^T) @ B_i^T around any linear layer (kept as `base`, untouched).

    `adapters`: [(A (rank, in), B (out, rank), scale)]. The arrays are the model's parameters (frozen); the scales
    are plain floats."""

    def __init__(self, base, adapters=()):
        super().__init__()
        self.base = base
        self.lora_a, self.lora_b, self._scales = [], [], []
        self.lora_dora = []        # per adapter: DoRA's m / ||W + scale B A|| per output row, or None (plain LoRA)
        for adapter in adapters:
            self.add(*adapter)

    @property
    def weight(self):          # the base's (what a model reads its layer's output rows from)
        return self.base["weight"]

    def add(self, a, b, scale, dora=None):
        self.lora_a.append(a)
        self.lora_b.append(b)
        self._scales.append(float(scale))
        self.lora_dora.append(dora)
        self.freeze()

    def adapters(self):
        """[(A, B, scale)]: the low-rank terms (a DoRA's factor, when it has one, in lora_dora)."""
        return list(zip(self.lora_a, self.lora_b, self._scales))

    def dora_factor(self, a, b, scale, magnitude):
        """DoRA (PEFT's DoraLinearLayer): m / ||W + scale * B A||, the norm of each output row of the changed weight.
        W is read off the base as base(I) - bias, whatever form the base keeps it in (quantized, a file's blocks, fp8),
        one layer at a time."""
        n = a.shape[1]
        bias = self.base["bias"] if "bias" in self.base else None
        eye = mx.eye(n, dtype=mx.float32)
        w_t = self.base(eye.astype(b.dtype)).astype(mx.float32)          # (in, out) = W^T (+ bias)
        if bias is not None:
            w_t = w_t - bias.astype(mx.float32)
        changed = w_t + scale * (a.astype(mx.float32).T @ b.astype(mx.float32).T)
        factor = magnitude.astype(mx.float32) / mx.sqrt(mx.sum(changed * changed, axis=0))
        mx.eval(factor)
        return factor

    def _extra_repr(self):
        return f"{len(self._scales)} LoRA(s), ranks {[a.shape[0] for a in self.lora_a]}, scales {self._scales}"

    def rows(self, start, stop):
        """The layer restricted to output rows start:stop (formats/quantized.linear_rows): the base's rows and B's."""
        return type(self)(linear_rows(self.base, start, stop),
                          [(a, b[start:stop], s, None if d is None else d[start:stop])
                           for (a, b, s), d in zip(self.adapters(), self.lora_dora)])

    def __call__(self, x):
        y = self.base(x)
        bias = self.base["bias"] if "bias" in self.base and any(d is not None for d in self.lora_dora) else None
        for a, b, s, d in zip(self.lora_a, self.lora_b, self._scales, self.lora_dora):
            delta = ((x @ a.T) * s).astype(y.dtype) @ b.T
            if d is None:
                y = y + delta
            else:      # PEFT: (f - 1) * (what the layer gave so far, less its bias) + f * the LoRA's term
                f = d.astype(y.dtype)
                y = y + (f - 1) * (y if bias is None else y - bias.astype(y.dtype)) + f * delta
        return y


class LoRAConv(LoRALinear):
    """base(x) + sum_i scale_i * conv(x, A_i) @ B_i^T around a 2-D convolution (NHWC input, OHWI weights, as
    mlx.nn.Conv2d): A_i (rank, kh, kw, in) is the down convolution with the base's stride and padding, B_i
    (out, rank) the 1x1 up convolution as a matrix. A LoRALinear otherwise (what finds, removes or streams LoRA
    layers treats both alike)."""

    def __call__(self, x):
        y = self.base(x)
        stride, padding = self.base.stride, self.base.padding
        for a, b, s in zip(self.lora_a, self.lora_b, self._scales):    # (no DoRA on convolutions: plan refuses it)
            y = y + (mx.conv2d(x, a, stride=stride, padding=padding) * s).astype(y.dtype) @ b.T
        return y


def conv_dims(module):
    """(input channels, output channels, (kh, kw)) of a plain 2-D convolution (mlx.nn.Conv2d or a subclass, OHWI
    weight, groups 1, dilation 1), or of the one a LoRAConv wraps; None if it is not one."""
    if isinstance(module, LoRAConv):
        return conv_dims(module.base)
    if not isinstance(module, nn.Conv2d) or module.groups != 1 or module.dilation not in (1, (1, 1)):
        return None
    out, kh, kw, in_ = getattr(module, "kernel_shape", None) or module["weight"].shape   # a quantized conv's rows
    return in_, out, (kh, kw)
