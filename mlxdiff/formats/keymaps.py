"""Key mapping as data: tables of (pattern, target[, transform]) rules.

Each source key is matched against the rules in order (`re.fullmatch`); the first match wins.
- target is a `re` replacement template, or a tuple of templates: the tensor is then split into equal parts
  along axis 0 (a fused qkv becomes q, k, v);
- transform names a function in TRANSFORMS applied to the tensor (or to each part);
- target None drops the key.
A key no rule matches passes through unchanged, so that strict loading can name it as unexpected.
"""

import re

from ..errors import MlxdiffError
from .quantized import concat_rows, split_rows


def swap_halves(w):
    """Original checkpoints order adaLN chunks (shift, scale); diffusers uses (scale, shift)."""
    shift, scale = split_rows(w, 2)
    return concat_rows([scale, shift])


def squeeze_1x1(w):
    """A 1x1 conv used as a linear layer: [C, C, 1, 1] -> [C, C]."""
    return w.reshape(w.shape[0], w.shape[1]) if w.ndim == 4 else w


TRANSFORMS = {"swap_halves": swap_halves, "squeeze_1x1": squeeze_1x1}


def compile_rules(rules):
    return [(re.compile(r[0]), r[1], TRANSFORMS[r[2]] if len(r) > 2 and r[2] else None) for r in rules]


def remap(weights: dict, rules) -> dict:
    """Apply a rule table to {key: array}. `rules` is a list of tuples or the output of compile_rules."""
    compiled = rules if rules and isinstance(rules[0][0], re.Pattern) else compile_rules(rules)
    out = {}
    for key, value in weights.items():
        for pattern, target, transform in compiled:
            m = pattern.fullmatch(key)
            if not m:
                continue
            if target is None:
                break
            if isinstance(target, tuple):
                for name, part in zip(target, split_rows(value, len(target))):
                    out[m.expand(name)] = transform(part) if transform else part
            else:
                out[m.expand(target)] = transform(value) if transform else value
            break
        else:
            out[key] = value
    return out


def strip_prefix(weights: dict, prefix: str) -> dict:
    """The keys under `prefix`, without it."""
    n = len(prefix)
    return {k[n:]: v for k, v in weights.items() if k.startswith(prefix)}


def under_prefix_if_present(weights: dict, prefix: str) -> dict:
    """Original checkpoints come with or without a component prefix (`model.diffusion_model.`): with it present,
    only the keys under it (the other components left out), without it; else the keys as they are."""
    if any(k.startswith(prefix) for k in weights):
        return strip_prefix(weights, prefix)
    return weights


def required_shape(weights: dict, key: str, what: str, ndim: int | None = None) -> tuple:
    """The shape of `weights[key]` for reading a config off an original checkpoint: present (else the file is
    incomplete), with `ndim` dimensions when given and no empty one, so that no config is read off an impossible
    tensor (a 1-D embedder, a zero-length norm)."""
    if key not in weights:
        raise MlxdiffError(f"not a complete {what} original checkpoint: {key!r} is missing; re-download the file")
    shape = tuple(weights[key].shape)
    if (ndim is not None and len(shape) != ndim) or not all(shape):
        expected = (f"{ndim} non-zero dimension{'s' if ndim > 1 else ''}" if ndim is not None
                    else "no zero dimension")
        raise MlxdiffError(f"not a valid {what} checkpoint: tensor {key!r} has shape {list(shape)}; expected "
                           f"{expected}")
    return shape
