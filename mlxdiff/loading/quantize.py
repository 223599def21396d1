"""Quantize a component while it loads, and read back quantized mlxdiff checkpoints.

Rule for what stays in full precision (`KEEP_FULL_PRECISION`, matched against module paths): embeddings and
embedders (token/position embeddings, patch embedding, timestep/text/guidance embedders, T5's relative position
bias), the output modulation and projection (`norm_out.linear`, `proj_out`), FLUX.2's shared modulations
(`*_modulation*`: one small layer per stream that every block reads), CLIP's text projection, and every
non-Linear module (norms, convolutions). Those are small, and an error there reaches every block. SD3's per-block
adaLN layers (`norm1.linear`, `norm1_context.linear`) ARE quantized: they hold about a third of the MMDiT's
weights, so keeping them would forfeit much of the saving. A Linear whose input width is not a multiple of the
group size also stays as it is.

Streaming: nn.quantize replaces each Linear by a QuantizedLinear whose arrays are still lazy functions of the lazily
mapped file; `materialize` then evaluates one module at a time, so the full-precision model never exists at once.
The peak is the quantized size plus about one layer in its stored dtype.
"""

import re

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from ..errors import MlxdiffError

KEEP_FULL_PRECISION = [
    r"(^|.*\.)(embed_tokens|token_embedding|position_embedding|shared|relative_attention_bias)$",
    r"(^|.*\.)(pos_embed|x_embedder|context_embedder|time_text_embed|time_guidance_embed|timestep_embedder|"
    r"guidance_embedder|text_embedder)(\..*)?$",
    r"(^|.*\.)norm_out\.linear$",          # the output AdaLayerNormContinuous
    r"(^|.*\.)[^.]*modulation[^.]*(\..*)?$",  # FLUX.2 shared modulation
    r"(^|.*\.)(proj_out|text_projection)$",
]
_KEEP = [re.compile(p) for p in KEEP_FULL_PRECISION]
SUPPORTED_BITS = (3, 4, 5, 6, 8)
GROUP_SIZES = (32, 64, 128)


def check_settings(bits, group_size, where="quantize"):
    if bits not in SUPPORTED_BITS:
        raise MlxdiffError(f"{where}: {bits}-bit quantization is not supported; use one of {SUPPORTED_BITS}")
    if group_size not in GROUP_SIZES:
        raise MlxdiffError(f"{where}: group size {group_size} is not supported; use one of {GROUP_SIZES}")


def keeps_full_precision(path: str) -> bool:
    return any(p.fullmatch(path) for p in _KEEP)


def quantize_model(model, bits: int, group_size: int = 64):
    """Replace eligible Linear layers by QuantizedLinear (lazily; call materialize to stream)."""
    check_settings(bits, group_size)

    def eligible(path, module):
        return (isinstance(module, nn.Linear) and not keeps_full_precision(path)
                and module.weight.shape[-1] % group_size == 0)

    nn.quantize(model, group_size=group_size, bits=bits, class_predicate=eligible)
    return model


def prepare_quantized(model, weights: dict, quantization: dict):
    """For a checkpoint saved quantized: turn exactly the layers that have `.scales` into QuantizedLinear."""
    bits, group_size = quantization["bits"], quantization["group_size"]
    nn.quantize(model, group_size=group_size, bits=bits,
                class_predicate=lambda path, m: isinstance(m, (nn.Linear, nn.Embedding)) and f"{path}.scales" in weights)
    return model


def materialize(model):
    """Evaluate parameters one leaf module at a time (bounded peak when quantizing while loading)."""
    for _, module in tree_flatten(model.leaf_modules(), is_leaf=lambda m: isinstance(m, nn.Module)):
        params = module.parameters()
        if params:
            mx.eval(params)
