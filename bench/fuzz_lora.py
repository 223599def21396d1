"""LoRA mutants for bench/fuzz_readers.py (`--format lora`; issue 30).

    python bench/fuzz_readers.py --format lora --n 10000 --seed 1

The base file is a valid diffusers/PEFT LoRA for the embedded default model's transformer (weights/klein-shapes, a
FLUX.2 klein): every attention, MLP and fused projection of its blocks at rank 4, float32, PEFT's LoraConfig in the
header's lora_adapter_metadata as diffusers' save_lora_weights writes it (tests/lora_helpers.py). A mutant is,
with probability 0.35, first the whole file in another naming both readers read (kohya's lora_unet_ names with
.alpha tensors, ai-toolkit's BFL names, PEFT's base_model.model., diffusion_model. with diffusers names; the
metadata usually dropped), then 1 to 3 structure-aware edits: keys (a layer renamed: to an unknown or another
layer, a non-linear module, another prefix, other role names; a layer duplicated under another naming; halves,
alphas, layers dropped; non-LoRA tensors added), shapes (ranks that disagree, transposed, wrong in / out, 1-D,
3-D, empty, a consistent other rank, rank 0), dtypes (float16, bfloat16, float8, float64, integers, bool),
metadata (a PEFT field retyped, set to another or absurd value, or dropped; the JSON broken, emptied, stripped of
its prefix, duplicated, nested), alphas (where the naming keeps them: .alpha tensors' values, shapes and dtypes,
or the metadata's lora_alpha) and values (NaN, inf, huge numbers in one place).

Not generated: forms mlxdiff reads beyond what diffusers' FLUX.2 loader reads (bare names, kohya names in
diffusers' layer names, .alpha tensors beside lora_A / lora_B names, BFL names under transformer.): diffusers
refuses or drops those, so it is no reference for them (tests/test_lora.py checks them against diffusers' forms);
and unknown PEFT fields, which an older PEFT refuses and mlxdiff ignores (a newer PEFT writes fields of its own).

Ours: what a pipeline does with `--lora FILE` (lora.components, lora.check, lora.apply_loras on the transformer),
the weight change scale x B @ A of every layer read back. The reference: diffusers' own loading
(Flux2KleinPipeline.load_lora_weights, its conversions and PEFT) of the same file on the diffusers twin of the
transformer, the same weight changes read off its PEFT layers. Outcome classes, as fuzz_readers': `refused
(reference refuses too)`, `refused (reference accepts)` (a check diffusers does not make, listed),
`refused (reference hangs or crashes)` (diffusers' kohya converter loops forever on alpha <= 0), `loaded =
reference` (every layer's change within 2 x rank ulps of the coarsest float stored: diffusers scales kohya factors
in their own dtype); not acceptable: `WRONG: loaded non-finite values`, `WRONG: loaded, the reference refuses`,
`WRONG: loaded, the reference hangs or crashes`, `WRONG: differs from the reference`, `exception`, `unclean error`,
`hang`, `crash`.
"""

import json
import random
import struct
from pathlib import Path

import numpy as np

import lora_helpers as H
from mlxdiff.errors import MlxdiffError
import mlxdiff.lora  # noqa: F401  (imported once, before the children fork)
import mlxdiff.models.flux2  # noqa: F401


def safetensors_bytes(tensors, metadata) -> bytes:
    """tensors: [(name, dtype, shape, bytes)], laid out in order (any dtype string: the readers decide)."""
    header, pos, data = {"__metadata__": metadata}, 0, []
    for name, dtype, shape, raw in tensors:
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [pos, pos + len(raw)]}
        pos += len(raw)
        data.append(raw)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + b"".join(data)


LORA_FLOATS = {"F32": "<f4", "F16": "<f2", "F64": "<f8"}
LORA_INTS = {"I8": "<i1", "I16": "<i2", "I32": "<i4", "I64": "<i8", "U8": "<u1", "U16": "<u2"}
# the fuzzer's own table of LoRA tensor name endings (not the reader's: it is what is under test)
LORA_ENDINGS = {"peft": (".lora_A.weight", ".lora_B.weight"), "kohya": (".lora_down.weight", ".lora_up.weight")}


class LoraCase:
    """What a LoRA mutant is made of: {name: (safetensors dtype, values)}, the header's __metadata__ and the PEFT
    config it packs (None once it no longer does), and the naming ("peft", "kohya", "bfl", "base_model")."""

    def __init__(self, tensors, metadata, config, naming):
        self.tensors, self.metadata, self.config, self.naming = tensors, metadata, config, naming

    def copy(self):
        return LoraCase({k: (d, np.array(v)) for k, (d, v) in self.tensors.items()}, dict(self.metadata),
                        json.loads(json.dumps(self.config)) if self.config is not None else None, self.naming)

    def groups(self):
        """{layer name prefix: {"A"|"B"|"alpha": tensor name}} (the fuzzer's own parse of the names)."""
        out = {}
        for name in self.tensors:
            for role, ending in (("A", ".lora_A.weight"), ("B", ".lora_B.weight"), ("A", ".lora_down.weight"),
                                 ("B", ".lora_up.weight"), ("alpha", ".alpha")):
                if name.endswith(ending):
                    out.setdefault(name[:-len(ending)], {})[role] = name
                    break
            else:
                out.setdefault(name, {})["other"] = name
        return out

    def pack(self):
        if self.config is not None:
            self.metadata["lora_adapter_metadata"] = H.packed(self.config)

    def to_bytes(self):
        import torch
        self.pack()
        out = []
        for name, (dtype, v) in self.tensors.items():
            v = np.asarray(v)
            if dtype in LORA_FLOATS:
                raw = v.astype(LORA_FLOATS[dtype]).tobytes()
            elif dtype == "BF16":
                raw = (np.asarray(v, np.float32).view(np.uint32) >> 16).astype("<u2").tobytes()
            elif dtype in ("F8_E4M3", "F8_E8M0"):
                kind = torch.float8_e4m3fn if dtype == "F8_E4M3" else torch.float8_e8m0fnu
                raw = torch.from_numpy(np.asarray(v, np.float32)).to(kind).view(torch.uint8).numpy().tobytes()
            elif dtype == "BOOL":
                raw = (v > 0).astype(np.uint8).tobytes()
            else:
                with np.errstate(all="ignore"):   # NaN / inf become some integer: what a cast writes
                    raw = np.clip(np.nan_to_num(np.round(v * 10)), -100, 100).astype(LORA_INTS[dtype]).tobytes()
            out.append((name, dtype, list(v.shape), raw))
        return safetensors_bytes(out, self.metadata)


def lora_context():
    """The diffusers twin of the default model's transformer (torch, one thread: children are forked) and the
    base LoRA: every attention, MLP and fused projection of its blocks at rank 4 (a fused qkv's three parts share
    their A, so that it has a kohya and a BFL form), float32, PEFT's LoraConfig in the header as diffusers'
    save_lora_weights packs it."""
    import torch
    torch.set_num_threads(1)
    cfg = H.shapes_config()
    model = H.twin(cfg)
    shapes = H.linear_shapes(model)
    layers = H.targeted(shapes)
    modules = [n for n, _ in model.named_modules() if n]
    tensors = H.shared_a(H.peft_tensors(shapes, layers, seed=20261230))
    config = {k: sorted(v) if isinstance(v, set) else v for k, v in H.peft_config().items()}
    config["peft_type"] = "LORA"
    base = LoraCase({k: ("F32", v) for k, v in tensors.items()}, {"format": "pt"}, config, "peft")
    return {"cfg": cfg, "model": model, "shapes": shapes, "layers": layers, "modules": modules, "base": base}


def _convert(case, rng):
    """The whole file in another naming both readers read: kohya (alpha in .alpha tensors), ai-toolkit's BFL names,
    PEFT's base_model.model. prefix or ai-toolkit's diffusion_model. with diffusers names; the metadata usually
    dropped (those tools write none)."""
    peft = {k: v for k, (_, v) in case.tensors.items()}
    to = rng.choice(list(NAMINGS))
    keep = rng.random() < 0.25
    scale = (case.config["lora_alpha"] / case.config["r"]) if case.config else 1.0
    layers = [k[len("transformer."):-len(".lora_A.weight")] for k in peft if k.endswith(".lora_A.weight")]
    if to == "kohya":
        out = H.to_kohya(peft, rng.choice([4.0, 8.0, 1.5, 16.0]))
    elif to == "bfl":
        out = H.to_bfl(peft, None if keep else {layer: scale for layer in layers})
    else:
        prefix = "base_model.model." if to == "base_model" else "diffusion_model."
        out = {prefix + k[len("transformer."):]: v for k, v in peft.items()}
        if not keep:
            out = {k: v * scale if ".lora_B." in k else v for k, v in out.items()}
    case.tensors = {k: ("F32", np.asarray(v, np.float32)) for k, v in out.items()}
    case.naming = "peft" if to in ("base_model", "diffusion_model") else to
    if not keep:
        case.config = None
        case.metadata.pop("lora_adapter_metadata", None)
    return f"[converted to {to}] converted to {to} names{' (metadata kept)' if keep else ''}"


def _layer(case, rng, need=("A",)):
    groups = {k: g for k, g in case.groups().items() if all(r in g for r in need)}
    if not groups:
        return None, None
    name = rng.choice(sorted(groups))
    return name, groups[name]


def _rename(case, rng, ctx):
    groups = case.groups()
    if len(groups) < 2:   # (renaming the only layer would make a whole file in another naming)
        return _drop(case, rng, ctx)
    name, group = _layer(case, rng)
    if name is None:
        return "nothing to rename"
    if case.naming == "kohya":
        choices = ["lora_unet_double_blocks_7_img_attn_qkv", "lora_unet_final_layer_linear", "lora_unet_img_in",
                   "lora_unet_single_blocks_5_linear2", "lora_unet_double_blocks_0_img_norm",
                   "lora_te1_" + name[len("lora_unet_"):], "lora_unet_" + name[len("lora_unet_"):].upper(),
                   name.replace("lora_unet_", "lora_unet."), name + "_x"]
    else:
        head = next((p for p in ("transformer.", "diffusion_model.", "base_model.model.") if name.startswith(p)), "")
        choices = [head + "transformer_blocks.7.attn.to_q", head + "proj_out", head + "x_embedder",
                   head + "norm_out.linear", head + "single_transformer_blocks.4.attn.to_out",
                   head + "transformer_blocks.0.norm1", head + "norm_out", head + "transformer_blocks.0.attn",
                   "transformers." + name[len(head):], "model." + name[len(head):], "unet." + name[len(head):],
                   "lora_unet_" + name[len(head):], name + ".x", name.upper()]
    new = rng.choice(choices)
    roles = rng.random() < 0.2   # or the role names themselves
    for role, key in list(group.items()):
        ending = key[len(name):]
        if roles and role in ("A", "B"):
            ending = rng.choice({"A": [".lora_a.weight", ".lora_A.weights", ".lora_A", ".lora_down.weight",
                                       ".lora_A.bias", ".lora.down.weight"],
                                 "B": [".lora_b.weight", ".lora_B", ".lora_up.weight", ".lora_B.bias"]}[role])
            new_name = name + ending
        else:
            new_name = new + ending
        case.tensors[new_name] = case.tensors.pop(key)
    return f"{name} renamed ({'roles' if roles else new})"


def _duplicate(case, rng, ctx):
    """A layer added again under another naming: kohya's, BFL's, a bare or a base_model.model. name."""
    if case.naming != "peft":
        name, group = _layer(case, rng, ("A", "B"))
        if name is None:
            return "nothing to duplicate"
        other = "transformer." + rng.choice(ctx["layers"])
        case.tensors[other + ".lora_A.weight"] = case.tensors[group["A"]]
        case.tensors[other + ".lora_B.weight"] = case.tensors[group["B"]]
        return f"{name} beside diffusers' {other}"
    peft = {k: v for k, (_, v) in case.tensors.items() if k.startswith("transformer.")}
    try:
        bfl = H.bfl_layers(peft)
    except (AssertionError, KeyError, ValueError):
        bfl = {}
    form = rng.choice(["kohya", "bfl", "bare", "base_model"] if bfl else ["bare", "base_model"])
    if form in ("kohya", "bfl"):
        layer = rng.choice(sorted(bfl))
        a, b = bfl[layer]
        if form == "kohya":
            k = "lora_unet_" + layer.replace(".", "_")
            case.tensors.update({f"{k}.lora_down.weight": ("F32", a), f"{k}.lora_up.weight": ("F32", b),
                                 f"{k}.alpha": ("F32", np.array(4.0, np.float32))})
        else:
            case.tensors.update({f"diffusion_model.{layer}.lora_A.weight": ("F32", a),
                                 f"diffusion_model.{layer}.lora_B.weight": ("F32", b)})
        return f"{layer} also in {form} names"
    name, group = _layer(case, rng, ("A", "B"))
    if name is None:
        return "nothing to duplicate"
    new = ("" if form == "bare" else "base_model.model.") + name[len("transformer."):]
    for role in ("A", "B"):
        case.tensors[new + group[role][len(name):]] = case.tensors[group[role]]
    return f"{name} also as {new}"


def _drop(case, rng, ctx):
    groups = case.groups()
    name, group = _layer(case, rng, ())
    if name is None:
        return "nothing to drop"
    what = rng.choice(["A", "B", "alpha", "layer", "all but one"])
    if what == "all but one":
        for other, g in groups.items():
            if other != name:
                for key in g.values():
                    case.tensors.pop(key)
        return f"all but {name} dropped"
    if what == "layer":
        for key in group.values():
            case.tensors.pop(key)
        return f"{name} dropped"
    if what in group:
        case.tensors.pop(group[what])
        return f"{name} without its {what}"
    return f"{name} kept (no {what})"


def _extra(case, rng, ctx):
    name, group = _layer(case, rng, ("B",))
    if name is None:
        return "no layer"
    rows = case.tensors[group["B"]][1].shape[0] if case.tensors[group["B"]][1].ndim else 4
    key = rng.choice([f"{name}.lora_magnitude_vector", f"{name}.dora_scale", f"{name}.lora_B.bias",
                      f"{name}.lokr_w1", f"{name}.diff", "transformer.proj_out.weight", f"{name}.weight"])
    case.tensors[key] = ("F32", np.ones(rows, np.float32))
    return f"added {key}"


def _shape(case, rng, ctx):
    name, group = _layer(case, rng, ("A", "B"))
    if name is None:
        return "no layer"
    role = rng.choice(["A", "B"])
    key = group[role]
    dtype, v = case.tensors[key]
    a, b = case.tensors[group["A"]][1], case.tensors[group["B"]][1]
    op = rng.choice(["rank+1", "rank-1", "transposed", "in-1", "out+1", "out*2", "1-D", "3-D", "empty",
                     "both rank", "both rank", "zero rank"])
    if op == "both rank":   # consistent: both factors of another rank
        r = rng.choice([1, 2, 3, 8])
        rs = np.random.default_rng(rng.randrange(1 << 30))
        case.tensors[group["A"]] = ("F32", (rs.standard_normal((r, a.shape[1])) * 0.1).astype(np.float32))
        case.tensors[group["B"]] = ("F32", (rs.standard_normal((b.shape[0], r)) * 0.1).astype(np.float32))
        return f"{name}: rank {r}"
    if op == "zero rank":
        case.tensors[group["A"]] = ("F32", np.zeros((0, a.shape[1]), np.float32))
        case.tensors[group["B"]] = ("F32", np.zeros((b.shape[0], 0), np.float32))
        return f"{name}: rank 0"
    if v.ndim != 2:
        return f"{name}: {key} not 2-D"
    axis = 0 if role == "A" else 1
    if op == "rank+1":
        v = np.concatenate([v, np.take(v, [0], axis=axis)], axis=axis)
    elif op == "rank-1":
        v = np.delete(v, 0, axis=axis)
    elif op == "transposed":
        v = v.T
    elif op == "in-1":
        v = v[:, :-1] if role == "A" else v
    elif op == "out+1":
        v = np.concatenate([v, v[:1]], axis=0) if role == "B" else v
    elif op == "out*2":
        v = np.concatenate([v, v], axis=0) if role == "B" else v
    elif op == "1-D":
        v = v.reshape(-1)
    elif op == "3-D":
        v = v[None]
    else:
        v = v[:0]
    case.tensors[key] = (dtype, v)
    return f"{key}: {op}"


def _dtype(case, rng, ctx):
    keys = [k for k in case.tensors if not k.endswith(".alpha")]
    if not keys:
        return "no tensors"
    chosen = keys if rng.random() < 0.2 else [rng.choice(keys)]
    dtype = rng.choice(["F16", "F16", "BF16", "BF16", "F8_E4M3", "F8_E8M0", "F64", "I32", "I64", "U8", "I8",
                        "BOOL", "I16"])
    for key in chosen:
        case.tensors[key] = (dtype, case.tensors[key][1])
    return f"{len(chosen)} tensor(s) as {dtype}"


FIELD_VALUES = {
    "r": [8, 2, "4", 4.0, True, 0, -4, None, [4], 10 ** 30],
    "lora_alpha": [16, -8, 0, 2.5, float("nan"), float("inf"), 1e30, 1e300, "8", True, None, [8]],
    "use_rslora": [True, "yes", 1, None, "false"],
    "use_dora": [True, "no", None],
    "target_modules": ["all-linear", [], [5], 5, None, r".*to_q", "(a+)+$", "to_q", "[", "DROP", "ADD", "ADDNL"],
    "alpha_pattern": [{"to_q": 16}, {"to_q": "16"}, {"transformer_blocks\\.0\\..*": 2}, [["to_q", 4]],
                      {"(": 1}, {"to_q": float("nan")}, {"(t+)+q": 4}, {"to_k": True}, {"ff.linear_in": 1e36}],
    "rank_pattern": [{"to_q": 2}, {"to_q": 4}, {"to_q": "4"}, {"single_transformer_blocks\\.0\\..*": 8}, [1]],
    "init_lora_weights": ["gaussian", "pissa", "olora", "loftq", "bogus", 5, None, True],
    "lora_dropout": [0.5, "x", 2, -1, None],
    "bias": ["all", "lora_only", "bogus", None],
    "layers_to_transform": [[0], 0, []],
    "layers_pattern": ["transformer_blocks", ["x"]],
    "modules_to_save": [["proj_out"], "proj_out"],
    "exclude_modules": [["to_q"], "proj_out", 5, [None]],
    "fan_in_fan_out": [True, "x"],
    "lora_bias": [True, "x"],
    "peft_type": ["LOHA", 5],
}


def _metadata(case, rng, ctx):
    """PEFT's config edited (a field's type or value, a field dropped), or the metadata text itself broken."""
    if case.config is not None and rng.random() < 0.7:
        field = rng.choice(sorted(FIELD_VALUES))
        if rng.random() < 0.15:
            case.config.pop(field, None)
            return f"metadata without {field}"
        value = rng.choice(FIELD_VALUES[field])
        if value in ("DROP", "ADD", "ADDNL"):   # target_modules one short, one layer beyond, or a non-linear one
            targets = list(case.config["target_modules"])
            value = (targets[1:] if value == "DROP" else targets + ["proj_out"] if value == "ADD"
                     else targets + ["norm_out"])
        case.config[field] = value
        return f"metadata {field} = {str(value)[:40]}"
    text = case.metadata.get("lora_adapter_metadata") or H.packed(H.peft_config())
    op = rng.randrange(11)
    case.config = None
    if op == 0:
        case.metadata.pop("lora_adapter_metadata", None)
        return "metadata dropped"
    new, what = [("", "empty"), ("{}", "{}"), ("[4, 8]", "a list"), ("null", "null"), ("5", "a number"),
                 (text[:rng.randrange(len(text))], "truncated"),
                 (text.replace('"transformer.', '"'), "prefix stripped"),
                 (text.replace('"transformer.', '"text_encoder.'), "another component's"),
                 ('{"transformer.r": 4, ' + text.lstrip()[1:], "a duplicate key"),
                 ("[" * 5000 + "]" * 5000, "nested 5000 deep")][op - 1]
    case.metadata["lora_adapter_metadata"] = new
    return f"metadata {what}"


def _alpha(case, rng, ctx):
    """The alpha where this naming keeps it: .alpha tensors (kohya) or the metadata's lora_alpha."""
    if case.naming != "kohya":
        if case.config is None:
            return "no alpha to change"
        case.config["lora_alpha"] = rng.choice(FIELD_VALUES["lora_alpha"])
        return f"lora_alpha = {case.config['lora_alpha']}"
    name, group = _layer(case, rng, ("alpha",))
    if name is None:
        return "no .alpha"
    key = group["alpha"]
    op = rng.randrange(3)
    if op == 0:
        value = rng.choice([np.nan, np.inf, -np.inf, 0.0, -4.0, 1e30, 1e38, 3e38, 2.0, 1e-30])
        case.tensors[key] = (case.tensors[key][0], np.array(value, np.float32))
        return f"{key} = {value}"
    if op == 1:
        shape = rng.choice([(2,), (1,), (1, 1), (0,), (4, 4)])
        case.tensors[key] = (case.tensors[key][0], np.full(shape, 4.0, np.float32))
        return f"{key} shape {shape}"
    dtype = rng.choice(["BOOL", "I32", "I64", "U8", "F16", "BF16", "F8_E4M3", "F64"])
    case.tensors[key] = (dtype, case.tensors[key][1])
    return f"{key} as {dtype}"


def _values(case, rng, ctx):
    keys = [k for k, (_, v) in case.tensors.items() if np.asarray(v).size and not k.endswith(".alpha")]
    if not keys:
        return "no values"
    key = rng.choice(keys)
    dtype, v = case.tensors[key]
    v = np.array(v, np.float32)
    value = rng.choice([np.nan, np.inf, -np.inf, np.nan, 1e30, 1e38, -3e38, 7e4])
    v.reshape(-1)[rng.randrange(v.size)] = value
    case.tensors[key] = (dtype, v)
    return f"{key}: {value} at one place"


LORA_OPERATORS = [(_rename, 12), (_duplicate, 10), (_drop, 10), (_extra, 4), (_shape, 12), (_dtype, 10),
                  (_metadata, 20), (_alpha, 10), (_values, 12)]
NAMINGS = ("kohya", "bfl", "base_model", "diffusion_model")
# the kinds of mutation, each tagged "[kind]" in a mutant's description (fuzz_readers.run_mutants counts them): the
# whole-file conversions by naming, then the operators by name
KINDS = (*(f"converted to {to}" for to in NAMINGS), *(op.__name__.strip("_") for op, _ in LORA_OPERATORS))


def mutate_lora(ctx, rng):
    """(LoraCase, description): maybe a whole-file conversion first, then one to three of the operators."""
    case = ctx["base"].copy()
    steps = []
    if rng.random() < 0.35:
        steps.append(_convert(case, rng))
    ops, weights = zip(*LORA_OPERATORS)
    for _ in range(rng.choices([1, 2, 3], [0.75, 0.18, 0.07])[0]):
        op = rng.choices(ops, weights)[0]
        steps.append(f"[{op.__name__.strip('_')}] {op(case, rng, ctx)}")
    return case, "; ".join(steps)


def _nonfinite_tensor(path):
    """The first floating tensor of the file holding NaN or inf, as torch reads it (None if none)."""
    import torch
    from safetensors.torch import load_file
    for name, t in load_file(str(path)).items():
        if t.is_floating_point() and not bool(torch.isfinite(t.float()).all()):
            return name
    return None


def _factor_tolerance(path):
    """The relative tolerance on a weight change: diffusers' kohya conversion scales the factors by alpha / rank
    in their stored dtype (mlxdiff in float32), so 2 x rank ulps of the coarsest float type stored."""
    import torch
    from safetensors.torch import load_file
    eps = max([torch.finfo(t.dtype).eps for t in load_file(str(path)).values() if t.is_floating_point()] or [0])
    return max(1e-5, 2 * H.RANK * eps)


def classify(path, ctx, report):
    """mlxdiff's reading (as a pipeline's load_lora checks and applies it), then diffusers' on the twin."""
    try:
        ours = H.ours_delta(path, ctx["cfg"])
    except MlxdiffError as e:
        message = str(e)
        if "\n" in message or str(path) not in message:
            return "unclean error", message[:300]
        report({"class": "refused (reference hangs or crashes)", "detail": message[:600]})
        try:
            H.diffusers_delta(path, ctx["model"])
        except Exception:
            return "refused (reference refuses too)", message[:600]
        return "refused (reference accepts)", message[:600]
    bad = _nonfinite_tensor(path)
    if bad is not None or not all(np.isfinite(d).all() for d in ours.values()):
        return "WRONG: loaded non-finite values", f"tensor {bad!r}" if bad else "a non-finite weight change"
    report({"class": "WRONG: loaded, the reference hangs or crashes", "detail": ""})
    try:
        ref = H.diffusers_delta(path, ctx["model"])
    except Exception as e:
        return "WRONG: loaded, the reference refuses", f"{type(e).__name__}: {str(e)[:200]}"
    diff = H.same_delta(ours, ref, _factor_tolerance(path))
    return ("WRONG: differs from the reference", diff) if diff else ("loaded = reference", "")


def mutant(ctx, seed, i):
    return mutate_lora(ctx, random.Random(f"lora-{seed}-{i}"))


def fuzz(n, seed, workdir, keep, only, run_one, run_mutants) -> dict:
    """`run_one(path, ctx)`: fuzz_readers' forked classification; `run_mutants`: its loop over the mutants."""
    workdir = Path(workdir)
    ctx = lora_context()
    base_path = workdir / "base.safetensors"
    base_path.write_bytes(ctx["base"].to_bytes())
    check = run_one(base_path, ctx)
    if check["class"] != "loaded = reference":
        raise SystemExit(f"the base LoRA does not read as the reference: {check}")
    def write_case(i):
        case, what = mutant(ctx, seed, i)
        path = workdir / f"mutant-{i}.safetensors"
        path.write_bytes(case.to_bytes())
        return path, what

    return run_mutants("lora", n, seed, only, keep, write_case, lambda path: run_one(path, ctx), KINDS)
