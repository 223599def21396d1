"""LoRA files for the embedded default model's transformer (weights/klein-shapes, FLUX.2 klein layout) and the
weight change each reader makes of them, shared by tests/test_bad_lora.py and bench/fuzz_readers.py --format lora.

- `peft_file`: a diffusers/PEFT LoRA as diffusers' own `save_lora_weights` writes it (PEFT's LoraConfig packed into
  the `lora_adapter_metadata` header entry), from numpy factors;
- `to_kohya` / `to_bfl`: the same LoRA in kohya's names (BFL layer names, dots as underscores, fused qkv,
  lora_down / lora_up / alpha) and in ai-toolkit's BFL names (`diffusion_model.double_blocks.N.img_attn.qkv...`);
- `diffusers_delta(file)`: {diffusers layer: scaling x B @ A} after diffusers' own loading of the file
  (Flux2KleinPipeline.load_lora_weights on the diffusers twin of the transformer); `ours_delta(file)` the same for
  mlxdiff (lora.check, then apply_loras on the mlxdiff transformer, read back from its LoRALinear layers).
"""

import json
import math
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "weights" / "klein-shapes" / "transformer" / "config.json"
RANK = 4
TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out",
           "ff.linear_in", "ff.linear_out", "ff_context.linear_in", "ff_context.linear_out", "to_qkv_mlp_proj",
           "single_transformer_blocks.0.attn.to_out", "single_transformer_blocks.1.attn.to_out"]


def shapes_config() -> dict:
    return {k: v for k, v in json.loads(CONFIG.read_text()).items() if not k.startswith("_")}


def twin(cfg=None):
    """The diffusers transformer of the config (random weights: only its layers and shapes matter here)."""
    import torch
    from diffusers import Flux2Transformer2DModel
    torch.manual_seed(0)
    return Flux2Transformer2DModel(**(cfg or shapes_config())).eval()


def linear_shapes(model) -> dict:
    """{diffusers layer name: (out, in)} of a torch model's Linear layers."""
    import torch
    return {n: (m.out_features, m.in_features) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}


def targeted(shapes, targets=TARGETS) -> list:
    """The layers PEFT's target_modules (names matched whole or as a dotted suffix) puts a LoRA on."""
    return sorted(n for n in shapes if any(n == t or n.endswith("." + t) for t in targets))


def peft_tensors(shapes, layers, seed, rank=RANK, ranks=None, scale=0.1) -> dict:
    """{transformer.<layer>.lora_A.weight / .lora_B.weight: float32 array}, seeded; `ranks`: {layer: rank}."""
    rng = np.random.default_rng(seed)
    out = {}
    for layer in layers:
        rows, cols = shapes[layer]
        r = (ranks or {}).get(layer, rank)
        out[f"transformer.{layer}.lora_A.weight"] = (rng.standard_normal((r, cols)) * scale).astype(np.float32)
        out[f"transformer.{layer}.lora_B.weight"] = (rng.standard_normal((rows, r)) * scale).astype(np.float32)
    return out


def peft_config(targets=TARGETS, rank=RANK, alpha=8, **fields) -> dict:
    """PEFT's LoraConfig.to_dict(), as diffusers' training scripts pass it to save_lora_weights."""
    from peft import LoraConfig
    return LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(targets), init_lora_weights=False,
                      **fields).to_dict()


def packed(config, component="transformer") -> str:
    """A LoraConfig dict as diffusers packs it into lora_adapter_metadata ('<component>.<field>', sets as lists)."""
    return json.dumps({f"{component}.{k}": sorted(v) if isinstance(v, set) else v for k, v in config.items()},
                      indent=2, sort_keys=True)


def peft_file(path, tensors, config) -> Path:
    """`tensors` saved by diffusers' Flux2KleinPipeline.save_lora_weights with `config` as the transformer's
    lora_adapter_metadata (None: no metadata), at `path`."""
    import torch
    from diffusers import Flux2KleinPipeline
    path = Path(path)
    state = {k[len("transformer."):]: torch.from_numpy(np.array(v)) for k, v in tensors.items()}
    Flux2KleinPipeline.save_lora_weights(str(path.parent), transformer_lora_layers=state, weight_name=path.name,
                                         transformer_lora_adapter_metadata=config)
    return path


def save(path, tensors, metadata=None) -> Path:
    """numpy / torch tensors saved as they are (safetensors' own writer)."""
    import torch
    from safetensors.torch import save_file
    save_file({k: (v if isinstance(v, torch.Tensor) else torch.from_numpy(np.array(v))).clone().contiguous()
               for k, v in tensors.items()}, str(path), metadata=metadata)
    return Path(path)


# diffusers layer of a double block -> (BFL layer, part of its fused rows)
_DOUBLE = {"attn.to_q": ("img_attn.qkv", 0), "attn.to_k": ("img_attn.qkv", 1), "attn.to_v": ("img_attn.qkv", 2),
           "attn.add_q_proj": ("txt_attn.qkv", 0), "attn.add_k_proj": ("txt_attn.qkv", 1),
           "attn.add_v_proj": ("txt_attn.qkv", 2), "attn.to_out.0": ("img_attn.proj", None),
           "attn.to_add_out": ("txt_attn.proj", None), "ff.linear_in": ("img_mlp.0", None),
           "ff.linear_out": ("img_mlp.2", None), "ff_context.linear_in": ("txt_mlp.0", None),
           "ff_context.linear_out": ("txt_mlp.2", None)}
_SINGLE = {"attn.to_qkv_mlp_proj": "linear1", "attn.to_out": "linear2"}


def bfl_layers(tensors, scales=None) -> dict:
    """{BFL layer: (A, B)} of diffusers-named lora_A / lora_B tensors (a fused qkv needs its three parts with one
    A: the parts' A must be equal, as a BFL-named LoRA's are), B times scales[layer] (alpha / rank) if given."""
    parts = {}
    for key, a in tensors.items():
        if not key.endswith(".lora_A.weight"):
            continue
        layer = key[len("transformer."):-len(".lora_A.weight")]
        b = tensors[key.replace(".lora_A.", ".lora_B.")] * (scales or {}).get(layer, 1.0)
        block, i, rest = layer.split(".", 2)
        if block == "transformer_blocks":
            name, part = _DOUBLE[rest]
            parts.setdefault(f"double_blocks.{i}.{name}", {})[part] = (a, b)
        else:
            parts.setdefault(f"single_blocks.{i}.{_SINGLE[rest]}", {})[None] = (a, b)
    out = {}
    for name, pieces in parts.items():
        if None in pieces:
            out[name] = pieces[None]
        else:
            assert sorted(pieces) == [0, 1, 2], name
            out[name] = (pieces[0][0], np.concatenate([pieces[p][1] for p in range(3)]))
    return out


def shared_a(tensors) -> dict:
    """The same LoRA with each fused qkv's three parts given the to_q / add_q_proj part's A (so that it has a BFL
    form): diffusers names."""
    out = dict(tensors)
    for key in tensors:
        for q, others in ((".attn.to_q.", (".attn.to_k.", ".attn.to_v.")),
                          (".attn.add_q_proj.", (".attn.add_k_proj.", ".attn.add_v_proj."))):
            if q in key and key.endswith(".lora_A.weight"):
                for o in others:
                    if key.replace(q, o) in out:
                        out[key.replace(q, o)] = tensors[key].copy()
    return out


def to_kohya(tensors, alpha) -> dict:
    """kohya's names (lora_unet_<BFL name with underscores>.lora_down / lora_up / alpha), alpha for every layer."""
    out = {}
    for name, (a, b) in bfl_layers(tensors).items():
        k = "lora_unet_" + name.replace(".", "_")
        out[f"{k}.lora_down.weight"], out[f"{k}.lora_up.weight"] = a, b
        out[f"{k}.alpha"] = np.array(alpha, np.float32)
    return out


def to_bfl(tensors, scales=None) -> dict:
    """ai-toolkit's BFL names (diffusion_model.<BFL name>.lora_A / lora_B), alpha / rank baked into B."""
    out = {}
    for name, (a, b) in bfl_layers(tensors, scales).items():
        out[f"diffusion_model.{name}.lora_A.weight"], out[f"diffusion_model.{name}.lora_B.weight"] = a, b
    return out


# -- the weight change each reader makes ---------------------------------------------------------------------------

def diffusers_delta(path, model) -> dict:
    """{layer: float64 scaling x B @ A} after Flux2KleinPipeline.load_lora_weights on `model` (a diffusers
    transformer: changed in place) with the file at `path`; raises what diffusers raises."""
    import torch
    from diffusers.loaders.lora_pipeline import Flux2LoraLoaderMixin

    class Pipeline(Flux2LoraLoaderMixin):   # what load_lora_weights needs of a pipeline: its transformer
        components = {}
        hf_device_map = None

        def __init__(self, transformer):
            self.transformer = transformer

    Pipeline(model).load_lora_weights(str(path), adapter_name="x")
    out = {}
    with torch.no_grad():
        for name, m in model.named_modules():
            if hasattr(m, "lora_A") and "x" in getattr(m, "lora_A", {}):
                a = m.lora_A["x"].weight.double().numpy()
                b = m.lora_B["x"].weight.double().numpy()
                out[name] = m.scaling["x"] * (b @ a)
    return out


def ours_delta(path, cfg=None, dtype=None) -> dict:
    """{layer: float64 scale x B @ A} of what mlxdiff adds to its transformer for the file: the checks a pipeline
    makes (lora.components, lora.check), then lora.apply_loras, read back from the LoRALinear layers."""
    from types import SimpleNamespace

    import mlx.core as mx
    from mlxdiff import lora
    from mlxdiff.errors import MlxdiffError
    from mlxdiff.models import flux2
    args = flux2.ModelArgs.from_dict(cfg or shapes_config())
    for name in lora.components(path):
        if name != "transformer":   # what Pipeline.load_lora says for a component FLUX.2 does not have
            raise MlxdiffError(f"{path}: has LoRA layers for {name}, which this flux2 pipeline does not have")
    lora.check(SimpleNamespace(name="transformer", arch=flux2, args=args), path)
    model = flux2.Model(args)
    model.compute_dtype = dtype or mx.float32     # as a build in that dtype sets it (loading/build.py)
    lora.apply_loras(model, flux2, [(path, 1.0)])
    out = {}
    for name, m in model.named_modules():
        if isinstance(m, lora.LoRALinear):
            delta = 0
            for a, b, s in m.adapters():
                a, b = (np.array(t.astype(mx.float32)).astype(np.float64) for t in (a, b))
                delta = delta + s * (b @ a)
            out[name] = delta
    return out


def same_delta(ours, ref, tol=1e-5):
    """None when the two {layer: weight change} agree (relative to the largest change), else what differs."""
    if ours.keys() != ref.keys():
        return f"layers differ: {sorted(ours.keys() ^ ref.keys())[:3]}"
    for name, d in ref.items():
        if d.shape != ours[name].shape:
            return f"{name}: shape {ours[name].shape}, the reference {d.shape}"
        top = max(float(np.abs(d).max()), 1e-30)
        err = float(np.abs(ours[name] - d).max())
        if not err <= tol * top:
            return f"{name}: weight change differs by {err:.3g} (largest {top:.3g})"
    return None


# -- LyCORIS / kohya naming of PEFT adapters (tests/test_lycoris.py) -----------------------------------------------

_LYCORIS_ENDINGS = {"lora_A.weight": "lora_down.weight", "lora_B.weight": "lora_up.weight",
                    "lora_magnitude_vector": "dora_scale", "lora_magnitude_vector.weight": "dora_scale"}


def to_lycoris(state, alpha, prefix="lora_unet_") -> dict:
    """A PEFT adapter's state dict (get_peft_model_state_dict of a LoHaConfig / LoKrConfig / LoraConfig(use_dora)
    model: `<module>.hada_w1_a`, `.lokr_w1`, `.lora_A.weight`, `.lora_magnitude_vector`, ...) in the names LyCORIS
    and kohya write (`lora_unet_<module, dots as underscores>.hada_w1_a`, `.lokr_w1`, `.lora_down.weight`,
    `.dora_scale` as (out, 1): LyCORIS's wd_on_out), with one `.alpha` per module."""
    import torch
    out = {}
    for key, value in state.items():
        for ending, ours in _LYCORIS_ENDINGS.items():
            if key.endswith("." + ending):
                module, role = key[:-len(ending) - 1], ours
                break
        else:
            module, role = key.rsplit(".", 1)
        value = value.detach().float()
        if role == "dora_scale":
            value = value.reshape(-1, 1)
        name = prefix + module.replace(".", "_")
        out[f"{name}.{role}"] = value
        out[f"{name}.alpha"] = torch.tensor(float(alpha))
    return out


def flux1_lora_files(root, name, dim, num_single_layers, generator, rank=4, alpha=2.0) -> dict:
    """One FLUX.1-named LoRA in three namings, {naming: path} under `root` (`<name>-<naming>-lora.safetensors`):
    kohya's (fused qkv, a single block's linear1 whole, .alpha), BFL / ComfyUI's original (`diffusion_model.`,
    lora_A / lora_B, alpha folded into B) and its split written as PEFT for diffusers' load_lora_weights (the fused A
    shared by the parts). Layers: the first double block's image qkv and proj, the second's text MLP, every single
    block's linear1 and linear2. FLUX.1 and Chroma share these names (tests/test_flux1_lora.py,
    tests/test_chroma_lora.py)."""
    import torch
    from safetensors.torch import save_file
    kohya, original, peft = {}, {}, {}

    def lora(kohya_name, bfl_name, ins, parts):
        """parts: [(diffusers layer, rows)]: one shared A, B's rows split over the parts."""
        a = torch.randn(rank, ins, generator=generator) * 0.3
        b = torch.randn(sum(r for _, r in parts), rank, generator=generator) * 0.3
        kohya[f"lora_unet_{kohya_name}.lora_down.weight"] = a
        kohya[f"lora_unet_{kohya_name}.lora_up.weight"] = b
        kohya[f"lora_unet_{kohya_name}.alpha"] = torch.tensor(alpha)
        original[f"diffusion_model.{bfl_name}.lora_A.weight"] = a
        original[f"diffusion_model.{bfl_name}.lora_B.weight"] = b * (alpha / rank)   # no alpha in this naming
        start = 0
        for layer, rows in parts:
            peft[f"transformer.{layer}.lora_A.weight"] = a
            peft[f"transformer.{layer}.lora_B.weight"] = b[start:start + rows] * (alpha / rank)
            start += rows

    d0 = "transformer_blocks.0.attn."
    lora("double_blocks_0_img_attn_qkv", "double_blocks.0.img_attn.qkv", dim,
         [(d0 + "to_q", dim), (d0 + "to_k", dim), (d0 + "to_v", dim)])
    lora("double_blocks_0_img_attn_proj", "double_blocks.0.img_attn.proj", dim, [(d0 + "to_out.0", dim)])
    lora("double_blocks_1_txt_mlp_0", "double_blocks.1.txt_mlp.0", dim,
         [("transformer_blocks.1.ff_context.net.0.proj", 4 * dim)])
    for i in range(num_single_layers):
        s = f"single_transformer_blocks.{i}."
        lora(f"single_blocks_{i}_linear1", f"single_blocks.{i}.linear1", dim,
             [(s + "attn.to_q", dim), (s + "attn.to_k", dim), (s + "attn.to_v", dim), (s + "proj_mlp", 4 * dim)])
        lora(f"single_blocks_{i}_linear2", f"single_blocks.{i}.linear2", 5 * dim, [(s + "proj_out", dim)])
    files = {}
    for naming, tensors in (("kohya", kohya), ("original", original), ("peft", peft)):
        files[naming] = Path(root) / f"{name}-{naming}-lora.safetensors"
        save_file({k: v.clone().contiguous() for k, v in tensors.items()}, str(files[naming]))
    return files


# -- LyCORIS tests: a quantized mlxdiff transformer and the torch twin holding its dequantized weights (tests/test_lycoris.py)


def quantized(model):
    """mlxdiff's transformer with its Linear layers affine-quantized (8 bits, groups of 32)."""
    import mlx.nn as nn
    nn.quantize(model, group_size=32, bits=8,
                class_predicate=lambda _, m: isinstance(m, nn.Linear) and m.weight.shape[1] % 32 == 0)
    assert any(isinstance(m, nn.QuantizedLinear) for _, m in model.named_modules())
    return model


def dequantized_twin(twin, model):
    """A copy of the torch twin holding the quantized mlxdiff model's dequantized weights."""
    import copy

    import mlx.core as mx
    import mlx.nn as nn
    import torch
    out = copy.deepcopy(twin)
    with torch.no_grad():
        for path, m in model.named_modules():
            if isinstance(m, nn.QuantizedLinear):
                w = mx.dequantize(m.weight, m.scales, m.biases, m.group_size, m.bits).astype(mx.float32)
            elif type(m).__name__ == "RawLinear":
                from mlxdiff.formats.gguf import decode_rows
                w = decode_rows(m.weight, m.type_name)
            else:
                continue
            out.get_submodule(path).weight.copy_(torch.from_numpy(np.array(w)))
    return out


# -- LyCORIS's own math as the reference: its functional code (pip lycoris-lora), tests/test_lycoris_tucker.py -----

def lycoris_factors(form, weight, rank, generator, scale=0.2) -> dict:
    """Seeded random factors of one LyCORIS form for a torch layer weight (out, in[, kh, kw]), in the shapes
    LyCORIS's modules save them ({role: tensor}, the file's `<layer>.<role>` names):
    - "LoCon Tucker" (lycoris/modules/locon.py LoConModule, use_tucker): lora_down (r, in, 1, 1), lora_mid
      (r, r, kh, kw), lora_up (out, r, 1, 1); "LoRA": lora_down (r, in[, kh, kw]), lora_up (out, r[, 1, 1]);
    - "LoHa Tucker" (modules/loha.py LohaModule, use_tucker): hada_w{1,2}_a (r, out), hada_w{1,2}_b (r, in),
      hada_t{1,2} (r, r, kh, kw);
    - "LoKr Tucker" (modules/lokr.py LokrModule, use_tucker): lokr_w1 (a, c), lokr_w2_a (r, b), lokr_w2_b (r, d),
      lokr_t2 (r, r, kh, kw), out = a b and in = c d as LyCORIS's functional/general.py factorization splits them;
      "LoKr": lokr_w1 (a, c), lokr_w2_a (b, r), lokr_w2_b (r, d [x kh x kw])."""
    import torch
    from lycoris.functional.general import factorization
    out, ins, *k = weight.shape

    def r(*shape):
        return torch.randn(*shape, generator=generator) * scale
    ones = [1] * len(k)
    if form == "LoCon Tucker":
        return {"lora_down.weight": r(rank, ins, 1, 1), "lora_mid.weight": r(rank, rank, *k),
                "lora_up.weight": r(out, rank, 1, 1)}
    if form == "LoRA":
        return {"lora_down.weight": r(rank, ins, *k), "lora_up.weight": r(out, rank, *ones)}
    if form == "LoHa Tucker":
        return {f"hada_{n}": r(*shape) for n, shape in (
            ("w1_a", (rank, out)), ("w1_b", (rank, ins)), ("t1", (rank, rank, *k)),
            ("w2_a", (rank, out)), ("w2_b", (rank, ins)), ("t2", (rank, rank, *k)))}
    (a, b), (c, d) = factorization(out, -1), factorization(ins, -1)
    w1 = torch.randn(a, c, generator=generator)        # the kron's small factor, O(1) as LyCORIS's init
    if form == "LoKr Tucker":
        return {"lokr_w1": w1, "lokr_w2_a": r(rank, b), "lokr_w2_b": r(rank, d), "lokr_t2": r(rank, rank, *k)}
    assert form == "LoKr", form
    return {"lokr_w1": w1, "lokr_w2_a": r(b, rank), "lokr_w2_b": r(rank, d * (math.prod(k) if k else 1))}


def lycoris_delta(form, f, gamma):
    """The weight change LyCORIS computes for `form`'s factors `f` (lycoris_factors) at scale gamma (alpha / rank):
    its functional code, eager torch (backend="torch"): functional/locon.py diff_weight, functional/loha.py
    diff_weight, functional/lokr.py kron_weight (LokrModule.get_weight's call: the scale given, not re-read from the
    factors' shapes)."""
    from lycoris.functional import locon, loha, lokr
    if form in ("LoCon Tucker", "LoRA"):
        return locon.diff_weight(f["lora_down.weight"], f["lora_up.weight"], f.get("lora_mid.weight"), gamma=gamma,
                                 backend="torch")
    if form == "LoHa Tucker":
        return loha.diff_weight(f["hada_w1_b"], f["hada_w1_a"], f["hada_w2_b"], f["hada_w2_a"], f["hada_t1"],
                                f["hada_t2"], gamma=gamma, backend="torch")
    return lokr.kron_weight(f["lokr_w1"], None, None, None, f["lokr_w2_a"], f["lokr_w2_b"], f.get("lokr_t2"),
                            scale=gamma, backend="torch")


def lycoris_dora_scale(weight, wd_on_out, generator):
    """A trained-looking LyCORIS dora_scale of a torch layer weight: the norms LyCORIS starts it from (per output
    row, (out, 1[, 1, 1]), or with wd_on_out=False per input column, (1, in[, 1, 1]): LoConModule.__init__) times
    noise, so that the factor is not 1."""
    import torch
    w = weight.detach().float()
    tail = [1] * (w.dim() - 1)
    if wd_on_out:
        norm = w.reshape(w.shape[0], -1).norm(dim=1).reshape(w.shape[0], *tail)
    else:
        norm = w.transpose(0, 1).reshape(w.shape[1], -1).norm(dim=1).reshape(w.shape[1], *tail).transpose(0, 1)
    return norm * (1 + 0.3 * torch.randn(norm.shape, generator=generator))


def lycoris_merged(weight, delta, dora_scale=None, wd_on_out=True):
    """The layer weight LyCORIS merges at multiplier 1 (get_merged_weight): W + dW, or with a dora_scale its
    functional/general.py weight_decompose (eager torch) of W + dW."""
    from lycoris.functional.general import weight_decompose
    merged = weight.detach().float() + delta.reshape(weight.shape)
    if dora_scale is None:
        return merged
    return weight_decompose(merged, dora_scale, 1, wd_on_out, backend="torch")


# -- a transformer family's LoRA tests against diffusers' model with the same PEFT adapter (tests/test_krea2_lora.py,
# tests/test_qwenimage_lora.py, tests/test_zimage_lora.py) ---------------------------------------------------------

def random_adapter(base, rank, alpha, targets, seed=7, scale=0.2):
    """(a copy of diffusers model `base` with a PEFT LoRA of `rank` and `alpha` on `targets`, its LoraConfig): every
    lora_ factor random (normal times `scale`, from a generator seeded `seed`); the copy still in training mode."""
    import copy
    import torch
    from peft import LoraConfig
    adapted = copy.deepcopy(base)
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, init_lora_weights=False)
    adapted.add_adapter(config)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in adapted.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * scale)
    return adapted, config


def adapter_state(adapted) -> dict:
    """The PEFT state dict of `adapted`'s LoRA (lora_A / lora_B per layer), detached contiguous copies."""
    from peft.utils import get_peft_model_state_dict
    return {k: v.detach().clone().contiguous() for k, v in get_peft_model_state_dict(adapted).items()}


def ours_with(folder, arch, path, scale=1.0):
    """mlxdiff's `arch` transformer of the diffusers folder `folder` with the LoRA file `path` on it at `scale`
    (lora.check first)."""
    from types import SimpleNamespace
    from helpers import load_ours
    from mlxdiff import lora
    model = load_ours(folder, arch)
    lora.check(SimpleNamespace(name="transformer", arch=arch, args=model.args), path)
    return lora.apply_loras(model, arch, [(path, scale)])


def scaled_reference(base, adapted, forward, scale):
    """diffusers' output `forward(model)` with the adapter at `scale` (PEFT's set_adapters on a copy); the LoRA at
    scale 1 and no LoRA each move it (parity.assert_moves)."""
    import copy
    import parity
    scaled = copy.deepcopy(adapted)
    scaled.set_adapters(["default"], weights=[scale])
    ref = forward(scaled)
    parity.assert_moves("the LoRA's scale", ref, forward(adapted))
    parity.assert_moves("the LoRA", ref, forward(base))
    return ref


def assert_lora_parity(model, forward, reference, base_output, layers, what):
    """mlxdiff's `model` with a LoRA on: `layers` LoRALinear layers, `forward(model)` within parity.LATENT_TOL of
    diffusers' `reference`; with the LoRA removed, of diffusers' output without it (`base_output`)."""
    import parity
    from helpers import max_rel_err
    from mlxdiff import lora
    wrapped = [n for n, m in model.named_modules() if isinstance(m, lora.LoRALinear)]
    assert len(wrapped) == layers
    err = max_rel_err(forward(model), reference)
    print(f"{what}: max_rel_err {err:.2e}")
    assert err <= parity.LATENT_TOL
    lora.remove_loras(model)
    assert max_rel_err(forward(model), base_output) <= parity.LATENT_TOL


def loaded_by_diffusers(loader_mixin, base, path):
    """A copy of diffusers model `base` with the LoRA file `path` loaded by diffusers' own
    `loader_mixin`.load_lora_weights (adapter "x")."""
    import copy

    class Pipeline(loader_mixin):     # what load_lora_weights needs of a pipeline: its transformer
        components = {}
        hf_device_map = None

        def __init__(self, transformer):
            self.transformer = transformer
    model = copy.deepcopy(base)
    Pipeline(model).load_lora_weights(str(path), adapter_name="x")
    return model
