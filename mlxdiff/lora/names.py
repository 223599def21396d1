"""How a LoRA file's tensor names reach mlxdiff's layers: the roles and prefixes of every naming, the
architectures that layer names tell (ARCHITECTURES: the LoRA denoisers' own rows), the file's entries per layer, and
the model's own original-name rules (_Layers)."""

import re

from ..errors import MlxdiffError
from ..models import unet
from ..models.registry import LORA_DENOISERS
from .files import _short
from .lycoris import LYCORIS_FACTORS, _lycoris, _tucker_locon


# tensor name ending -> role ("A": down / input side, "B": up / output side, "alpha")
ROLES = (
    (".lora_A.weight", "A"), (".lora_B.weight", "B"),
    (".lora_down.weight", "A"), (".lora_up.weight", "B"),
    (".lora.down.weight", "A"), (".lora.up.weight", "B"),                   # diffusers' older attn-processor names
    (".lora_linear_layer.down.weight", "A"), (".lora_linear_layer.up.weight", "B"),
    (".alpha", "alpha"),
    (".lora_magnitude_vector.weight", "m"), (".lora_magnitude_vector", "m"),   # PEFT's DoRA (use_dora=True)
    (".lora_mid.weight", "mid"),                # LyCORIS's LoCon in Tucker form (lycoris.py _tucker_locon)
)
# XLabs' FLUX.1 LoRAs: <block>.processor.{qkv,proj}_lora[12].{down,up}.weight, no alpha (scale 1); read only on
# such module names, the endings being too common otherwise
XLABS_ROLES = ((".down.weight", "A"), (".up.weight", "B"))
# LyCORIS's LoHa / LoKr factors (also PEFT's LoHaConfig / LoKrConfig names) and kohya/LyCORIS's DoRA magnitude;
LYCORIS_ROLES = tuple((f".{f}{w}", f) for f in LYCORIS_FACTORS for w in (".weight", "")) + \
    ((".dora_scale.weight", "dora"), (".dora_scale", "dora"))
XLABS_MODULE = re.compile(r".*\.processor\.(qkv|proj)_lora[12]?$")
# what a tensor name says the file is when it is not a plain LoRA
NOT_LORA = (
    # (LyCORIS lists lokr_t1 among LoKr's names but never makes one; nor does ComfyUI read it)
    (re.compile(r".*\.lokr_t1(\.weight)?$"), "a LyCORIS LoKr with a Tucker core on its first factor (lokr_t1)"),
    (re.compile(r".*\.lycoris_.*|^lycoris_.*"), "a LyCORIS (lycoris_ names)"),
    (re.compile(r".*\.(lora_[AB]|lora_up|lora_down)\.bias$"), "a LoRA with bias terms"),
    (re.compile(r".*\.diff(_b)?$"), "a full weight difference"),
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
# the denoiser architectures LoRAs apply to (models/protocol.LoRADenoiser): LORA_DENOISERS, found by the registry
# (models/registry.py) and ordered by each module's LORA_ORDER, is the order their layer-name rows
# (LORA_ARCHITECTURE_PATTERNS: the names only some architectures have, searched in each name) are tried, the first
# that matches saying which (why each module sits where it does: beside its LORA_ORDER). Each says so on its module:
# LORA_NAME (what messages call it), LORA_ARCHITECTURE (its label in ARCHITECTURES), LORA_ORDER,
# LORA_ARCHITECTURE_PATTERNS, lora_original_rules(args) (its original-name table) and, optionally, LORA_UNMAPPED (a
# pattern of original names its table cannot map, and why).
ARCHITECTURES = tuple(row for arch in LORA_DENOISERS for row in arch.LORA_ARCHITECTURE_PATTERNS)
# a UNet's block names (its own row): a "transformer" part named so is the "unet" component (_entries)
UNET_LAYERS = unet.LORA_ARCHITECTURE_PATTERNS[0][0]


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
                                   "(lora_A/lora_B or lora_down/lora_up), LyCORIS's LoCon, LoHa and LoKr (Tucker "
                                   "forms too) and DoRA only")
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
        if "mid" in slot:
            if any(role in slot for role in LYCORIS_FACTORS) or "A" not in slot or "B" not in slot:
                raise MlxdiffError(f"{path}: {_short(slot['mid'][0])!r}: a LoCon's Tucker core needs its layer's "
                                   "lora_down and lora_up (and no LoHa / LoKr factors); the file is incomplete")
            _tucker_locon(path, slot)
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
