"""LoRA for the SD3.5 (MMDiT) and FLUX.2 (dev, klein) transformers and the SD 1.x / SDXL UNet: the file formats,
how their names reach mlxdiff's layers, the low-rank wrappers, apply and remove.

A LoRA adds, to a linear layer y = base(x), the low-rank term scale * (x @ A^T) @ B^T with
scale = user scale * alpha / rank (alpha / sqrt(rank) for rsLoRA). It is added in the forward (`LoRALinear`), so
any base works unchanged: nn.Linear, nn.QuantizedLinear, the dequantize-per-call layer (loading/matmul.py), GGUF's
RawLinear and Fp8Linear; a 4-bit base is never dequantized, and the model grows by the LoRA's own bytes. Several
LoRAs on one layer each keep their own scale. A UNet's convolutions take LoRAs too (kohya's LoCon, PEFT's Conv2d
LoRA: `LoRAConv`): A is a convolution with the base's kernel, stride and padding (rank x in x kh x kw, as PyTorch
stores it), B a 1x1 convolution (out x rank x 1 x 1); the 1x1-conv projections of SD 1.5's transformers are such a
pair with a 1x1 A.

Formats (what the tools write), told apart by their names:
- diffusers / PEFT (`save_lora_weights`, `get_peft_model_state_dict`): `transformer.<module>.lora_A.weight` /
  `.lora_B.weight` in diffusers' module names, which are mlxdiff's own module paths; alpha from the
  `lora_adapter_metadata` header entry (PEFT's LoraConfig: r, lora_alpha, rank_pattern, alpha_pattern, use_rslora,
  as PEFT reads them), or from `<module>.alpha` keys (never both), else alpha = rank (scale 1), as diffusers reads
  it. Bare names (no `transformer.`) and PEFT's
  `base_model.model.` are read the same way.
- kohya / ComfyUI: `lora_unet_<module with dots as underscores>.lora_down.weight` / `.lora_up.weight` / `.alpha`
  (the original model's names, as kohya's trainers name them; diffusers' names are accepted too), and
  `diffusion_model.<name>.lora_A|lora_down...` (ai-toolkit, ComfyUI) in the original or diffusers names.
- original names (BFL's FLUX.2 `double_blocks.N.img_attn.qkv`, `single_blocks.N.linear1`, ...; Stability's SD3
  `joint_blocks.N.x_block.attn.qkv`, ...) go through the model's own ORIGINAL_KEYMAP (models/flux2.py,
  models/mmdit.py): the table that maps a base checkpoint maps its LoRA. lora_B has the base weight's rows, so it is
  split, reordered (swap_halves) exactly as the base weight is; lora_A (the input side) is shared by the parts.
  FLUX.2's single-block linear1 stays fused as in mlxdiff; its row ranges reach the LoRA through
  `LoRALinear.rows` (formats/quantized.linear_rows). FLUX.1's linear1 is q, k, v and the MLP in mlxdiff (models/
  flux1.py): its lora_B's rows go to the four layers (the MLP's four widths together).
- DoRA as PEFT saves it (use_dora=True: a `<module>.lora_magnitude_vector` beside lora_A / lora_B), on linear
  layers of any base form: each layer's m / ||W + scale B A|| (the norm of every output row of the changed weight,
  W read off the base as base(I) - bias) scales what the layer gives and the LoRA's term, as PEFT's DoraLinearLayer
  does. LyCORIS's / kohya's DoRA (`<module>.dora_scale` beside lora_down / lora_up or LoHa / LoKr factors) is the
  same magnitude, read as LyCORIS's wd_on_out (its default) stores it: (out, 1) (a convolution's (out, 1, 1, 1)); a
  per-input-column dora_scale (wd_on_out=False, (1, in)) is refused. At user scale 1 this is LyCORIS's
  apply_weight_decompose (lycoris/modules/lokr.py, loha.py; its + eps on the norm aside); at other scales mlxdiff
  keeps PEFT's rule (the norm of W + scale dW), where LyCORIS and ComfyUI blend the decomposed weight linearly.
  Nothing is fused into the weights, so a quantized / GGUF / fp8 base stays as it is: its W is read once through
  the layer itself (base(I) - bias) for the norm.
- LyCORIS's LoHa (`hada_w1_a`, `hada_w1_b`, `hada_w2_a`, `hada_w2_b`) and LoKr (`lokr_w1` or `lokr_w1_a` /
  `lokr_w1_b`, `lokr_w2` or `lokr_w2_a` / `lokr_w2_b`), with `.alpha`, in any of the namings above (PEFT's
  LoHaConfig / LoKrConfig write the same factor names): each layer's factors become one exact low-rank pair (A, B)
  with B A = the layer's weight change (`_lycoris` says the math and its sources), then go the LoRA path, on any
  base and on the UNet's convolutions (their w1_b / w2_b flattened as PyTorch's (rows, in x kh x kw)). Their Tucker
  forms (`hada_t1` / `hada_t2`, `lokr_t2`) are refused in one line.
- XLabs (x-flux, FLUX.1): `double_blocks.N.processor.qkv_lora1|proj_lora1|qkv_lora2|proj_lora2.down|up.weight`
  (1: the image stream, 2: the text stream) and `single_blocks.N.processor.qkv_lora|proj_lora`, no alpha (scale 1),
  through models/flux1.py's table.

UNet LoRAs (SD 1.x / SDXL): kohya's `lora_unet_<diffusers module, dots as underscores>` (sd-scripts' SD 1.x
names; SDXL's SGM names `input_blocks_N_M_...` go through models/unet.py's original-name table when it has one),
diffusers' `unet.<module>`, and the bare / `lora_unet_` names of the files above when they name UNet layers
(down_blocks, mid_block, up_blocks, input_blocks, ...): such a file's denoiser part is the pipeline component
"unet", every other one's "transformer".

Text-encoder parts (kohya `lora_te_` (SD 1.x's CLIP-L), `lora_te1_` / `lora_te2_` / `lora_te3_`, PEFT
`text_encoder.` / `text_encoder_2.` / `text_encoder_3.`) go to the CLIP and T5 encoders (SD3.5's CLIP-L, CLIP-G
and T5; SDXL's CLIP-L and CLIP-G; their module paths are transformers' names); the pipeline adds a file to every
component it has layers for (Pipeline.load_lora).

Refused, each in one line naming the file and the key: a name that reaches no layer of its component, a shape that
does not fit the layer, a LoRA of another architecture (SD3 on FLUX.2, FLUX.1, an SD/SDXL UNet), text-encoder
LoRAs for FLUX.2's LLM encoders, DoRA on a convolution, LyCORIS's Tucker forms (lora_mid, hada_t1, lokr_t2),
LoHa / LoKr factors that are no pair or whose product does not fit the layer, LoRA biases; one layer reached twice
from one file (two namings
of the same layer), and a component's layers named two ways in one file (prefixes or lora_A / lora_down styles
mixed: each tool reads such a file its own way); factors stored other than float32 / float16 / bfloat16; a tensor
holding NaN or infinity, or factors and scale whose product leaves the compute dtype's range (every LoRA tensor is
read whole when the file is checked: they are the file's own bytes); an .alpha that is not one positive number;
PEFT metadata of the wrong types, or that disagrees with the tensors (its ranks, the layers it names), or that asks
for what mlxdiff does not apply (PiSSA-style inits that change the base weights, layer replication, ...); alpha
given twice (.alpha tensors and metadata); a path that is not a regular .safetensors file. With PEFT metadata the
file is read as PEFT's LoraConfig reads it (defaults r = 8, lora_alpha = 8, rank_pattern / alpha_pattern matched as
PEFT matches them); without, alpha = rank unless .alpha tensors say otherwise.
"""

import math
import re
import stat
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

from .errors import MlxdiffError
from .formats.quantized import linear_dims, linear_rows, split_rows


# tensor name ending -> role ("A": down / input side, "B": up / output side, "alpha")
ROLES = (
    (".lora_A.weight", "A"), (".lora_B.weight", "B"),
    (".lora_down.weight", "A"), (".lora_up.weight", "B"),
    (".lora.down.weight", "A"), (".lora.up.weight", "B"),                   # diffusers' older attn-processor names
    (".lora_linear_layer.down.weight", "A"), (".lora_linear_layer.up.weight", "B"),
    (".alpha", "alpha"),
    (".lora_magnitude_vector.weight", "m"), (".lora_magnitude_vector", "m"),   # PEFT's DoRA (use_dora=True)
)
# XLabs' FLUX.1 LoRAs: <block>.processor.{qkv,proj}_lora[12].{down,up}.weight, no alpha (scale 1); read only on
# such module names, the endings being too common otherwise
XLABS_ROLES = ((".down.weight", "A"), (".up.weight", "B"))
# LyCORIS's LoHa / LoKr factors (also PEFT's LoHaConfig / LoKrConfig names) and kohya/LyCORIS's DoRA magnitude;
# _lycoris turns a layer's LoHa / LoKr factors into one exact low-rank pair (A, B)
LYCORIS_FACTORS = ("hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b",
                   "lokr_w1", "lokr_w1_a", "lokr_w1_b", "lokr_w2", "lokr_w2_a", "lokr_w2_b")
LYCORIS_ROLES = tuple((f".{f}{w}", f) for f in LYCORIS_FACTORS for w in (".weight", "")) + \
    ((".dora_scale.weight", "dora"), (".dora_scale", "dora"))
XLABS_MODULE = re.compile(r".*\.processor\.(qkv|proj)_lora[12]?$")
# what a tensor name says the file is when it is not a plain LoRA
NOT_LORA = (
    (re.compile(r".*\.(hada_t[12]|lokr_t[12])(\.weight)?$"), "a LyCORIS LoHa/LoKr in Tucker form (hada_t1 / lokr_t2)"),
    (re.compile(r".*\.lycoris_.*|^lycoris_.*"), "a LyCORIS (lycoris_ names)"),
    (re.compile(r".*\.(lora_[AB]|lora_up|lora_down)\.bias$"), "a LoRA with bias terms"),
    (re.compile(r".*\.diff(_b)?$"), "a full weight difference"),
    (re.compile(r".*\.lora_mid\.weight$"), "a LyCORIS LoCon in Tucker form (lora_mid)"),
)
# name prefix -> (the pipeline component it is for, how its layers are named): "any" (mlxdiff's = diffusers' /
# transformers' module names, else the original ones), "kohya" (the same with dots written as underscores). The
# first that matches wins; "" is bare names. kohya's te1/te2/te3 are SD3's CLIP-L, CLIP-G and T5 (SDXL's CLIP-L and
# CLIP-G), as diffusers' text_encoder, text_encoder_2, text_encoder_3; te is SD 1.x's one encoder. A "transformer"
# part whose names are a UNet's is the "unet" component (_entries).
PREFIXES = (
    ("lora_te_", "text_encoder", "kohya"), ("lora_te1_", "text_encoder", "kohya"),
    ("lora_te2_", "text_encoder_2", "kohya"), ("lora_te3_", "text_encoder_3", "kohya"),
    ("text_encoder.", "text_encoder", "any"), ("text_encoder_2.", "text_encoder_2", "any"),
    ("text_encoder_3.", "text_encoder_3", "any"),
    ("lora_unet_", "transformer", "kohya"), ("lora_transformer_", "transformer", "kohya"),
    ("transformer.", "transformer", "any"), ("base_model.model.", "transformer", "any"),
    ("model.diffusion_model.", "transformer", "any"), ("diffusion_model.", "transformer", "any"),
    ("unet.", "unet", "any"), ("", "transformer", "any"),
)
DENOISERS = ("transformer", "unet")
# text encoders whose LoRAs mlxdiff applies (their module paths are transformers' own names)
TEXT_ENCODERS = {"mlxdiff.models.clip": "CLIP", "mlxdiff.models.t5": "T5"}
# layer names that only some architectures have (searched in each name; the first that matches says which: the
# UNet's first, as its transformer blocks also have ff.net)
UNET_LAYERS = re.compile(r"(^|[._])(down_blocks|up_blocks|mid_block|input_blocks|output_blocks|middle_block)([._]|$)")
UNET = "an SD 1.x / SDXL UNet"
ARCHITECTURES = (
    (UNET_LAYERS, (UNET,)),
    (re.compile(r"(^|[._])(double_blocks[._]\d+[._](img|txt)_mod|single_blocks[._]\d+[._]modulation|vector_in|"
                r"single_transformer_blocks[._]\d+[._](proj_mlp|proj_out|norm[._]linear|attn[._]to_[qkv]))([._]|$)"),
     ("FLUX.1",)),
    (re.compile(r"(^|[._])(double_stream_modulation_(img|txt)|single_stream_modulation|to_qkv_mlp_proj|linear_in|"
                r"linear_out)([._]|$)"), ("FLUX.2",)),
    # BFL's block names, which both FLUX generations have
    (re.compile(r"(^|[._])(double_blocks|single_blocks|single_transformer_blocks|img_attn|txt_attn)([._]|$)"),
     ("FLUX.2", "FLUX.1")),
    (re.compile(r"(^|[._])(joint_blocks|x_block|context_block|time_text_embed|pos_embed)([._]|$)"), ("SD3",)),
    (re.compile(r"(^|[._])(norm1_context|ff_context[._]net|ff[._]net|norm1[._]linear)([._]|$)"), ("SD3", "FLUX.1")),
    # Z-Image's (diffusers' and the original names): its refiners, caption / patch embedders, and the main blocks'
    # attention, SwiGLU and modulation under layers.N (SD3's t_embedder / final_layer and FLUX's x_embedder are not
    # telling)
    (re.compile(r"(^|[._])(noise_refiner|context_refiner|cap_embedder|all_x_embedder|all_final_layer|"
                r"layers[._]\d+[._](attention[._](qkv|out|to_[qkv]|to_out|q_norm|k_norm|norm_[qk])|"
                r"feed_forward[._]w[123]|adaLN_modulation))([._]|$)"), ("Z-Image",)),
    # Qwen-Image's (diffusers' names, which all its LoRAs use): each block's per-stream modulation and MLP (its
    # attention's to_q / add_q_proj / to_add_out are SD3's and FLUX.1's names too, BFL's img_mod / img_mlp sit under
    # double_blocks, not transformer_blocks) and the text features' txt_norm
    (re.compile(r"(^|[._])(transformer_blocks[._]\d+[._](img|txt)_(mod|mlp)|txt_norm)([._]|$)"), ("Qwen-Image",)),
)
# A denoiser LoRAs apply to says so on its architecture module (models/protocol.LoRADenoiser): LORA_NAME (what
# messages call it), LORA_ARCHITECTURE (its label in ARCHITECTURES above), lora_original_rules(args) (its
# original-name table) and, optionally, LORA_UNMAPPED (a pattern of original names its table cannot map, and why).


# -- the wrapper ---------------------------------------------------------------------------------------------------

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


# -- reading a file ------------------------------------------------------------------------------------------------

def _short(name, limit=100):
    return name if len(name) <= limit else name[:limit] + "..."


def _lora_path(path) -> Path:
    """`path` if it names a regular .safetensors file, else one line saying what it is."""
    path = Path(path)
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        raise MlxdiffError(f"{path}: LoRA file not found") from None
    except OSError as e:
        raise MlxdiffError(f"{path}: cannot read the LoRA file ({e.strerror or e})") from None
    if stat.S_ISDIR(mode):
        raise MlxdiffError(f"{path}: is a folder; expected a .safetensors LoRA file")
    if not stat.S_ISREG(mode):
        kind = ("a character device" if stat.S_ISCHR(mode) else "a block device" if stat.S_ISBLK(mode)
                else "a FIFO (named pipe)" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode)
                else "not a file")
        raise MlxdiffError(f"{path}: is {kind}, not a regular file; expected a .safetensors LoRA file")
    if path.suffix != ".safetensors":
        raise MlxdiffError(f"{path}: expected a .safetensors LoRA file (LoRAs are read from safetensors files only; "
                           f"this is {'a ' + path.suffix if path.suffix else 'a file without a suffix'})")
    return path


# what a LoRA file's tensors may be stored as: its factors in a float type every tool computes with (diffusers'
# kohya conversion cannot even scale float8 ones), its alphas also as integers
FACTOR_DTYPES = ("F32", "F16", "BF16")
ALPHA_DTYPES = (*FACTOR_DTYPES, "I8", "I16", "I32", "I64", "U8", "U16", "U32", "U64")


def _read(path):
    """(lazy {name: array}, header metadata, {name: stored dtype}) of a LoRA file, checked by the safetensors
    gate."""
    from .formats.safetensors import check_safetensors, load_safetensors
    path = _lora_path(path)
    info, meta = check_safetensors(path, with_metadata=True)
    if not info:
        raise MlxdiffError(f"{path}: the LoRA file holds no tensors")
    return load_safetensors(path, info=info), meta, {k: dtype for k, (dtype, _) in info.items()}


# -- PEFT's LoraConfig (diffusers' lora_adapter_metadata) ----------------------------------------------------------

PEFT_DEFAULTS = {"r": 8, "lora_alpha": 8, "rank_pattern": {}, "alpha_pattern": {}, "use_rslora": False}
# init_lora_weights values that leave the base weights alone (PiSSA, OLoRA, CorDA, LoftQ and LoRA-GA change them)
PLAIN_INITS = ("gaussian", "orthogonal", "eva")
MAX_PATTERN_CHARS = 256
MAX_PATTERNS = 4096
MAX_PATTERN_REPEATS = 4


def _positive_int(v):
    return type(v) is int and v > 0


def _finite_number(v):
    return type(v) in (int, float) and math.isfinite(v)


def _names(v):
    return isinstance(v, str) or (isinstance(v, list) and all(isinstance(x, str) for x in v))


def _off(v):
    return v is None or v is False or v == [] or v == {} or v == ""


# field -> (check of its value, what it must be). Fields of other PEFT versions are not read. The fields whose only
# accepted value is "off" ask for what mlxdiff does not apply: other modules trained whole, layer replication,
# routing, other adapter kinds.
PEFT_FIELDS = {
    "r": (_positive_int, "a positive integer"),
    "lora_alpha": (_finite_number, "a finite number"),
    "lora_dropout": (lambda v: _finite_number(v) and 0 <= v <= 1, "a number from 0 to 1"),
    "fan_in_fan_out": (lambda v: isinstance(v, bool), "true or false"),
    "bias": (lambda v: v in ("none", "all", "lora_only"), '"none", "all" or "lora_only"'),
    "use_rslora": (lambda v: isinstance(v, bool), "true or false"),
    "use_dora": (lambda v: isinstance(v, bool), "true or false"),
    "lora_bias": (lambda v: v is False, "false (mlxdiff applies LoRAs without bias terms)"),
    "inference_mode": (lambda v: isinstance(v, bool), "true or false"),
    "peft_type": (lambda v: v == "LORA", '"LORA"'),
    "target_modules": (lambda v: v == "all-linear" or _names(v), "a list of module names or a pattern"),
    "exclude_modules": (lambda v: v is None or _names(v), "null, a list of module names or a pattern"),
    "rank_pattern": (lambda v: isinstance(v, dict) and all(_positive_int(x) for x in v.values()),
                     "an object of patterns -> positive integers"),
    "alpha_pattern": (lambda v: isinstance(v, dict) and all(_finite_number(x) for x in v.values()),
                      "an object of patterns -> finite numbers"),
    "init_lora_weights": (lambda v: isinstance(v, bool) or v in PLAIN_INITS,
                          f"true, false or one of {', '.join(PLAIN_INITS)} (the others change the base weights)"),
    "ensure_weight_tying": (lambda v: isinstance(v, bool), "true or false"),
    "layers_to_transform": (_off, "null (mlxdiff does not read layer selections)"),
    "layers_pattern": (_off, "null (mlxdiff does not read layer selections)"),
    "modules_to_save": (_off, "null (modules trained whole are not LoRA layers)"),
    "layer_replication": (_off, "null (mlxdiff does not replicate layers)"),
    "alora_invocation_tokens": (_off, "null (activated LoRA is not applied)"),
    "target_parameters": (_off, "null (LoRAs on parameters are not applied)"),
    "trainable_token_indices": (_off, "null (trained token embeddings are not applied)"),
    "use_qalora": (lambda v: v is False, "false"),
    **{name: (_off, "null (that LoRA variant is not applied)")
       for name in ("megatron_config", "loftq_config", "eva_config", "corda_config", "lora_ga_config",
                    "velora_config", "monteclora_config", "arrow_config", "kasa_config", "use_bdlora")},
}


def _repeats(path, where, sub, in_repeat=False) -> int:
    """The repeats of a parsed pattern; nested repeats, alternatives inside a repeat and back-references refused
    (what makes matching take exponential time)."""
    from re import _parser
    count = 0
    for op, av in sub:
        name = str(op)
        if name in ("MAX_REPEAT", "MIN_REPEAT", "POSSESSIVE_REPEAT"):
            if in_repeat:
                raise _pattern_error(path, where, "a repeat inside a repeat")
            count += 1 + _repeats(path, where, av[2], True)
        elif name == "SUBPATTERN":
            count += _repeats(path, where, av[-1], in_repeat)
        elif name == "ATOMIC_GROUP":
            count += _repeats(path, where, av, in_repeat)
        elif name in ("ASSERT", "ASSERT_NOT"):
            count += _repeats(path, where, av[1], in_repeat)
        elif name == "BRANCH":
            if in_repeat:
                raise _pattern_error(path, where, "alternatives inside a repeat")
            count += sum(_repeats(path, where, s, in_repeat) for s in av[1])
        elif name in ("GROUPREF", "GROUPREF_EXISTS"):
            raise _pattern_error(path, where, "a back-reference")
        elif isinstance(av, _parser.SubPattern):
            count += _repeats(path, where, av, in_repeat)
    return count


def _pattern_error(path, where, what):
    return MlxdiffError(f"{path}: {where} in its lora_adapter_metadata is not a pattern mlxdiff matches ({what}); "
                        "re-save the LoRA")


def _compile(path, where, pattern):
    """A pattern of the metadata, compiled, refused unless matching it takes bounded time: at most
    MAX_PATTERN_CHARS characters and MAX_PATTERN_REPEATS repeats, none nested."""
    from re import _parser
    if len(pattern) > MAX_PATTERN_CHARS:
        raise _pattern_error(path, where, f"{len(pattern)} characters, more than {MAX_PATTERN_CHARS}")
    try:
        compiled = re.compile(pattern)
        parsed = _parser.parse(pattern)
    except (re.error, RecursionError, OverflowError, ValueError) as e:
        raise _pattern_error(path, where, str(e)[:80]) from None
    if _repeats(path, where, parsed) > MAX_PATTERN_REPEATS:
        raise _pattern_error(path, where, f"more than {MAX_PATTERN_REPEATS} repeats")
    return compiled


def _peft_config(path, meta, component="transformer"):
    """PEFT's LoraConfig of `component` from diffusers' `lora_adapter_metadata` header entry, every field it reads
    type-checked and its patterns compiled (PEFT's defaults filled in); None when the file has no such entry."""
    text = meta.get("lora_adapter_metadata")
    if not text:
        return None
    from .formats.safetensors import parse_json, _short as short

    def bad(what):
        return MlxdiffError(f"{path}: its lora_adapter_metadata is not valid JSON ({what}); re-save the LoRA")
    config = parse_json(text, bad)
    if not isinstance(config, dict):
        raise MlxdiffError(f"{path}: its lora_adapter_metadata is {type(config).__name__}, not a JSON object of "
                           f"'{component}.<field>' entries; re-save the LoRA")
    prefix = component + "."
    config = {k[len(prefix):]: v for k, v in config.items() if k.startswith(prefix)}
    if not config:
        raise MlxdiffError(f"{path}: its lora_adapter_metadata has no '{component}.' entries (PEFT's LoraConfig of "
                           f"the {component}, as diffusers writes it); re-save the LoRA, or drop the metadata")
    for field, (ok, what) in PEFT_FIELDS.items():
        if field in config and not ok(config[field]):
            raise MlxdiffError(f"{path}: its lora_adapter_metadata has {component}.{field} = "
                               f"{short(config[field], 60)}, which must be {what}; re-save the LoRA")
    # use_dora: the file's lora_magnitude_vector tensors (plan checks that every layer has one)
    if config.get("target_modules") is None:
        raise MlxdiffError(f"{path}: its lora_adapter_metadata names no {component}.target_modules (the layers the "
                           "LoRA is on); re-save the LoRA")
    config = {**PEFT_DEFAULTS, **config}
    if len(config["rank_pattern"]) + len(config["alpha_pattern"]) > MAX_PATTERNS:
        raise MlxdiffError(f"{path}: its lora_adapter_metadata has more than {MAX_PATTERNS} rank / alpha patterns; "
                           "re-save the LoRA")
    for field in ("rank_pattern", "alpha_pattern"):
        config[field] = [(_compile(path, f"{component}.{field} {short(k, 60)}", k), v)
                         for k, v in config[field].items()]
    for field in ("target_modules", "exclude_modules"):
        value = config.get(field)
        if isinstance(value, str) and value != "all-linear":
            config[field] = _compile(path, f"{component}.{field}", value)
        elif isinstance(value, list):
            config[field] = set(value)
    return config


def _by_pattern(patterns, name, default):
    """PEFT's get_pattern_key: the value of the first pattern matching `name` or a dotted suffix of it
    (re.match(rf"(.*\\.)?({pattern})$", name)), else `default`."""
    suffixes = [name] + [name[i + 1:] for i, c in enumerate(name) if c == "."]
    for compiled, value in patterns:
        if any(compiled.fullmatch(s) for s in suffixes):
            return value
    return default


def _names_module(value, name) -> bool:
    """PEFT's target_modules / exclude_modules test for one module name: a pattern matching it whole, or a name
    equal to it or to a dotted suffix of it."""
    if value is None:
        return False
    if isinstance(value, re.Pattern):
        return value.fullmatch(name) is not None
    return name in value or any(name.endswith("." + v) for v in value)


def _split_name(name):
    """tensor name -> (component, naming kind, module name, role), or None when the name is no LoRA tensor's."""
    for ending, role in ROLES + LYCORIS_ROLES + XLABS_ROLES:
        if name.endswith(ending):
            module = name[:-len(ending)]
            if (ending, role) in XLABS_ROLES and not XLABS_MODULE.fullmatch(module):
                return None
            break
    else:
        return None
    for prefix, component, kind in PREFIXES:
        if module.startswith(prefix):
            return component, kind, module[len(prefix):], role
    return None


def _naming(name):
    """(name prefix, lora_A / lora_B style) of a LoRA factor's tensor name (one _split_name accepts)."""
    if any(name.endswith(ending) for ending, _ in XLABS_ROLES) and \
            XLABS_MODULE.fullmatch(name.rsplit(".", 2)[0]):
        style = "xlabs"
    elif any(name.endswith(ending) for ending, _ in LYCORIS_ROLES):
        style = 1         # LyCORIS's factors: kohya's lora_down / lora_up style
    else:
        style = next(i // 2 for i, (ending, _) in enumerate(ROLES) if name.endswith(ending))
    return next(prefix for prefix, _, _ in PREFIXES if name.startswith(prefix)), style


def _entries(path, tensors):
    """{(component, kind, module): {"A": (key, array), "B": ..., "alpha": ...}}, every tensor accounted for."""
    entries = {}
    for name in tensors:
        for pattern, what in NOT_LORA:
            if pattern.match(name):
                raise MlxdiffError(f"{path}: {what} file (tensor {_short(name)!r}); mlxdiff applies plain LoRAs "
                                   "(lora_A/lora_B or lora_down/lora_up), LoHa and LoKr (without Tucker) only")
        parsed = _split_name(name)
        if parsed is None:
            raise MlxdiffError(f"{path}: tensor {_short(name)!r} is not a LoRA tensor (expected <module>.lora_A.weight"
                               " / .lora_B.weight, .lora_down.weight / .lora_up.weight or .alpha)")
        component, kind, module, role = parsed
        slot = entries.setdefault((component, kind, module), {})
        if role in slot:
            raise MlxdiffError(f"{path}: {_short(name)!r} and {_short(slot[role][0])!r} are the same LoRA tensor of "
                               f"layer {_short(module)!r} in two namings; keep one")
        slot[role] = (name, tensors[name])
    for slot in entries.values():
        if any(role in slot for role in LYCORIS_FACTORS):
            _lycoris(path, slot)
        if "dora" in slot:
            if "m" in slot:
                raise MlxdiffError(f"{path}: {_short(slot['dora'][0])!r} and {_short(slot['m'][0])!r} are both DoRA "
                                   "magnitudes of one layer; keep one")
            slot["m"] = slot.pop("dora")
        for role, other in (("A", "B"), ("B", "A")):
            if role not in slot and other in slot:
                raise MlxdiffError(f"{path}: {_short(slot[other][0])!r} has no lora_{role} partner (the file is "
                                   "incomplete)")
        if "A" not in slot:
            extra = slot.get("alpha") or slot.get("m")
            raise MlxdiffError(f"{path}: {_short(extra[0])!r} belongs to no LoRA layer")
    if any(c == "transformer" and UNET_LAYERS.search(m) for c, _, m in entries):   # kohya's lora_unet_, bare names
        entries = {("unet" if c == "transformer" else c, k, m): v for (c, k, m), v in entries.items()}
    return entries


def _low_rank(m):
    """(U, V) with U @ V = m, the inner size min(rows, cols): one of them an identity."""
    rows, cols = m.shape
    return (mx.eye(rows), m) if rows <= cols else (m, mx.eye(cols))


def _kron_factors(u1, u2):
    """kron(u1, u2) of two matrices (numpy's / torch's order), as LyCORIS's make_kron builds it."""
    return (u1[:, None, :, None] * u2[None, :, None, :]).reshape(u1.shape[0] * u2.shape[0],
                                                                 u1.shape[1] * u2.shape[1])


def _lycoris(path, slot):
    """A LyCORIS LoHa / LoKr layer (also PEFT's LoHaConfig / LoKrConfig factors) as one exact low-rank pair, in
    place: slot["A"] (R, in [x kh x kw, flattened]) and slot["B"] (out, R) with B @ A = the weight change, its
    alpha / rank folded into B (the slot's alpha dropped), in float32 (the factors' products are not rounded).

    The math, as LyCORIS's own modules and PEFT compute it (read, not copied):
    - LoHa (lycoris/modules/loha.py LohaModule.get_weight -> functional/loha.py diff_weight;
      peft/tuners/loha/layer.py LoHaLayer.get_delta_weight): dW = (w1_a @ w1_b) * (w2_a @ w2_b) * alpha / r,
      r = w1_b's rows (LohaModule.make_module_from_state_dict: lora_dim). Its pair: B's columns w1_a[:, i] * w2_a[:, j],
      A's rows w1_b[i] * w2_b[j] (rank r1 x r2), exactly the Hadamard product.
    - LoKr (lycoris/modules/lokr.py LokrModule.get_weight -> functional/lokr.py make_kron;
      peft/tuners/lokr/layer.py LoKrLayer.get_delta_weight -> make_kron): dW = kron(w1, w2) * scale, w1 = lokr_w1
      or lokr_w1_a @ lokr_w1_b, w2 = lokr_w2 or lokr_w2_a @ lokr_w2_b; scale = alpha / r with r the decomposed
      factor's rank (w1_a's columns, else w2_a's: LokrModule.make_module_from_state_dict), and 1 when both factors
      are whole (LokrModule.__init__: "use scale = 1", alpha ignored). Its pair: kron(U1, U2), kron(V1, V2) of each
      factor's own pair (w = U @ V: its a / b factors, or the whole matrix and an identity).
    One scale, as PEFT, ComfyUI and the formula above apply it (LyCORIS's get_diff_weight multiplies get_weight's
    already-scaled weight by the scale once more; mlxdiff does not follow that).
    A pair whose rank would reach min(out, in) is the weight change itself and an identity. A convolution's w1_b /
    w2_b / lokr_w2 are (rows, in x kh x kw) flattened as PyTorch's weight (plan reshapes A to the layer's kernel).
    """
    roles = [r for r in LYCORIS_FACTORS if r in slot]
    keys = [slot[r][0] for r in roles]
    for other in ("A", "B"):
        if other in slot:
            raise MlxdiffError(f"{path}: {_short(slot[other][0])!r} and {_short(keys[0])!r}: a plain LoRA and LyCORIS "
                               "factors on one layer; keep one")

    def get(role):
        return slot[role][1].astype(mx.float32) if role in slot else None

    def flat(m):
        return m.reshape(m.shape[0], -1) if m is not None and m.ndim > 2 else m

    def bad(what):
        shapes = ", ".join(f"{_short(slot[r][0])!r} {tuple(slot[r][1].shape)}" for r in roles)
        return MlxdiffError(f"{path}: {shapes}: {what}")
    alpha = None
    if "alpha" in slot:
        key, value = slot.pop("alpha")
        if value.size != 1:
            raise MlxdiffError(f"{path}: {_short(key)!r} must be one number, got shape {tuple(value.shape)}")
        alpha = float(value.reshape(-1)[0].astype(mx.float32).item())
        if not (math.isfinite(alpha) and alpha > 0):
            raise MlxdiffError(f"{path}: {_short(key)!r} is {alpha:g}, not a positive number; re-save the LoRA")
    if roles[0].startswith("hada_"):
        if len(roles) != 4:
            raise bad("not a LoHa (it needs hada_w1_a, hada_w1_b, hada_w2_a and hada_w2_b)")
        w1a, w1b, w2a, w2b = (get(r) for r in LYCORIS_FACTORS[:4])
        w1b, w2b = flat(w1b), flat(w2b)
        if any(m.ndim != 2 for m in (w1a, w2a)) or w1a.shape[1] != w1b.shape[0] or w2a.shape[1] != w2b.shape[0] \
                or w1a.shape[0] != w2a.shape[0] or w1b.shape[1] != w2b.shape[1] or 0 in w1a.shape + w2a.shape:
            raise bad("not a LoHa (w1_a: out x r1, w1_b: r1 x in, w2_a: out x r2, w2_b: r2 x in)")
        scale = 1.0 if alpha is None else alpha / w1b.shape[0]
        b = (w1a[:, :, None] * w2a[:, None, :]).reshape(w1a.shape[0], -1)
        a = (w1b[:, None, :] * w2b[None, :, :]).reshape(-1, w1b.shape[1])
    else:
        sides = []
        for i in ("1", "2"):
            whole, fa, fb = get(f"lokr_w{i}"), get(f"lokr_w{i}_a"), get(f"lokr_w{i}_b")
            if (whole is None) == (fa is None and fb is None) or (fa is None) != (fb is None):
                raise bad(f"not a LoKr (it needs lokr_w{i}, or lokr_w{i}_a and lokr_w{i}_b)")
            if whole is not None:
                whole = flat(whole) if i == "2" else whole
                if whole.ndim != 2 or 0 in whole.shape:
                    raise bad(f"lokr_w{i} is not a matrix")
                sides.append((*_low_rank(whole), None))
            else:
                fb = flat(fb) if i == "2" else fb
                if fa.ndim != 2 or fb.ndim != 2 or fa.shape[1] != fb.shape[0] or 0 in fa.shape + fb.shape:
                    raise bad(f"lokr_w{i}_a and lokr_w{i}_b are not a pair (rows x r, r x cols)")
                sides.append((fa, fb, fa.shape[1]))
        (u1, v1, r1), (u2, v2, r2) = sides
        rank = r1 if r1 is not None else r2
        scale = 1.0 if rank is None else (alpha / rank if alpha is not None else 1.0)
        b, a = _kron_factors(u1, u2), _kron_factors(v1, v2)
    if a.shape[0] >= min(b.shape[0], a.shape[1]):      # no smaller than the change itself
        b, a = _low_rank(b @ a)
    slot["A"] = (keys[-1], a)
    slot["B"] = (keys[0], b * scale)
    slot["factors"] = keys
    slot["form"] = "LoHa" if roles[0].startswith("hada_") else "LoKr"


def _other_architecture(entries, family):
    """The architectures a file's layer names say it is for (those every telling name allows; all of them when no
    one architecture fits every name), when none of them is `family`: empty when the names fit, or say nothing."""
    allowed = []
    for *_, module in entries:
        for pattern, names in ARCHITECTURES:
            if pattern.search(module):
                allowed.append(set(names))
                break
    if not allowed:
        return set()
    common = set.intersection(*allowed) or set.union(*allowed)
    return set() if family in set.union(*allowed) else common


# -- names -> mlxdiff layers ---------------------------------------------------------------------------------------

def takes_loras(arch) -> bool:
    """Whether LoRAs apply to this denoiser architecture (it has the protocol's LoRA names)."""
    return hasattr(arch, "lora_original_rules")


def _original_rules(arch, args):
    """The model's own original-name table (compiled), with dotted and underscore-folded patterns (none for a model
    without one)."""
    rules = arch.lora_original_rules(args)
    folded = [(re.compile(p.pattern.replace(r"\.", "_")), t, f) for p, t, f in rules]
    return rules, folded


def _by_rules(key, rules):
    """[(mlxdiff path, part index, parts, transform)] of an original weight name under a rule table, or None."""
    for pattern, target, transform in rules:
        m = pattern.fullmatch(key)
        if not m:
            continue
        if target is None:
            return None
        targets = target if isinstance(target, tuple) else (target,)
        out = []
        for i, t in enumerate(targets):
            full = m.expand(t)
            if not full.endswith(".weight"):
                return None
            out.append((full[:-len(".weight")], i, len(targets), transform))
        return out
    return None


class _Layers:
    """The model's layers by mlxdiff path, also with dots folded to underscores (kohya names)."""

    def __init__(self, model, arch):
        self.modules = dict(model.named_modules())
        self.folded = {}
        for p in self.modules:
            self.folded.setdefault(p.replace(".", "_"), []).append(p)
        self.rules, self.folded_rules = _original_rules(arch, model.args) if takes_loras(arch) else ([], [])
        # transformers 5's CLIPTextModel has no `text_model.` in its layer names (clip.BARE_PREFIXES): nor have
        # LoRAs trained on it
        self.bare = getattr(arch, "BARE_PREFIXES", ())

    def resolve(self, kind, name):
        """[(mlxdiff path, part, parts, transform)] of a LoRA's layer name, or None when it reaches no layer of this
        model (an original name the rules map, of a block this model does not have, reaches none)."""
        found = self._resolve(kind, name)
        dot = "." if kind == "any" else "_"
        if found is None and name.startswith(tuple(p.replace(".", dot) for p in self.bare)):
            found = self._resolve(kind, f"text_model{dot}{name}")
        return found

    def _resolve(self, kind, name):
        def direct(path):
            return [(path, 0, 1, None)] if path in self.modules else None

        def existing(found):
            return found if found and all(target in self.modules for target, *_ in found) else None

        if kind == "kohya":
            found = existing(_by_rules(name + "_weight", self.folded_rules))
            if found is None:
                paths = self.folded.get(name, [])
                found = [(paths[0], 0, 1, None)] if len(paths) == 1 else None
            return found
        if kind == "any":
            return direct(name) or existing(_by_rules(name + ".weight", self.rules))
        return None


def _scale(path, slot, config, target, rank):
    """alpha / rank of one LoRA layer reaching mlxdiff layer `target` (diffusers' module name): PEFT's reading of
    its metadata (`config`: its r or rank_pattern must be the tensors' rank), else its .alpha tensor, else 1."""
    if config is not None:
        if "alpha" in slot:
            raise MlxdiffError(f"{path}: {_short(slot['alpha'][0])!r} and the lora_adapter_metadata both give the "
                               "alpha; keep one (drop the .alpha tensors or the metadata)")
        r = _by_pattern(config["rank_pattern"], target, config["r"])
        if r != rank:
            raise MlxdiffError(f"{path}: {_short(slot['A'][0])!r} is rank {rank}, its lora_adapter_metadata says rank "
                               f"{r} for layer {target!r} (r / rank_pattern); the file is inconsistent, re-save it")
        alpha = float(_by_pattern(config["alpha_pattern"], target, config["lora_alpha"]))
        return alpha / (math.sqrt(rank) if config["use_rslora"] else rank)
    if "alpha" not in slot:
        return 1.0
    key, value = slot["alpha"]
    if value.size != 1:
        raise MlxdiffError(f"{path}: {_short(key)!r} must be one number, got shape {tuple(value.shape)}")
    alpha = float(value.reshape(-1)[0].item())
    if not (math.isfinite(alpha) and alpha > 0):   # kohya's alpha: a positive number (0 would turn the LoRA off)
        raise MlxdiffError(f"{path}: {_short(key)!r} is {alpha:g}, not a positive number; re-save the LoRA")
    return alpha / rank


def _coverage(path, config, layers, reached, component):
    """With PEFT metadata, the layers it puts the LoRA on (target_modules, exclude_modules, matched as PEFT matches
    them over the model's modules) must be exactly the linear layers the tensors reach: diffusers would skip tensors
    of other layers, and put freshly initialised factors on named layers the file has no tensors for."""
    named = set()
    wrapped = {name for name, module in layers.modules.items() if isinstance(module, LoRALinear)}
    for name, module in layers.modules.items():
        if not name or name.rpartition(".")[0] in wrapped or _names_module(config.get("exclude_modules"), name):
            continue   # (the base of a layer that has LoRAs already is that layer)
        linear = linear_dims(module) is not None
        if (linear and config["target_modules"] == "all-linear") or _names_module(config["target_modules"], name):
            if not (linear or conv_dims(module)):
                raise MlxdiffError(f"{path}: its lora_adapter_metadata's {component}.target_modules names "
                                   f"{_short(name)!r}, a {type(module).__name__}, not a linear layer or a "
                                   "convolution; re-save the LoRA")
            named.add(name)
    for target, key in reached.items():
        if target not in named:
            raise MlxdiffError(f"{path}: {_short(key)!r} is on layer {target!r}, which its lora_adapter_metadata does "
                               f"not name ({component}.target_modules / exclude_modules); the file is inconsistent, "
                               "re-save it")
    missing = sorted(named - reached.keys())
    if missing:
        raise MlxdiffError(f"{path}: its lora_adapter_metadata puts the LoRA on layer {missing[0]!r}"
                           f"{f' (and {len(missing) - 1} more)' if len(missing) > 1 else ''}, for which the file has "
                           "no tensors; the file is incomplete, re-save it")


def _magnitudes(named):
    """{key: max |value|} of each (key, array) (inf where it holds a NaN or an infinity), a batch of tensors per
    evaluation: every LoRA tensor is read whole, it is the file's own bytes."""
    from .formats.safetensors import CHECK_BATCH_ELEMENTS
    out, batch, size = {}, [], 0

    def flush():
        if batch:
            values = mx.stack([m for _, m in batch]).tolist()
            out.update((k, v) for (k, _), v in zip(batch, values))
            batch.clear()
    for key, a in named:
        batch.append((key, mx.max(mx.where(mx.isfinite(a), mx.abs(a), mx.inf)).astype(mx.float32)))
        size += a.size
        if size >= CHECK_BATCH_ELEMENTS:
            flush()
            size = 0
    flush()
    return out


def _check_values(path, planned, dtype):
    """Every factor finite and within `dtype`, and |scale| x rank x max|A| x max|B| (a bound on each element of the
    layer's weight change) too: a LoRA that passes cannot make a layer's output NaN or infinite by itself."""
    arrays = {}
    for _, key_a, key_b, a, b, _, _, _ in planned:   # B whole (a fused layer's parts are row ranges of it)
        arrays.setdefault(key_a, a)
        arrays.setdefault(key_b, b)
    mags = _magnitudes(arrays.items())
    for key, m in mags.items():
        if not math.isfinite(m):
            raise MlxdiffError(f"{path}: LoRA tensor {_short(key)!r} holds NaN or infinite values; the file is damaged "
                               "(or its training diverged): use another LoRA file")
    top = mx.finfo(dtype).max
    name = str(dtype).rsplit(".", 1)[-1]
    for key, m in mags.items():
        if m > top:
            raise MlxdiffError(f"{path}: LoRA tensor {_short(key)!r} has values beyond {name}'s range (|x| up to "
                               f"{m:.3g}); compute in float32 or bfloat16 (--dtype), or use another LoRA file")
    for target, key_a, key_b, a, _, _, s, _ in planned:
        bound = abs(s) * a.shape[0] * mags[key_a] * mags[key_b]
        if not bound <= top:
            raise MlxdiffError(f"{path}: layer {target!r}: scale {s:.3g} x {_short(key_a)!r} x {_short(key_b)!r} can "
                               f"reach {bound:.3g}, beyond {name}'s range; the LoRA's alpha (or the scale) is far too "
                               "large")


def components(path) -> list:
    """The pipeline components a LoRA file has layers for ("transformer", "text_encoder", ...; its header and
    names only)."""
    return sorted({c for c, _, _ in _entries(path, _read(path)[0])})


def plan(model, arch, path, scale=1.0, component="transformer", dtype=None):
    """[(mlxdiff layer path, A, B, scale, DoRA magnitude or None)] for the `component` part of one LoRA file on
    `model` (that component:
    an mlxdiff transformer, or a CLIP / T5 encoder, of `arch`), every tensor checked: its layer exists and is
    linear, no layer is reached twice, the shapes fit, the metadata agrees, and every value is finite and keeps the
    layer's weight change within `dtype` (float32 when not given). The LoRA's tensors are read; the model's are not."""
    tensors, meta, stored = _read(path)
    config = _peft_config(path, meta, component)
    denoiser = component in DENOISERS    # (its part is a file's "transformer" or "unet" one: the names tell which)
    entries = {k: v for k, v in _entries(path, tensors).items()
               if k[0] == component or (denoiser and k[0] in DENOISERS)}
    unmapped = None
    if denoiser:
        what = f"this {arch.LORA_NAME}"
        unmapped = getattr(arch, "LORA_UNMAPPED", None)
        others = _other_architecture(entries, arch.LORA_ARCHITECTURE)
        if others:
            raise MlxdiffError(f"{path}: a LoRA for {' / '.join(sorted(others))} (layer names such as "
                               f"{_short(next(iter(entries))[2])!r}), not for {what}")
    else:
        if arch.__name__ not in TEXT_ENCODERS:
            raise MlxdiffError(f"{path}: has LoRA layers for {component}, a {arch.__name__.rsplit('.', 1)[-1]} "
                               "encoder; mlxdiff applies text-encoder LoRAs to CLIP and T5 encoders only: "
                               "use a LoRA file without text-encoder layers")
        what = f"{component} ({TEXT_ENCODERS[arch.__name__]})"
    layers = _Layers(model, arch)
    planned, reached = [], {}   # reached: mlxdiff layer -> the lora_A key that reaches it
    for (_, kind, module), slot in entries.items():
        key_a, a = slot["A"]
        key_b, b = slot["B"]
        targets = layers.resolve(kind, module)
        if not targets and unmapped and not layers.rules and unmapped[0].search(module):
            raise MlxdiffError(f"{path}: {_short(key_a)!r} {unmapped[1]}")
        if not targets:
            raise MlxdiffError(f"{path}: {_short(key_a)!r}: {what} has no layer {_short(module)!r}; the LoRA is "
                               "for another model (or another version of it)")
        for target in dict.fromkeys(target for target, *_ in targets):   # a layer named by several parts: once
            if target in reached:
                raise MlxdiffError(f"{path}: {_short(reached[target])!r} and {_short(key_a)!r} are both LoRAs of layer "
                                   f"{target!r} (one layer named twice, in two namings); keep one of them")
            reached[target] = key_a
        if a.ndim not in (2, 4) or b.ndim != a.ndim or a.shape[0] != b.shape[1] or a.shape[0] == 0 or \
                b.shape[2:] not in ((), (1, 1)):
            raise MlxdiffError(f"{path}: {_short(key_a)!r} {tuple(a.shape)} and {_short(key_b)!r} {tuple(b.shape)} "
                               "are not a LoRA pair (A: rank x in, B: out x rank; a convolution's: A rank x in x kh "
                               "x kw, B out x rank x 1 x 1)")
        if "factors" in slot and config is not None:
            raise MlxdiffError(f"{path}: {_short(key_a)!r}: LyCORIS LoHa / LoKr factors with PEFT LoraConfig metadata "
                               "(lora_adapter_metadata); the file is inconsistent, re-save it without the metadata")
        for key in slot.get("factors", (key_a, key_b)):
            if stored[key] not in FACTOR_DTYPES:
                raise MlxdiffError(f"{path}: {_short(key)!r} is {stored[key]}; LoRA factors are float32, float16 or "
                                   "bfloat16: re-save the LoRA in one of them")
        if "alpha" in slot and stored[slot["alpha"][0]] not in ALPHA_DTYPES:
            raise MlxdiffError(f"{path}: {_short(slot['alpha'][0])!r} is {stored[slot['alpha'][0]]}; an alpha is one "
                               "number (float or integer)")
        rank = a.shape[0]
        b = b.reshape(b.shape[:2])     # a convolution's 1x1 up factor is a matrix
        parts = targets[0][2]
        if b.shape[0] % parts:
            raise MlxdiffError(f"{path}: {_short(key_b)!r} has {b.shape[0]} rows; its layer {_short(module)!r} is "
                               f"{parts} layers here, which it cannot be split into")
        pieces = split_rows(b, parts) if parts > 1 else [b]
        magnitude = slot.get("m", (None, None))[1]   # DoRA: one magnitude per output row, split as B's rows
        if magnitude is not None:
            if slot["m"][0].endswith((".dora_scale", ".dora_scale.weight")) and magnitude.ndim >= 2 and \
                    magnitude.shape[0] == 1 < magnitude.shape[1]:
                raise MlxdiffError(f"{path}: {_short(slot['m'][0])!r} {tuple(magnitude.shape)} is not one magnitude "
                                   f"per output row ({b.shape[0]} x 1: LyCORIS's wd_on_out, its default); a dora_scale "
                                   "per input column (wd_on_out=False) is not applied: re-train with wd_on_out")
            magnitude = magnitude.reshape(-1)
            if magnitude.shape[0] != b.shape[0] or stored[slot["m"][0]] not in FACTOR_DTYPES:
                raise MlxdiffError(f"{path}: {_short(slot['m'][0])!r} {tuple(slot['m'][1].shape)} is not the DoRA "
                                   f"magnitude of {_short(key_b)!r} (one float per its {b.shape[0]} output rows)")
            if a.ndim == 4:
                raise MlxdiffError(f"{path}: {_short(slot['m'][0])!r}: DoRA on a convolution; mlxdiff applies DoRA "
                                   "to linear layers only: use the LoRA without its magnitude vectors")
        if config is not None and config.get("use_dora") and magnitude is None:
            raise MlxdiffError(f"{path}: {_short(key_a)!r} has no lora_magnitude_vector, but the file's metadata says "
                               "use_dora; the file is incomplete")
        m_pieces = (split_rows(magnitude, parts) if parts > 1 else [magnitude]) if magnitude is not None else None
        # a layer named by several consecutive parts takes their rows together (FLUX.1's linear1: q, k, v, then the
        # MLP's four widths)
        grouped = {}
        for (target, i, _, transform) in targets:
            grouped.setdefault(target, ([], transform))[0].append(i)
        for target, (indices, transform) in grouped.items():
            layer = layers.modules[target]
            dims, conv = linear_dims(layer), conv_dims(layer)
            if dims is None and conv is None:
                raise MlxdiffError(f"{path}: {_short(key_a)!r}: layer {target!r} is a {type(layer).__name__}, not a "
                                   "linear layer or a convolution; mlxdiff applies LoRAs to those only")
            piece = pieces[indices[0]] if len(indices) == 1 else mx.concatenate([pieces[j] for j in indices])
            piece = transform(piece) if transform else piece
            factor = a
            if conv is not None and "factors" in slot and a.ndim == 2 and conv[2] != (1, 1) and \
                    a.shape[1] == conv[0] * conv[2][0] * conv[2][1]:   # LoHa / LoKr: PyTorch's flattened kernel
                a = a.reshape(a.shape[0], conv[0], *conv[2])
            if conv is not None:   # A as the down convolution, OHWI (a 1x1 convolution's may be a matrix)
                factor = (a if a.ndim == 4 else a[:, :, None, None]).transpose(0, 2, 3, 1)
                fits = factor.shape[1:3] == conv[2] and factor.shape[3] == conv[0] and piece.shape[0] == conv[1]
                dims, kernel = conv[:2], f", kernel {conv[2][0]}x{conv[2][1]}"
            else:
                fits = a.ndim == 2 and a.shape[1] == dims[0] and piece.shape[0] == dims[1]
                kernel = ""
            if not fits and "factors" in slot:
                shapes = ", ".join(f"{_short(k.rsplit('.', 1)[-1])} {tuple(tensors[k].shape)}"
                                   for k in slot["factors"])
                raise MlxdiffError(
                    f"{path}: {_short(key_a.rsplit('.', 1)[0])!r}: its {slot['form']} factors ({shapes}) make a "
                    f"{b.shape[0]} x {slot['A'][1].shape[1]} weight change, which does not fit layer {target!r} "
                    f"({dims[0]} in{kernel and f' x {conv[2][0]} x {conv[2][1]}'}, {dims[1] * parts // len(indices)} "
                    "out); the LoRA is for another model size")
            if not fits:
                raise MlxdiffError(
                    f"{path}: {_short(key_a)!r}: shapes A {tuple(a.shape)}, B {tuple(slot['B'][1].shape)} do not fit "
                    f"layer {target!r} ({dims[0]} in, {dims[1] * parts // len(indices)} out{kernel}); the LoRA is for "
                    "another model size")
            s = scale * _scale(path, slot, config, target, rank)
            m = None if m_pieces is None else m_pieces[indices[0]] if len(indices) == 1 else \
                mx.concatenate([m_pieces[j] for j in indices])
            planned.append((target, key_a, key_b, factor, b, piece, s, m))
    namings = {}
    for slot in entries.values():
        for role in ("A", "B"):
            namings.setdefault(_naming(slot[role][0]), slot[role][0])
    if len(namings) > 1:   # each tool reads such a file its own way (diffusers keeps one naming, drops the other)
        first, second = list(namings.values())[:2]
        raise MlxdiffError(f"{path}: names its {component} LoRA layers two ways ({_short(first)!r}, "
                           f"{_short(second)!r}); re-save it in one naming")
    if config is not None:
        _coverage(path, config, layers, reached, component)
    _check_values(path, planned, dtype or mx.float32)
    return [(target, a, piece, s, m) for target, _, _, a, _, piece, s, m in planned]


def lora_nbytes(path) -> int:
    """Bytes of a LoRA file's tensors (its header; nothing is read)."""
    from .formats import tensor_nbytes
    return sum(tensor_nbytes(path).values())


def check(spec, path, scale=1.0, dtype=None):
    """Refuse a LoRA whose part for the component `spec` describes does not fit it, before any of the model's weights
    is read: its layers and shapes against a lazily built (never evaluated) model of the spec's config, its metadata,
    and its values (the LoRA's tensors are read whole) in the compute `dtype` (float32 when not given)."""
    if spec.name in DENOISERS and not takes_loras(spec.arch):
        raise MlxdiffError(f"{path}: LoRAs apply to the denoisers that name their LoRA layers (the SD3.5, FLUX.1, "
                           f"Chroma, FLUX.2, Z-Image and Qwen-Image transformers and the SD 1.x / SDXL UNet: "
                           f"models/protocol.LoRADenoiser), not {spec.arch.__name__}")
    plan(spec.arch.Model(spec.args), spec.arch, path, scale, spec.name, dtype)


def _cast(array, compute_dtype):
    """A LoRA tensor in a dtype that cannot promote the activations (as loading/build.keep_activations_in)."""
    promoted = (mx.zeros((), array.dtype) + mx.zeros((), compute_dtype)).dtype
    return array if promoted == compute_dtype else array.astype(compute_dtype)


def apply_loras(model, arch, loras, compute_dtype=None, component="transformer") -> nn.Module:
    """Add the `component` part of every (file, scale) of `loras` to `model` in place (LoRALinear around each layer
    a LoRA reaches; several on one layer stack) and evaluate the LoRA tensors (the base stays as it is, lazy or
    not). Every file is planned and checked before the model is changed: a refusal leaves it as it was."""
    dtype = compute_dtype or getattr(model, "compute_dtype", mx.float32)
    plans = [plan(model, arch, path, scale, component, dtype) for path, scale in loras]
    arrays = []
    modules = dict(model.named_modules())
    for planned in plans:
        cast = {}
        wrapped = {}
        for target, a, b, s, m in planned:
            a = cast.setdefault(id(a), _cast(a, dtype))     # a fused layer's A is one array for its parts
            b = _cast(b, dtype)
            arrays += [a, b]
            layer = wrapped.get(target, modules[target])
            if not isinstance(layer, LoRALinear):
                layer = wrapped[target] = (LoRAConv if a.ndim == 4 else LoRALinear)(layer)
            layer.add(a, b, s, None if m is None else layer.dora_factor(a, b, s, m))
            if m is not None:
                arrays.append(layer.lora_dora[-1])
        for target, layer in wrapped.items():
            _put(model, target, layer)
        modules = dict(model.named_modules())
    mx.eval(arrays)
    return model


def _put(model, path, layer):
    """model's module at the dotted `path` (list items by index) replaced by `layer`."""
    *parents, last = path.split(".")
    node = model
    for part in parents:
        node = node[int(part)] if isinstance(node, list) else node[part]
    if isinstance(node, list):
        node[int(last)] = layer
    else:
        node[last] = layer


def remove_loras(model) -> nn.Module:
    """Every LoRALinear of `model` back to its base layer, in place."""
    for path, m in [(p, m) for p, m in model.named_modules() if isinstance(m, LoRALinear)]:
        _put(model, path, m.base)
    return model


def describe(loras) -> str:
    """"name.safetensors:0.8, other.safetensors:1" (the PNG metadata's `lora` entry)."""
    return ", ".join(f"{Path(p).name}:{s:g}" for p, s in loras)
