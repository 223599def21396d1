"""PEFT's LoraConfig as diffusers writes it (the lora_adapter_metadata header entry): its fields checked, its
patterns compiled in bounded time and matched as PEFT matches them, and the layers it names against those the
tensors reach."""

import math
import re
from re import _parser

from ..errors import MlxdiffError
from ..formats.quantized import linear_dims
from ..formats.safetensors import _short as short, parse_json
from .files import _short
from .layers import LoRALinear, conv_dims


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
