"""Config values checked once, where a config is read, against the model's dataclass: nothing is built from an
unchecked value.

Every ModelArgs derives from CheckedArgs, whose `from_dict(params, where)` checks before it builds:
- types, from the dataclass field annotations: `bool` is a JSON true/false (never "no" or 0), `int` a JSON integer
  (not a string, a float or a bool), `float` a finite number, `tuple[int, ...]` a list of integers, `X | None` also
  null, `dict` an object;
- ranges and choices, from the class's LIMITS table (a Limit per key; for a list, per item, plus its length);
- cross-field rules, from the class's RULES table, on the built dataclass (after __post_init__ filled defaults).
Keys that are not fields are ignored, as before: diffusers and transformers configs carry many keys we do not read.

Every failure is one MlxdiffError line: the file, the key, the value and what is allowed.

The caps below bound every size a config can give, so that no array is allocated from an absurd value; each is well
above the largest released model (noted beside it).
"""

import dataclasses
import json
import math
import types
import typing
from dataclasses import dataclass
from typing import Callable, NamedTuple

from .errors import MlxdiffError

MAX_WIDTH = 1 << 16       # any width, channel count or MLP size (largest: Mistral-Small's MLP, 32768)
MAX_HEAD_DIM = 1024       # attention head size (largest: 256)
MAX_HEADS = 1024          # attention heads (largest: T5-XXL's 64)
MAX_LAYERS = 1024         # blocks of one kind (largest: FLUX.2-dev's 48 single blocks)
MAX_VOCAB = 1 << 20       # vocabulary (largest: Qwen3's 151936)
MAX_POSITIONS = 1 << 24   # position embeddings / context length (largest: Mistral-Small's 131072)
MAX_LEVELS = 8            # VAE resolution levels (real: 4, a factor of 8)
MAX_IMAGE_SIZE = 4096     # default image / tile size in pixels (arguments.MAX_SIZE: the largest size generate takes)
MAX_PROMPT_TOKENS = 512   # prompt length (arguments.MAX_SEQUENCE: T5's and the FLUX.2 encoders' limit)


@dataclass(frozen=True)
class Limit:
    """What a value (or each item of a list) may be: lo..hi (inclusive), above `gt`, one of `choices`; a list's
    length within `items`."""
    lo: float | None = None
    hi: float | None = None
    gt: float | None = None
    choices: tuple | None = None
    items: tuple | None = None     # (fewest, most) list items


def between(lo, hi, items=None) -> Limit:
    return Limit(lo=lo, hi=hi, items=items)


def positive(hi=None) -> Limit:
    return Limit(gt=0, hi=hi)


def one_of(*choices) -> Limit:
    return Limit(choices=tuple(choices))


class Rule(NamedTuple):
    """A cross-field rule: `ok(args)` must hold, else `key`'s value is refused with `allowed(args)`."""
    key: str
    ok: Callable
    allowed: Callable


def show(value) -> str:
    """A config value as JSON writes it (strings quoted, true/false/null), cut short."""
    try:
        text = json.dumps(list(value) if isinstance(value, tuple) else value)
    except (TypeError, ValueError, RecursionError):
        text = repr(value) if not isinstance(value, (list, dict)) else json_type(value)
    return text if len(text) <= 60 else text[:57] + "..."


def json_type(value) -> str:
    return {dict: "an object", list: "a list", tuple: "a list", str: "a string", bool: "a boolean",
            type(None): "null"}.get(type(value), "a number")


# -- types from annotations ---------------------------------------------------------------------------------------

def _options(tp) -> tuple:
    """The alternatives of a union annotation (X | None, Optional[X], Union[A, B]), or (tp,)."""
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        return typing.get_args(tp)
    return (tp,)


def _item_type(tp):
    """The item annotation of tuple[X, ...] / list[X] / List[X]; None for an untyped list."""
    args = [a for a in typing.get_args(tp) if a is not Ellipsis]
    return args[0] if args else None


def _is_list(tp) -> bool:
    return tp in (list, tuple) or typing.get_origin(tp) in (list, tuple)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _finite(value) -> bool:
    try:
        return math.isfinite(value)
    except OverflowError:   # an int past float's range (a 400-digit JSON number)
        return False


def _matches(value, tp) -> bool:
    options = _options(tp)
    if len(options) > 1:
        return any(_matches(value, option) for option in options)
    if tp is type(None):
        return value is None
    if tp is bool:
        return isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if tp is float:
        return _is_number(value) and _finite(value)
    if tp is str:
        return isinstance(value, str)
    if tp is dict or typing.get_origin(tp) is dict:
        return isinstance(value, dict)
    if _is_list(tp):
        item = _item_type(tp)
        return isinstance(value, (list, tuple)) and (item is None or all(_matches(v, item) for v in value))
    return True   # any other annotation: not checked


def _within(value, limit: Limit) -> bool:
    if isinstance(value, (list, tuple)):
        n = len(value)
        if limit.items and not limit.items[0] <= n <= limit.items[1]:
            return False
        return all(_within(v, limit) for v in value)
    if limit.choices is not None and value not in limit.choices:
        return False
    if _is_number(value):
        if (limit.lo is not None and value < limit.lo) or (limit.hi is not None and value > limit.hi):
            return False
        if limit.gt is not None and value <= limit.gt:
            return False
    return True


def _fmt(x) -> str:
    return f"{x:g}" if isinstance(x, float) else str(x)


def _range(limit: Limit | None) -> str:
    if limit is None:
        return ""
    if limit.choices is not None:
        return " (one of " + ", ".join(show(c) for c in limit.choices) + ")"
    parts = []
    if limit.gt is not None:
        parts.append(f"> {_fmt(limit.gt)}")
    if limit.lo is not None and limit.hi is not None:
        parts.append(f"{_fmt(limit.lo)} to {_fmt(limit.hi)}")
    elif limit.lo is not None:
        parts.append(f">= {_fmt(limit.lo)}")
    elif limit.hi is not None:
        parts.append(f"<= {_fmt(limit.hi)}")
    return (" " + ", ".join(parts)) if parts else ""


def _describe(tp, limit: Limit | None, item=False) -> str:
    names = {bool: "true or false", int: "an integer", float: "a finite number", str: "a string", dict: "an object",
             type(None): "null"}
    alternatives = []
    for option in _options(tp):
        if _is_list(option):
            inner = _item_type(option)
            count = ""
            if limit and limit.items:
                lo, hi = limit.items
                count = f"{lo} " if lo == hi else f"{lo} to {hi} "
            alternatives.append(f"a list of {count}" + (_describe(inner, limit, item=True) if inner is not None
                                                        else "items"))
        elif option is type(None) or option is bool or option is dict:
            alternatives.append(names[option])
        else:
            name = names.get(option, getattr(option, "__name__", str(option)))
            if item:
                name = {"an integer": "integers", "a finite number": "numbers", "a string": "strings"}.get(name, name)
            alternatives.append(name + _range(limit))
    return " or ".join(alternatives)


def check_values(values: dict, hints: dict, limits: dict, where, prefix="", required=()) -> None:
    """Each key of `values` that has a type in `hints`: its type, then its LIMITS entry. `required`: keys that must
    be present."""
    for key in required:
        if key not in values:
            raise MlxdiffError(f"{where}: {prefix}{key} is missing; expected {_describe(hints[key], limits.get(key))}")
    for key, value in values.items():
        if key not in hints:
            continue
        tp, limit = hints[key], limits.get(key)
        if not _matches(value, tp) or (limit is not None and value is not None and not _within(value, limit)):
            raise MlxdiffError(f"{where}: {prefix}{key} is {show(value)}; expected {_describe(tp, limit)}")


def check_rules(args, rules, where, prefix="") -> None:
    for rule in rules:
        if not rule.ok(args):
            value = args.get(rule.key) if isinstance(args, dict) else getattr(args, rule.key, None)
            raise MlxdiffError(f"{where}: {prefix}{rule.key} is {show(value)}; {rule.allowed(args)}")


def field_types(cls) -> dict:
    """{field: annotation} of a dataclass's init fields."""
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls) if f.init}


def require_object(value, where, what="config") -> dict:
    if not isinstance(value, dict):
        raise MlxdiffError(f"{where}: the {what} is {json_type(value)}; expected a JSON object of settings "
                           "({\"key\": value, ...})")
    return value


@dataclass
class CheckedArgs:
    """Base of every ModelArgs: `from_dict` checks types, LIMITS and RULES, then builds (see the module doc)."""
    # class attributes, not fields (a dataclass field needs an annotation)
    LIMITS = {}
    RULES = ()
    WHAT = "config"          # what the config is, for messages where no file is known

    @classmethod
    def from_dict(cls, params, where=None):
        where = where or cls.WHAT
        params = require_object(params, where)
        hints = field_types(cls)
        values = {k: v for k, v in params.items() if k in hints}
        check_values(values, hints, cls.LIMITS, where)
        args = cls(**values)
        check_rules(args, cls.RULES, where)
        return args
