"""The 2x2 latent patches that FLUX.1, Chroma and Qwen-Image denoise as tokens (diffusers' _pack_latents /
_unpack_latents): one layout, shared by the families whose transformers take it."""


def pack_2x2(x):
    """(B, C, 2h, 2w) latents -> (B, h*w, 4C) tokens of 2x2 patches, channels first within a token."""
    b, c, hh, ww = x.shape
    x = x.reshape(b, c, hh // 2, 2, ww // 2, 2).transpose(0, 2, 4, 1, 3, 5)
    return x.reshape(b, (hh // 2) * (ww // 2), 4 * c)


def unpack_2x2(x, shape):
    """pack_2x2's inverse: (B, h*w, 4C) tokens -> latents of `shape` (B, C, 2h, 2w)."""
    b, c, hh, ww = shape
    x = x.reshape(b, hh // 2, ww // 2, c, 2, 2).transpose(0, 3, 1, 4, 2, 5)
    return x.reshape(b, c, hh, ww)
