"""LoRA for the SD3.5 (MMDiT) and FLUX.2 (dev, klein) transformers: the file formats, how their names reach
mlxdiff's layers, the low-rank wrapper, apply and remove.

A LoRA adds, to a linear layer y = base(x), the low-rank term scale * (x @ A^T) @ B^T with
scale = user scale * alpha / rank (alpha / sqrt(rank) for rsLoRA). It is added in the forward (`LoRALinear`), so
any base works unchanged: nn.Linear, nn.QuantizedLinear, the dequantize-per-call layer (loading/matmul.py), GGUF's
RawLinear and Fp8Linear; a 4-bit base is never dequantized, and the model grows by the LoRA's own bytes. Several
LoRAs on one layer each keep their own scale.

Formats (what the tools write), told apart by their names:
- diffusers / PEFT (`save_lora_weights`, `get_peft_model_state_dict`): `transformer.<module>.lora_A.weight` /
  `.lora_B.weight` in diffusers' module names, which are mlxdiff's own module paths; alpha from `<module>.alpha`
  keys, else the `lora_adapter_metadata` header entry (PEFT's LoraConfig: lora_alpha, alpha_pattern, use_rslora),
  else alpha = rank (scale 1), as diffusers reads it. Bare names (no `transformer.`) and PEFT's
  `base_model.model.` are read the same way.
- kohya / ComfyUI: `lora_unet_<module with dots as underscores>.lora_down.weight` / `.lora_up.weight` / `.alpha`
  (the original model's names, as kohya's trainers name them; diffusers' names are accepted too), and
  `diffusion_model.<name>.lora_A|lora_down...` (ai-toolkit, ComfyUI) in the original or diffusers names.
- original names (BFL's FLUX.2 `double_blocks.N.img_attn.qkv`, `single_blocks.N.linear1`, ...; Stability's SD3
  `joint_blocks.N.x_block.attn.qkv`, ...) go through the model's own ORIGINAL_KEYMAP (models/flux2.py,
  models/mmdit.py): the table that maps a base checkpoint maps its LoRA. lora_B has the base weight's rows, so it is
  split, reordered (swap_halves) exactly as the base weight is; lora_A (the input side) is shared by the parts.
  FLUX.2's single-block linear1 stays fused as in mlxdiff; its row ranges reach the LoRA through
  `LoRALinear.rows` (formats/quantized.linear_rows).

Text-encoder parts (kohya `lora_te1_` / `lora_te2_` / `lora_te3_`, PEFT `text_encoder.` / `text_encoder_2.` /
`text_encoder_3.`) go to SD3.5's CLIP-L, CLIP-G and T5 encoders (their module paths are transformers' names); the
pipeline adds a file to every component it has layers for (Pipeline.load_lora).

Refused, each in one line naming the file and the key: a name that reaches no layer of its component, a shape that
does not fit the layer, a LoRA of another architecture (SD3 on FLUX.2, FLUX.1, an SD/SDXL UNet), text-encoder
LoRAs for FLUX.2's LLM encoders, DoRA, LoKr/LoHa, LoRA biases.
"""

import math
import re
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
)
# what a tensor name says the file is when it is not a plain LoRA
NOT_LORA = (
    (re.compile(r".*\.(dora_scale|lora_magnitude_vector)(\.weight)?$"), "a DoRA (magnitude vectors)"),
    (re.compile(r".*\.(lokr_|hada_|lycoris_).*|^lycoris_.*"), "a LyCORIS LoKr/LoHa"),
    (re.compile(r".*\.(lora_[AB]|lora_up|lora_down)\.bias$"), "a LoRA with bias terms"),
    (re.compile(r".*\.diff(_b)?$"), "a full weight difference"),
)
# name prefix -> (the pipeline component it is for, how its layers are named): "any" (mlxdiff's = diffusers' /
# transformers' module names, else the original ones), "kohya" (the same with dots written as underscores), "unet"
# (an SD/SDXL UNet's). The first that matches wins; "" is bare names. kohya's te1/te2/te3 are SD3's CLIP-L, CLIP-G
# and T5, as diffusers' text_encoder, text_encoder_2, text_encoder_3.
PREFIXES = (
    ("lora_te_", "text_encoder", "kohya"), ("lora_te1_", "text_encoder", "kohya"),
    ("lora_te2_", "text_encoder_2", "kohya"), ("lora_te3_", "text_encoder_3", "kohya"),
    ("text_encoder.", "text_encoder", "any"), ("text_encoder_2.", "text_encoder_2", "any"),
    ("text_encoder_3.", "text_encoder_3", "any"),
    ("lora_unet_", "transformer", "kohya"), ("lora_transformer_", "transformer", "kohya"),
    ("transformer.", "transformer", "any"), ("base_model.model.", "transformer", "any"),
    ("model.diffusion_model.", "transformer", "any"), ("diffusion_model.", "transformer", "any"),
    ("unet.", "transformer", "unet"), ("", "transformer", "any"),
)
# text encoders whose LoRAs mlxdiff applies (their module paths are transformers' own names)
TEXT_ENCODERS = {"mlxdiff.models.clip": "CLIP", "mlxdiff.models.t5": "T5"}
# layer names that only some architectures have (searched in each name; the first that matches says which)
ARCHITECTURES = (
    (re.compile(r"(^|[._])(double_blocks[._]\d+[._](img|txt)_mod|single_blocks[._]\d+[._]modulation|vector_in|"
                r"single_transformer_blocks[._]\d+[._](proj_mlp|proj_out|norm[._]linear|attn[._]to_[qkv]))([._]|$)"),
     ("FLUX.1",)),
    (re.compile(r"(^|[._])(double_blocks|single_blocks|single_transformer_blocks|double_stream_modulation_(img|txt)|"
                r"single_stream_modulation|to_qkv_mlp_proj|linear_in|linear_out|img_attn|txt_attn)([._]|$)"),
     ("FLUX.2",)),
    (re.compile(r"(^|[._])(joint_blocks|x_block|context_block|time_text_embed|pos_embed)([._]|$)"), ("SD3",)),
    (re.compile(r"(^|[._])(norm1_context|ff_context[._]net|ff[._]net|norm1[._]linear)([._]|$)"), ("SD3", "FLUX.1")),
    (re.compile(r"(^|[._])(down_blocks|up_blocks|mid_block|input_blocks|output_blocks|middle_block)([._]|$)"),
     ("an SD 1.x / SDXL UNet",)),
)
FAMILY = {"sd3": "SD3", "flux2": "FLUX.2"}
MODEL_NAMES = {"mlxdiff.models.mmdit": ("sd3", "SD3.5"), "mlxdiff.models.flux2": ("flux2", "FLUX.2")}


# -- the wrapper ---------------------------------------------------------------------------------------------------

class LoRALinear(nn.Module):
    """base(x) + sum_i scale_i * (x @ A_i^T) @ B_i^T around any linear layer (kept as `base`, untouched).

    `adapters`: [(A (rank, in), B (out, rank), scale)]. The arrays are the model's parameters (frozen); the scales
    are plain floats."""

    def __init__(self, base, adapters=()):
        super().__init__()
        self.base = base
        self.lora_a = [a for a, _, _ in adapters]
        self.lora_b = [b for _, b, _ in adapters]
        self._scales = [float(s) for _, _, s in adapters]
        self.freeze()

    @property
    def weight(self):          # the base's (what a model reads its layer's output rows from)
        return self.base["weight"]

    def add(self, a, b, scale):
        self.lora_a.append(a)
        self.lora_b.append(b)
        self._scales.append(float(scale))
        self.freeze()

    def adapters(self):
        return list(zip(self.lora_a, self.lora_b, self._scales))

    def _extra_repr(self):
        return f"{len(self._scales)} LoRA(s), ranks {[a.shape[0] for a in self.lora_a]}, scales {self._scales}"

    def rows(self, start, stop):
        """The layer restricted to output rows start:stop (formats/quantized.linear_rows): the base's rows and B's."""
        return LoRALinear(linear_rows(self.base, start, stop),
                          [(a, b[start:stop], s) for a, b, s in self.adapters()])

    def __call__(self, x):
        y = self.base(x)
        for a, b, s in zip(self.lora_a, self.lora_b, self._scales):
            y = y + ((x @ a.T) * s).astype(y.dtype) @ b.T
        return y


# -- reading a file ------------------------------------------------------------------------------------------------

def _short(name, limit=100):
    return name if len(name) <= limit else name[:limit] + "..."


def _read(path):
    """(lazy {name: array}, header metadata) of a LoRA file, checked by the safetensors gate."""
    from .formats import check_weight_file
    from .formats.safetensors import check_safetensors, load_safetensors
    path = check_weight_file(path, "LoRA file")
    if path.suffix != ".safetensors":
        raise MlxdiffError(f"{path}: LoRA files are read as .safetensors; this is a {path.suffix} file")
    info, meta = check_safetensors(path, with_metadata=True)
    if not info:
        raise MlxdiffError(f"{path}: the LoRA file holds no tensors")
    return load_safetensors(path, info=info), meta


def _peft_config(path, meta, component="transformer"):
    """PEFT's LoraConfig of `component` from diffusers' `lora_adapter_metadata` header entry ({} if none)."""
    text = meta.get("lora_adapter_metadata")
    if not text:
        return {}
    from .formats.safetensors import parse_json

    def bad(what):
        return MlxdiffError(f"{path}: its lora_adapter_metadata is not valid JSON ({what}); re-save the LoRA")
    config = parse_json(text, bad)
    if not isinstance(config, dict):
        raise bad("not an object")
    if any(k.startswith(("transformer.", "text_encoder")) for k in config):    # diffusers packs one per component
        config = {k[len(component) + 1:]: v for k, v in config.items() if k.startswith(component + ".")}
    if config.get("use_dora"):
        raise MlxdiffError(f"{path}: a DoRA (use_dora in its metadata); mlxdiff applies plain LoRAs only")
    return config


def _split_name(name):
    """tensor name -> (component, naming kind, module name, role), or None when the name is no LoRA tensor's."""
    for ending, role in ROLES:
        if name.endswith(ending):
            module = name[:-len(ending)]
            break
    else:
        return None
    for prefix, component, kind in PREFIXES:
        if module.startswith(prefix):
            return component, kind, module[len(prefix):], role
    return None


def _entries(path, tensors):
    """{(component, kind, module): {"A": (key, array), "B": ..., "alpha": ...}}, every tensor accounted for."""
    entries = {}
    for name in tensors:
        for pattern, what in NOT_LORA:
            if pattern.match(name):
                raise MlxdiffError(f"{path}: {what} file (tensor {_short(name)!r}); mlxdiff applies plain LoRAs "
                                   "(lora_A/lora_B or lora_down/lora_up) only")
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
        for role, other in (("A", "B"), ("B", "A")):
            if role not in slot and other in slot:
                raise MlxdiffError(f"{path}: {_short(slot[other][0])!r} has no lora_{role} partner (the file is "
                                   "incomplete)")
        if "A" not in slot:
            raise MlxdiffError(f"{path}: {_short(slot['alpha'][0])!r} belongs to no LoRA layer")
    return entries


def _other_architecture(entries, family):
    """The architectures a file's layer names say it is for, when none of its names fits `family` (a set of
    names; empty when the names fit, or say nothing)."""
    found, fits = set(), False
    for *_, module in entries:
        for pattern, names in ARCHITECTURES:
            if pattern.search(module):
                found.update(names)
                fits = fits or family in names
                break
    return set() if fits else found


# -- names -> mlxdiff layers ---------------------------------------------------------------------------------------

def _family(arch):
    return MODEL_NAMES[arch.__name__]


def _original_rules(arch, args):
    """The model's own original-name table (compiled), with dotted and underscore-folded patterns."""
    if _family(arch)[0] == "sd3":
        rules = arch.original_rules(args.num_layers - 1)
    else:
        rules = arch._ORIGINAL_RULES
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
    """The model's linear layers by mlxdiff path, also with dots folded to underscores (kohya names)."""

    def __init__(self, model, arch):
        self.modules = dict(model.named_modules())
        self.folded = {}
        for p in self.modules:
            self.folded.setdefault(p.replace(".", "_"), []).append(p)
        self.rules, self.folded_rules = _original_rules(arch, model.args) if arch.__name__ in MODEL_NAMES else ([], [])

    def resolve(self, kind, name):
        def direct(path):
            return [(path, 0, 1, None)] if path in self.modules else None

        if kind == "kohya":
            found = _by_rules(name + "_weight", self.folded_rules)
            if found is None:
                paths = self.folded.get(name, [])
                found = [(paths[0], 0, 1, None)] if len(paths) == 1 else None
            return found
        if kind == "any":
            return direct(name) or _by_rules(name + ".weight", self.rules)
        return None


def _alpha(path, slot, config, module, rank):
    if "alpha" in slot:
        key, value = slot["alpha"]
        if value.size != 1 or not (mx.issubdtype(value.dtype, mx.floating) or mx.issubdtype(value.dtype, mx.integer)):
            raise MlxdiffError(f"{path}: {_short(key)!r} must be one number, got shape {tuple(value.shape)}")
        alpha = float(value.reshape(-1)[0].item())
    else:
        alpha = None
        for pattern, value in (config.get("alpha_pattern") or {}).items():
            try:
                if re.match(rf"(.*\.)?({pattern})$", module):
                    alpha = value
                    break
            except re.error:
                raise MlxdiffError(f"{path}: alpha_pattern {pattern!r} in its metadata is not a pattern") from None
        if alpha is None:
            alpha = config.get("lora_alpha", rank)
        if isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
            raise MlxdiffError(f"{path}: lora_alpha {alpha!r} in its metadata is not a number")
        alpha = float(alpha)
    if not math.isfinite(alpha):
        raise MlxdiffError(f"{path}: the alpha of layer {_short(module)!r} is {alpha}; re-save the LoRA")
    return alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)


def components(path) -> list:
    """The pipeline components a LoRA file has layers for ("transformer", "text_encoder", ...; its header and
    names only)."""
    return sorted({c for c, _, _ in _entries(path, _read(path)[0])})


def plan(model, arch, path, scale=1.0, component="transformer"):
    """[(mlxdiff layer path, A, B, scale)] for the `component` part of one LoRA file on `model` (that component:
    an mlxdiff transformer, or a CLIP / T5 encoder, of `arch`), every tensor checked: its layer exists and is
    linear, and the shapes fit. The arrays stay lazy."""
    tensors, meta = _read(path)
    config = _peft_config(path, meta, component)
    entries = {k: v for k, v in _entries(path, tensors).items() if k[0] == component}
    if component == "transformer":
        _, family_name = _family(arch)
        others = _other_architecture(entries, FAMILY[_family(arch)[0]])
        if others:
            raise MlxdiffError(f"{path}: a LoRA for {' / '.join(sorted(others))} (layer names such as "
                               f"{_short(next(iter(entries))[2])!r}), not for this {family_name} transformer")
        what = f"this {family_name} transformer"
    else:
        if arch.__name__ not in TEXT_ENCODERS:
            raise MlxdiffError(f"{path}: has LoRA layers for {component}, a {arch.__name__.rsplit('.', 1)[-1]} "
                               "encoder; mlxdiff applies text-encoder LoRAs to SD3.5's CLIP and T5 encoders only: "
                               "use a transformer-only LoRA file")
        what = f"{component} ({TEXT_ENCODERS[arch.__name__]})"
    layers = _Layers(model, arch)
    out = []
    for (_, kind, module), slot in entries.items():
        key_a, a = slot["A"]
        key_b, b = slot["B"]
        if kind == "unet":
            raise MlxdiffError(f"{path}: {_short(key_a)!r} is a UNet LoRA (SD 1.x / SDXL), not for {what}")
        targets = layers.resolve(kind, module)
        if not targets:
            raise MlxdiffError(f"{path}: {_short(key_a)!r}: {what} has no layer {_short(module)!r}; the LoRA is "
                               "for another model (or another version of it)")
        if a.ndim != 2 or b.ndim != 2 or a.shape[0] != b.shape[1] or a.shape[0] == 0:
            raise MlxdiffError(f"{path}: {_short(key_a)!r} {tuple(a.shape)} and {_short(key_b)!r} {tuple(b.shape)} "
                               "are not a LoRA pair (A: rank x in, B: out x rank)")
        for t in (a, b):
            if not mx.issubdtype(t.dtype, mx.floating):
                raise MlxdiffError(f"{path}: {_short(key_a)!r} is {t.dtype}; LoRA tensors are floating point")
        rank = a.shape[0]
        s = scale * _alpha(path, slot, config, module, rank)
        parts = targets[0][2]
        if b.shape[0] % parts:
            raise MlxdiffError(f"{path}: {_short(key_b)!r} has {b.shape[0]} rows; its layer {_short(module)!r} is "
                               f"{parts} layers here, which it cannot be split into")
        pieces = split_rows(b, parts) if parts > 1 else [b]
        for (target, i, _, transform) in targets:
            layer = layers.modules[target]
            dims = linear_dims(layer)
            if dims is None:
                raise MlxdiffError(f"{path}: {_short(key_a)!r}: layer {target!r} is a {type(layer).__name__}, not a "
                                   "linear layer; mlxdiff applies LoRAs to linear layers only")
            piece = transform(pieces[i]) if transform else pieces[i]
            if a.shape[1] != dims[0] or piece.shape[0] != dims[1]:
                raise MlxdiffError(
                    f"{path}: {_short(key_a)!r}: shapes A {tuple(a.shape)}, B {tuple(b.shape)} do not fit layer "
                    f"{target!r} ({dims[0]} in, {dims[1] * parts} out); the LoRA is for another model size")
            out.append((target, a, piece, s))
    return out


def lora_nbytes(path) -> int:
    """Bytes of a LoRA file's tensors (its header; nothing is read)."""
    from .formats import tensor_nbytes
    return sum(tensor_nbytes(path).values())


def check(spec, path, scale=1.0):
    """Refuse a LoRA whose part for the component `spec` describes does not fit it, before any weight is read: its
    layers and shapes against a lazily built (never evaluated) model of the spec's config."""
    if spec.name == "transformer" and spec.arch.__name__ not in MODEL_NAMES:
        raise MlxdiffError(f"{path}: LoRAs apply to SD3.5 and FLUX.2 transformers, not {spec.arch.__name__}")
    plan(spec.arch.Model(spec.args), spec.arch, path, scale, spec.name)


def _cast(array, compute_dtype):
    """A LoRA tensor in a dtype that cannot promote the activations (as loading/build.keep_activations_in)."""
    promoted = (mx.zeros((), array.dtype) + mx.zeros((), compute_dtype)).dtype
    return array if promoted == compute_dtype else array.astype(compute_dtype)


def apply_loras(model, arch, loras, compute_dtype=None, component="transformer") -> nn.Module:
    """Add the `component` part of every (file, scale) of `loras` to `model` in place (LoRALinear around each layer
    a LoRA reaches; several on one layer stack) and evaluate the LoRA tensors (the base stays as it is, lazy or
    not)."""
    dtype = compute_dtype or getattr(model, "compute_dtype", mx.float32)
    arrays = []
    for path, scale in loras:
        planned = plan(model, arch, path, scale, component)
        cast = {}
        modules = dict(model.named_modules())
        wrapped = {}
        for target, a, b, s in planned:
            a = cast.setdefault(id(a), _cast(a, dtype))     # a fused layer's A is one array for its parts
            b = _cast(b, dtype)
            arrays += [a, b]
            layer = wrapped.get(target, modules[target])
            if isinstance(layer, LoRALinear):
                layer.add(a, b, s)
            else:
                layer = wrapped[target] = LoRALinear(layer, [(a, b, s)])
        for target, layer in wrapped.items():
            _put(model, target, layer)
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
