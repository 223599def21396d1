"""UNet LoRA mutants for bench/fuzz_readers.py (`--format unet-lora`; issue 45).

    python bench/fuzz_readers.py --format unet-lora --n 3000 --seed 1

The base file is a kohya LoCon for a tiny SD 1.x pipeline (the UNet and CLIP-L twin of
tests/ldm_helpers.sd15_components), as sd-scripts' networks/lora.py saves one: every Linear and Conv2d of the UNet
(`lora_unet_<diffusers module, dots as underscores>`: 3x3 convolutions as 4-D down (rank, in, 3, 3) / up (out,
rank, 1, 1) factors at rank 3, SD 1.x's 1x1-conv projections as 1x1 pairs, linear layers at rank 4) and the text
encoder's attention and MLP layers (`lora_te_text_model_encoder_layers_N_...`), float32, one `.alpha` per layer
(each its own value: the reference reads every one). A mutant is, with probability 0.25, first the whole file in
diffusers' PEFT names (`unet.<module>.lora_A.weight` / `text_encoder.<module>...`, alpha / rank baked into
lora_B, no metadata: alpha = rank), then 1 to 3 edits: names (a layer renamed to an unknown layer, another layer
of other shape, a module that is no Linear / Conv2d, SGM's `input_blocks_N_M` names, another component's prefix,
other role names, upper case), a layer duplicated in the other naming, halves / alphas / layers dropped, non-LoRA
tensors added, shapes (ranks that disagree, transposed, in / out / kernel wrong, 1-D / 2-D / 3-D where the layer
needs another, a consistent other rank, rank 0), dtypes, alphas (values, shapes, dtypes), values (NaN, inf, huge
at one place), and, for one mutant in ten, the file's bytes truncated.

Ours: what a pipeline does with `--lora FILE` (lora.components against the pipeline's unet and text_encoder,
lora.check, lora.apply_loras on mlxdiff's UNet and CLIP), the weight change of every layer read back (convolutions
in PyTorch's (out, in, kh, kw) layout). The reference: diffusers' own loading
(StableDiffusionLoraLoaderMixin.load_lora_weights, its kohya conversion and PEFT) of the same file on the torch
twins, each PEFT layer's B @ A; its scale is the file's own rule: for kohya names the layer's `.alpha` / rank
(sd-scripts' networks/lora.py; alpha = rank without one), not diffusers' (its converter misses the attention
layers' own alphas and gives them the most common one: tests/test_lora_unet.py), for PEFT names PEFT's scaling.
A 1x1 convolution's factors given 2-D (the same numbers; ComfyUI reads them, PEFT's Conv2d LoRA does not) reach
diffusers made 4-D; a PEFT file whose only layers are the text encoder's MLP (diffusers' loader cannot infer its
type from those names) is read by PEFT itself, as that loader would go on to.

Outcome classes, as fuzz_readers': acceptable are `refused (reference refuses too)`, `refused (reference accepts)`
(a check diffusers does not make, listed by reason) and `loaded = reference` (the same layers, every change within
2 x rank ulps of the coarsest float stored); not acceptable: `WRONG: loaded non-finite values`, `WRONG: loaded, the
reference refuses`, `WRONG: differs from the reference` (a silent wrong result: other layers or other numbers),
`exception`, `unclean error` (several lines, or no file name), `hang`, `crash`. The suite runs a seeded share
(tests/test_bad_input_round3_features.py).
"""

import copy
import random
import re
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import numpy as np

import fuzz_lora as L
import mlxdiff  # noqa: F401  (OpenBLAS preload before mlx)
import mlx.core as mx
from mlxdiff.errors import MlxdiffError
from mlxdiff import lora
from mlxdiff.models import clip, unet

RANK, CONV_RANK = 4, 3
FACTOR_ENDINGS = (".lora_down.weight", ".lora_up.weight", ".lora_A.weight", ".lora_B.weight")
# tests/ldm_helpers.sd15_components' UNet and CLIP-L twin (a small vocabulary: no tokens are run)
UNET = dict(sample_size=12, in_channels=4, out_channels=4, block_out_channels=(16, 24), norm_num_groups=8,
            layers_per_block=1, down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
            up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), cross_attention_dim=20, attention_head_dim=4)
CLIP = dict(vocab_size=64, hidden_size=20, intermediate_size=36, projection_dim=20, num_hidden_layers=2,
            num_attention_heads=4, max_position_embeddings=77, hidden_act="quick_gelu", bos_token_id=0,
            eos_token_id=2, pad_token_id=1)
COMPONENTS = {"unet": "lora_unet_", "text_encoder": "lora_te_"}
TE_TARGETS = ("q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2")


def context():
    """The torch twins (one torch thread: children are forked), mlxdiff's configs of the same models, the base
    kohya LoCon and the layer table {(component, module): (kind, out, in, kernel)}."""
    import torch  # (here: a fuzzer of other formats never imports torch into its children)
    from diffusers import UNet2DConditionModel  # (as torch)
    from transformers import CLIPTextConfig, CLIPTextModel  # (as torch)
    import diffusers.loaders.lora_pipeline  # noqa: F401  (imported once here, not in every forked child)
    import peft  # noqa: F401  (as above)
    import safetensors.torch  # noqa: F401  (as above)
    torch.set_num_threads(1)
    torch.manual_seed(0)    # (the base weights are the models' initial ones: a plain LoRA's change does not
    models = {"unet": UNet2DConditionModel(**UNET).eval(),       # depend on them)
              "text_encoder": CLIPTextModel(CLIPTextConfig(**CLIP)).eval()}
    args = {"unet": unet.ModelArgs.from_dict(dict(models["unet"].config)),
            "text_encoder": clip.ModelArgs.from_dict({**models["text_encoder"].config.to_dict(),
                                                      "architectures": ["CLIPTextModel"]})}
    rng = np.random.default_rng(20261207)
    layers, tensors = {}, {}
    for component, prefix in COMPONENTS.items():
        for module, m in models[component].named_modules():
            if component == "text_encoder" and not module.endswith(TE_TARGETS):
                continue
            if isinstance(m, torch.nn.Linear):
                kind, out, in_, kernel = "linear", m.out_features, m.in_features, (1, 1)
            elif isinstance(m, torch.nn.Conv2d):
                kind, out, in_, kernel = "conv", m.out_channels, m.in_channels, tuple(m.kernel_size)
            else:
                continue
            layers[(component, module)] = (kind, out, in_, kernel)
            r = CONV_RANK if kernel != (1, 1) else RANK
            down = (r, in_) if kind == "linear" else (r, in_, *kernel)
            up = (out, r) if kind == "linear" else (out, r, 1, 1)
            name = prefix + _kohya_module(component, module)
            tensors[name + ".lora_down.weight"] = ("F32", (0.1 * rng.standard_normal(down)).astype(np.float32))
            tensors[name + ".lora_up.weight"] = ("F32", (0.1 * rng.standard_normal(up)).astype(np.float32))
            tensors[name + ".alpha"] = ("F32", np.array(rng.choice([1.0, 2.0, 3.0, 4.0, 8.0]), np.float32))
    base = L.LoraCase(tensors, {"format": "pt"}, None, "kohya")
    conv1x1 = {f"{COMPONENTS[c]}{_fold(m)}" for (c, m), (kind, _, _, kernel) in layers.items()
               if kind == "conv" and kernel == (1, 1)}
    return {"models": models, "args": args, "layers": layers, "base": base, "conv1x1": conv1x1}


def _kohya_module(component, module):
    """sd-scripts' name of a module: the text encoder's under transformers 4's `text_model.` level."""
    if component == "text_encoder" and not module.startswith("text_model."):
        module = "text_model." + module
    return module.replace(".", "_")


def _fold(module) -> str:
    """A module path compared across the two sides: dots as underscores, without CLIP's text_model. level."""
    return re.sub(r"^text_model[._]", "", module).replace(".", "_")


# -- mutations ---------------------------------------------------------------------------------------------------

def _to_peft(case, rng, ctx):
    """The whole file in diffusers' PEFT names (what save_lora_weights writes without metadata): alpha / rank baked
    into lora_B, alpha = rank."""
    out = {}
    for (component, module) in ctx["layers"]:
        name = COMPONENTS[component] + _kohya_module(component, module)
        down, up = case.tensors[name + ".lora_down.weight"][1], case.tensors[name + ".lora_up.weight"][1]
        alpha = float(case.tensors[name + ".alpha"][1])
        target = f"{component}.{module}"
        out[target + ".lora_A.weight"] = ("F32", down)
        out[target + ".lora_B.weight"] = ("F32", (up * (alpha / down.shape[0])).astype(np.float32))
    case.tensors, case.naming = out, "peft"
    return "converted to PEFT names"


def _pick(case, rng, need=("A",)):
    groups = {k: g for k, g in case.groups().items() if all(r in g for r in need)}
    if not groups:
        return None, None
    name = rng.choice(sorted(groups))
    return name, groups[name]


def _names(ctx, component, naming):
    """Every layer's name of a component in a naming."""
    return [(COMPONENTS[c] + _kohya_module(c, m)) if naming == "kohya" else f"{c}.{m}"
            for c, m in ctx["layers"] if c == component]


def _rename(case, rng, ctx):
    name, group = _pick(case, rng, ())
    if name is None:
        return "nothing to rename"
    kohya = case.naming == "kohya"
    component = "text_encoder" if name.startswith(("lora_te_", "text_encoder.")) else "unet"
    head = COMPONENTS[component] if kohya else component + "."
    rest = name[len(head):]
    sep = "_" if kohya else "."
    unknown = sep.join(["down", "blocks", "7", "attentions", "0", "proj_in"]) if kohya else \
        "down_blocks.7.attentions.0.proj_in"
    choices = [head + unknown,
               rng.choice(_names(ctx, component, case.naming)),                 # another layer (maybe other shape)
               head + (("down_blocks_0_resnets_0_norm1" if kohya else "down_blocks.0.resnets.0.norm1")
                       if component == "unet" else ("text_model_encoder_layers_0_layer_norm1" if kohya
                                                    else "text_model.encoder.layers.0.layer_norm1")),
               head + ("time_embedding" if component == "unet" else "text_model"),     # a container module
               head + (re.sub(r"down_blocks_0_attentions_0", "input_blocks_1_1", rest) if kohya else rest),
               ("lora_te2_" if kohya else "text_encoder_2.") + rest,
               ("lora_unet_" if component == "text_encoder" else "lora_te_") + rest if kohya else
               ("unet." if component == "text_encoder" else "text_encoder.") + rest,
               (name.replace("lora_unet_", "lora_unet.") if kohya else "unet_" + rest),
               name.upper(), name + sep + "x", "model." + name]
    new = rng.choice(choices)
    roles = rng.random() < 0.15
    for role, key in list(group.items()):
        ending = key[len(name):]
        if roles and role in ("A", "B"):
            ending = rng.choice({"A": [".lora_a.weight", ".lora_down", ".lora_A.weight" if kohya else
                                       ".lora_down.weight", ".lora.down.weight", ".lora_down.bias"],
                                 "B": [".lora_b.weight", ".lora_up", ".lora_B.weight" if kohya else ".lora_up.weight",
                                       ".lora.up.weight"]}[role])
            case.tensors[name + ending] = case.tensors.pop(key)
        else:
            case.tensors[new + ending] = case.tensors.pop(key)
    return f"{name} renamed ({'roles' if roles else new})"


def _duplicate(case, rng, ctx):
    """A layer added again in the other naming (a file with both namings, or one layer twice)."""
    name, group = _pick(case, rng, ("A", "B"))
    if name is None:
        return "nothing to duplicate"
    if case.naming == "kohya":
        component = "text_encoder" if name.startswith("lora_te_") else "unet"
        module = next(m for c, m in ctx["layers"] if c == component and COMPONENTS[c] + _kohya_module(c, m) == name)
        other = f"{component}.{module}"
        endings = (".lora_A.weight", ".lora_B.weight")
    else:
        component, module = name.split(".", 1)
        other = COMPONENTS[component] + _kohya_module(component, module)
        endings = (".lora_down.weight", ".lora_up.weight")
    case.tensors[other + endings[0]] = case.tensors[group["A"]]
    case.tensors[other + endings[1]] = case.tensors[group["B"]]
    return f"{name} also as {other}"


def _shape(case, rng, ctx):
    """The 2-D edits of fuzz_lora, and a convolution's: the kernel, the 1x1 up factor, its rank."""
    name, group = _pick(case, rng, ("A", "B"))
    if name is None:
        return "no layer"
    a, b = case.tensors[group["A"]][1], case.tensors[group["B"]][1]
    if a.ndim != 4 or b.ndim != 4:
        if rng.random() < 0.2 and a.ndim == 2 and b.ndim == 2:   # a linear layer's factors as 1x1 convolutions
            case.tensors[group["A"]] = ("F32", a[:, :, None, None])
            case.tensors[group["B"]] = ("F32", b[:, :, None, None])
            return f"{name}: 1x1-conv factors"
        return L._shape(case, rng, ctx)
    op = rng.choice(["kernel 1x1", "kernel 3x3", "up 3x3", "2-D", "rank+1 down", "both rank", "in+1", "5-D"])
    rs = np.random.default_rng(rng.randrange(1 << 30))
    if op == "kernel 1x1":
        a = a[:, :, :1, :1]
    elif op == "kernel 3x3":
        a = (0.1 * rs.standard_normal((*a.shape[:2], 3, 3))).astype(np.float32)
    elif op == "up 3x3":
        b = np.repeat(np.repeat(b, 3, axis=2), 3, axis=3)
    elif op == "2-D":
        a = a.reshape(a.shape[0], -1)
        b = b.reshape(b.shape[0], -1) if rng.random() < 0.5 else b
    elif op == "rank+1 down":
        a = np.concatenate([a, a[:1]], axis=0)
    elif op == "both rank":
        r = rng.choice([1, 2, 5])
        a = (0.1 * rs.standard_normal((r, *a.shape[1:]))).astype(np.float32)
        b = (0.1 * rs.standard_normal((b.shape[0], r, 1, 1))).astype(np.float32)
    elif op == "in+1":
        a = np.concatenate([a, a[:, :1]], axis=1)
    else:
        a = a[None]
    case.tensors[group["A"]] = ("F32", a)
    case.tensors[group["B"]] = ("F32", b)
    return f"{name}: {op}"


OPERATORS = [(_rename, 14), (_duplicate, 6), (L._drop, 10), (L._extra, 4), (_shape, 16), (L._dtype, 10),
             (L._alpha, 14), (L._values, 10)]


def mutate(ctx, rng):
    """(LoraCase, description, truncate at: a byte count or None)."""
    case = ctx["base"].copy()
    steps = []
    if rng.random() < 0.25:
        steps.append(_to_peft(case, rng, ctx))
    ops, weights = zip(*OPERATORS)
    for _ in range(rng.choices([1, 2, 3], [0.75, 0.18, 0.07])[0]):
        steps.append(rng.choices(ops, weights)[0](case, rng, ctx))
    cut = rng.random() if rng.random() < 0.1 else None
    if cut is not None:
        steps.append(f"truncated at {cut:.3f} of its bytes")
    return case, "; ".join(steps), cut


# -- the two readings ---------------------------------------------------------------------------------------------

def ours_delta(path, ctx) -> dict:
    """{(component, folded module): float64 weight change (PyTorch's layout)} of what mlxdiff adds for the file, as
    Pipeline.load_lora does it: the file's components must be the pipeline's, each checked, then applied."""
    archs = {"unet": unet, "text_encoder": clip}
    for name in lora.components(path):
        if name not in archs:      # what Pipeline.load_lora says for a component SD 1.x does not have
            raise MlxdiffError(f"{path}: has LoRA layers for {name}, which this SD 1.x pipeline does not have")
    out = {}
    for name in lora.components(path):
        lora.check(SimpleNamespace(name=name, arch=archs[name], args=ctx["args"][name]), path)
    for name in lora.components(path):
        model = archs[name].Model(ctx["args"][name])
        lora.apply_loras(model, archs[name], [(path, 1.0)], component=name)
        for module, m in model.named_modules():
            if not isinstance(m, lora.LoRALinear):
                continue
            delta = 0
            for a, b, s in m.adapters():
                a, b = (np.array(t.astype(mx.float32)).astype(np.float64) for t in (a, b))
                d = s * (b @ a.reshape(a.shape[0], -1))
                if a.ndim == 4:    # (out, kh x kw x in) -> (out, in, kh, kw)
                    d = d.reshape(d.shape[0], *a.shape[1:]).transpose(0, 3, 1, 2)
                delta = delta + d
            out[(name, _fold(module))] = delta
    return out


def reference_delta(path, ctx) -> dict:
    """diffusers' loading on the torch twins (changed in place: this runs in a forked child): each PEFT layer's
    B @ A, scaled by the file's own rule (kohya's .alpha / rank, PEFT's scaling); raises what diffusers raises."""
    import torch  # (imported by context() before the fork: these are look-ups)
    from diffusers.loaders.lora_pipeline import StableDiffusionLoraLoaderMixin  # (as torch)
    from safetensors.torch import load_file  # (as torch)

    class Pipeline(StableDiffusionLoraLoaderMixin):   # what load_lora_weights needs of a pipeline: its models
        components = {}
        hf_device_map = None

        def __init__(self, models):
            vars(self).update(models)

    state = load_file(str(path))
    kohya = any(k.startswith(tuple(COMPONENTS.values())) for k in state)
    alphas = {}
    for key, t in state.items():
        if key.endswith(".alpha"):      # kohya's .item(): a float or an integer
            if t.numel() != 1 or t.dtype == torch.bool or not (float(t) > 0 and np.isfinite(float(t))):
                raise ValueError(f"{key}: not one positive number")
            prefix = next((p for p in COMPONENTS.values() if key.startswith(p)), "")
            alphas[(prefix, _fold(key[len(prefix):-len(".alpha")]))] = float(t)
    readable = _as_peft_reads(path, state, ctx)
    try:
        Pipeline(ctx["models"]).load_lora_weights(str(readable), adapter_name="x")
    except ValueError as e:
        # diffusers' text-encoder loader infers a PEFT file's type from its attention layers' names, and fails on
        # a text-encoder part of MLP layers alone: PEFT's own loading, which that loader ends in, is the reference
        if kohya or str(e) != "Could not automatically infer state dict type" or \
                not all(k.startswith("text_encoder.") for k in state):
            raise
        _peft_load(ctx["models"]["text_encoder"], {k[len("text_encoder."):]: v for k, v in state.items()})
    finally:
        if readable != path:
            readable.unlink()
    out = {}
    with torch.no_grad():
        for component, model in ctx["models"].items():
            for module, m in model.named_modules():
                if not (hasattr(m, "lora_A") and "x" in getattr(m, "lora_A", {})):
                    continue
                a = m.lora_A["x"].weight.double().numpy()
                b = m.lora_B["x"].weight.double().numpy()
                if a.ndim == 4:
                    d = np.einsum("or,rikl->oikl", b[:, :, 0, 0], a)
                else:
                    d = b @ a
                if kohya:
                    scale = alphas.get((COMPONENTS[component], _fold(module)), a.shape[0]) / a.shape[0]
                else:
                    scale = m.scaling["x"]
                out[(component, _fold(module))] = scale * d
    return out


def _peft_load(model, state):
    """PEFT's loading of a PEFT state dict (no metadata: alpha = each layer's rank) onto `model`, as diffusers'
    load_lora_into_text_encoder does after its name conversion (transformers 5's CLIP has no text_model. level)."""
    from peft import LoraConfig, inject_adapter_in_model, set_peft_model_state_dict  # (imported by context())
    state = {k.removeprefix("text_model."): v for k, v in state.items()}
    ranks = {k[:-len(".lora_B.weight")]: v.shape[1] for k, v in state.items() if k.endswith(".lora_B.weight")}
    config = LoraConfig(r=next(iter(ranks.values())), lora_alpha=next(iter(ranks.values())),
                        target_modules=sorted(ranks), rank_pattern=ranks, alpha_pattern=ranks)
    inject_adapter_in_model(config, model, adapter_name="x")
    incompatible = set_peft_model_state_dict(model, state, adapter_name="x")
    if getattr(incompatible, "unexpected_keys", None):
        raise ValueError(f"unexpected keys {incompatible.unexpected_keys[:3]}")


def _as_peft_reads(path, state, ctx) -> Path:
    """The file as PEFT can read it: a 1x1 convolution's factors given 2-D (rank x in, out x rank: the same
    numbers, which ComfyUI and mlxdiff read; PEFT's Conv2d LoRA only loads (rank, in, 1, 1) / (out, rank, 1, 1))
    made 4-D, in a copy beside it; the file itself when it has none."""
    from safetensors.torch import save_file  # (imported by context())
    changed = {}
    for key, t in state.items():
        ending = next((e for e in FACTOR_ENDINGS if key.endswith(e)), None)
        if ending and t.ndim == 2 and _fold_layer(key[:-len(ending)]) in ctx["conv1x1"]:
            changed[key] = t[:, :, None, None].contiguous()
    if not changed:
        return path
    copy_path = Path(path).with_suffix(".as-peft.safetensors")
    save_file({**state, **changed}, str(copy_path))
    return copy_path


def _fold_layer(name) -> str:
    """A file's layer name (either naming) -> (component prefix, folded module), as ctx["conv1x1"] holds them."""
    for component, prefix in COMPONENTS.items():
        for head in (prefix, component + "."):
            if name.startswith(head):
                return f"{prefix}{_fold(name[len(head):])}"
    return name


def classify(path, ctx, report):
    """mlxdiff's reading (as a pipeline's load_lora checks and applies it), then diffusers' on the twins."""
    try:
        ours = ours_delta(path, ctx)
    except MlxdiffError as e:
        message = str(e)
        if "\n" in message or str(path) not in message:
            return "unclean error", message[:300]
        report({"class": "refused (reference hangs or crashes)", "detail": message[:600]})
        try:
            reference_delta(path, ctx)
        except Exception:
            return "refused (reference refuses too)", message[:600]
        return "refused (reference accepts)", message[:600]
    bad = L._nonfinite_tensor(path)
    if bad is not None or not all(np.isfinite(d).all() for d in ours.values()):
        return "WRONG: loaded non-finite values", f"tensor {bad!r}" if bad else "a non-finite weight change"
    report({"class": "WRONG: loaded, the reference hangs or crashes", "detail": ""})
    try:
        ref = reference_delta(path, ctx)
    except Exception as e:
        return "WRONG: loaded, the reference refuses", f"{type(e).__name__}: {str(e)[:200]}"
    diff = same_delta(ours, ref, _tolerance(path))
    return ("WRONG: differs from the reference", diff) if diff else ("loaded = reference", "")


def _tolerance(path):
    """2 x rank ulps of the coarsest float stored (the factors' own rounding), at least 1e-5."""
    import torch  # (imported by context())
    from safetensors.torch import load_file  # (as torch)
    eps = max([torch.finfo(t.dtype).eps for t in load_file(str(path)).values() if t.is_floating_point()] or [0])
    return max(1e-5, 2 * 8 * eps)


def same_delta(ours, ref, tol):
    """None when the two {layer: weight change} agree (relative to each layer's largest change), else what differs."""
    if ours.keys() != ref.keys():
        return f"layers differ: {sorted(map(str, ours.keys() ^ ref.keys()))[:3]}"
    for key, d in ref.items():
        if d.shape != ours[key].shape:
            return f"{key}: shape {ours[key].shape}, the reference {d.shape}"
        top = max(float(np.abs(d).max()), 1e-30)
        err = float(np.abs(ours[key] - d).max())
        if not err <= tol * top:
            return f"{key}: weight change differs by {err:.3g} (largest {top:.3g})"
    return None


def write(case, cut, path: Path):
    data = case.to_bytes()
    if cut is not None:
        data = data[:int(cut * len(data))]
    path.write_bytes(data)
    return path


def fuzz(n, seed, workdir, keep, only, run_one, run_mutants) -> dict:
    """`run_one(path, ctx)`: fuzz_readers' forked classification; `run_mutants`: its loop over the mutants."""
    workdir = Path(workdir)
    ctx = context()
    check = run_one(write(ctx["base"], None, workdir / "base.safetensors"), ctx)
    if check["class"] != "loaded = reference":
        raise SystemExit(f"the base LoRA does not read as the reference: {check}")

    def write_case(i):
        case, what, cut = mutate(ctx, random.Random(f"unet-lora-{seed}-{i}"))
        return write(case, cut, workdir / f"mutant-{i}.safetensors"), what

    return run_mutants("unet-lora", n, seed, only, keep, write_case, lambda path: run_one(path, ctx))


def run(n, seed, workdir) -> dict:
    """The suite's seeded share: `n` mutants classified in this process (no fork: a crash fails the test itself;
    diffusers loads each onto fresh copies of the twins), counted as fuzz_readers counts them."""
    workdir = Path(workdir)
    ctx = context()
    counts, failures = Counter(), []
    for i in range(n):
        case, what, cut = mutate(ctx, random.Random(f"unet-lora-{seed}-{i}"))
        path = write(case, cut, workdir / f"mutant-{i}.safetensors")
        fresh = {**ctx, "models": {k: copy.deepcopy(m) for k, m in ctx["models"].items()}}
        try:
            cls, detail = classify(path, fresh, lambda provisional: None)
        except Exception as e:
            cls, detail = f"exception {type(e).__name__}", str(e)[:300]
        counts[cls] += 1
        if not cls.startswith(("refused", "loaded = reference")):
            failures.append({"i": i, "mutation": what, "class": cls, "detail": detail})
        path.unlink()
    return {"n": n, "counts": dict(counts), "unacceptable": len(failures), "failures": failures}
