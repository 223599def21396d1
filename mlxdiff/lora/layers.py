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
        # per adapter: its DoRA factor or None (plain LoRA), and the factor's side ("out": m / ||W + scale B A|| per
        # output row, PEFT's and LyCORIS's wd_on_out; "in": per input column (a convolution's input channel),
        # LyCORIS's wd_on_out=False)
        self.lora_dora, self._dora_on = [], []
        for adapter in adapters:
            self.add(*adapter)

    @property
    def weight(self):          # the base's (what a model reads its layer's output rows from)
        return self.base["weight"]

    def add(self, a, b, scale, dora=None, dora_on="out"):
        self.lora_a.append(a)
        self.lora_b.append(b)
        self._scales.append(float(scale))
        self.lora_dora.append(dora)
        self._dora_on.append(dora_on)
        self.freeze()

    def adapters(self):
        """[(A, B, scale)]: the low-rank terms (a DoRA's factor, when it has one, in lora_dora)."""
        return list(zip(self.lora_a, self.lora_b, self._scales))

    def base_rows(self, n, dtype):
        """The base's weight W (n inputs) as float32 rows (out, n), read off the base as base(I) - bias (I in `dtype`),
        whatever form the base keeps it in (quantized, a file's blocks, fp8), one layer at a time."""
        bias = self.base["bias"] if "bias" in self.base else None
        w_t = self.base(mx.eye(n, dtype=mx.float32).astype(dtype)).astype(mx.float32)   # (in, out) = W^T (+ bias)
        return (w_t if bias is None else w_t - bias.astype(mx.float32)).T

    def _changed_rows(self, a, b, scale):
        """W + scale * B A as float32 rows (out, in [x kh x kw])."""
        a = a.astype(mx.float32).reshape(a.shape[0], -1)
        return self.base_rows(a.shape[1], b.dtype) + scale * (b.astype(mx.float32) @ a)

    def dora_squares(self, a, b, scale, on="out"):
        """The squared norms of the changed weight W + scale * B A: per output row ("out"), or per input column
        ("in": its sum over all rows, which a fused layer's parts add up)."""
        changed = self._changed_rows(a, b, scale)
        return mx.sum(changed * changed, axis=1 if on == "out" else 0)

    def dora_factor(self, a, b, scale, magnitude, on="out", squares=None):
        """DoRA: m / ||W + scale * B A|| per output row (PEFT's DoraLinearLayer, LyCORIS's wd_on_out) or per input
        column (LyCORIS's wd_on_out=False; `squares`: the column norms' squares over the whole original layer, when
        this layer is a part of it), evaluated."""
        if squares is None:
            squares = self.dora_squares(a, b, scale, on)
        factor = magnitude.astype(mx.float32) / mx.sqrt(squares)
        mx.eval(factor)
        return factor

    def _extra_repr(self):
        return f"{len(self._scales)} LoRA(s), ranks {[a.shape[0] for a in self.lora_a]}, scales {self._scales}"

    def rows(self, start, stop):
        """The layer restricted to output rows start:stop (formats/quantized.linear_rows): the base's rows and B's
        (a per-column DoRA factor stays whole: it scales the input)."""
        return type(self)(linear_rows(self.base, start, stop),
                          [(a, b[start:stop], s, None if d is None else d if on == "in" else d[start:stop], on)
                           for (a, b, s), d, on in zip(self.adapters(), self.lora_dora, self._dora_on)])

    def _term(self, x, a, b, s, dtype):
        """scale * (x A^T) B^T: one adapter's low-rank term."""
        return ((x @ a.T) * s).astype(dtype) @ b.T

    def __call__(self, x):
        return self._through(x, len(self.lora_a))

    def _through(self, x, n):
        """The base and the first n adapters on x. A per-row DoRA (PEFT): (f - 1) * (what the layer gave so far,
        less its bias) + f * the LoRA's term added; a per-column one (LyCORIS's wd_on_out=False: W' = (W + s B A)
        diag(g)): the layer so far and the term both on x * g."""
        if n == 0:
            return self.base(x)
        a, b, s, d, on = self.lora_a[n - 1], self.lora_b[n - 1], self._scales[n - 1], self.lora_dora[n - 1], \
            self._dora_on[n - 1]
        if d is not None and on == "in":
            x = x * d.astype(x.dtype)
        y = self._through(x, n - 1)
        delta = self._term(x, a, b, s, y.dtype)
        if d is None or on == "in":
            return y + delta
        f = d.astype(y.dtype)
        bias = self.base["bias"] if "bias" in self.base else None
        return y + (f - 1) * (y if bias is None else y - bias.astype(y.dtype)) + f * delta


class LoRAConv(LoRALinear):
    """base(x) + sum_i scale_i * conv(x, A_i) @ B_i^T around a 2-D convolution (NHWC input, OHWI weights, as
    mlx.nn.Conv2d): A_i (rank, kh, kw, in) is the down convolution with the base's stride and padding, B_i
    (out, rank) the 1x1 up convolution as a matrix. A LoRALinear otherwise (what finds, removes or streams LoRA
    layers treats both alike; DoRA as there: the norms over each output channel's kh x kw x in kernel, or, per
    input channel, over out x kh x kw)."""

    def base_rows(self, n=None, dtype=None):
        """The base's OHWI kernel as float32 rows (out, kh x kw x in): a plain convolution's weight, or a compact
        one's decoded (loading/quantize.QuantizedConv2d, PalettizedConv2d)."""
        w = self.base.dense_weight() if hasattr(self.base, "dense_weight") else self.base["weight"]
        return w.astype(mx.float32).reshape(w.shape[0], -1)

    def dora_squares(self, a, b, scale, on="out"):
        changed = self._changed_rows(a, b, scale)
        if on == "out":
            return mx.sum(changed * changed, axis=1)
        changed = changed.reshape(changed.shape[0], -1, a.shape[-1])      # (out, kh x kw, in)
        return mx.sum(changed * changed, axis=(0, 1))

    def _term(self, x, a, b, s, dtype):
        return (mx.conv2d(x, a, stride=self.base.stride, padding=self.base.padding) * s).astype(dtype) @ b.T


def conv_dims(module):
    """(input channels, output channels, (kh, kw)) of a plain 2-D convolution (mlx.nn.Conv2d or a subclass, OHWI
    weight, groups 1, dilation 1), or of the one a LoRAConv wraps; None if it is not one."""
    if isinstance(module, LoRAConv):
        return conv_dims(module.base)
    if not isinstance(module, nn.Conv2d) or module.groups != 1 or module.dilation not in (1, (1, 1)):
        return None
    out, kh, kw, in_ = getattr(module, "kernel_shape", None) or module["weight"].shape   # a quantized conv's rows
    return in_, out, (kh, kw)
