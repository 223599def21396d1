"""Key mapping as data: tables of (pattern, target[, transform]) rules.

Each source key is matched against the rules in order (`re.fullmatch`); the first match wins.
- target is a `re` replacement template, or a tuple of templates: the tensor is then split into equal parts
  along axis 0 (a fused qkv becomes q, k, v);
- transform names a function in TRANSFORMS applied to the tensor (or to each part);
- target None drops the key.
A key no rule matches passes through unchanged, so that strict loading can name it as unexpected.
"""

import re

import mlx.core as mx


def split_rows(w, n):
    """Equal row blocks of an array, or of a GGUF weight that stays quantized (rows of weight/scales/biases)."""
    from .gguf import split_rows as split
    return split(w, n)


def swap_halves(w):
    """Original checkpoints order adaLN chunks (shift, scale); diffusers uses (scale, shift)."""
    from .gguf import concat_rows
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
