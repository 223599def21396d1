"""Issue 39 item 4's LyCORIS leftovers (mlxdiff/lora/): the Tucker forms of a convolution's LoCon (`lora_mid`), LoHa
(`hada_t1` / `hada_t2`) and LoKr (`lokr_t2`), DoRA on convolutions, and LyCORIS's per-input-column dora_scale
(wd_on_out=False, shape (1, in[, 1, 1])) beside its per-row one ((out, 1[, 1, 1])), against LyCORIS's own math run
in the test (pip lycoris-lora 4.1.3, its eager torch code: tests/lora_helpers.lycoris_delta / lycoris_merged:
lycoris/functional/locon.py diff_weight, loha.py diff_weight, lokr.py kron_weight, general.py weight_decompose),
float32, seeded random factors and magnitudes in the shapes LyCORIS's modules save (lora_helpers.lycoris_factors),
kohya / LyCORIS names (`lora_unet_<module>.<role>`, `.alpha` with alpha != rank):

- the tiny SD 1.5 UNet (tests/ldm_helpers.UNETS, 3x3 convolutions with stride 1 and 2): each Tucker form, plain and
  with a row or a column dora_scale, on every 3x3 convolution: mlxdiff's weight change (or DoRA-merged weight)
  within 1e-5 of LyCORIS's, the noise prediction within 1e-4 of the twin holding LyCORIS's merged weights;
- the same on 8-bit affine-quantized convolutions (QuantizedConv2d), against the twin of their dequantized kernels;
- PEFT's conv DoRA (LoraConfig(use_dora=True) on the UNet's 3x3 and 1x1 convolutions: DoraConv2dLayer), its own
  names, against PEFT's merge();
- the tiny FLUX.1 transformer (tests/flux1_helpers): a LoKr with a per-column dora_scale on BFL's fused
  layers (the double block's qkv, the single block's linear1: the column norms are over all the parts' rows);
- through the pipelines: a LoHa Tucker with conv DoRA on SD 1.5 and a per-column DoRA on FLUX.1 dev, mlxdiff.load(
  loras=) against diffusers' pipeline holding LyCORIS's merged weights, from the same noise: latents within 1e-4,
  image within 2 levels (tests/parity.py), and the LoRA moves diffusers' result past the latent tolerance;
- bad input in one line naming the key: a Tucker core of the wrong rank, a lora_mid without its pair.
"""

import copy
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import mlxdiff
import mlx.core as mx
from flux1_helpers import H, W, check_parity, flux1_components, make_inputs, make_torch_model, mlx_forward, \
    packed_noise, reference_run, torch_forward
from helpers import load_ours, max_rel_err, randomize_
from ldm_helpers import UNETS, reference, sd15_components, unet_inputs
from lora_helpers import lycoris_delta, lycoris_dora_scale, lycoris_factors, lycoris_merged, save
from mlxdiff import lora
from mlxdiff.errors import MlxdiffError
from mlxdiff.models import flux1, unet
import parity

RANK, ALPHA = 3, 2.0           # LyCORIS's scale alpha / rank = 2/3
WEIGHT_TOL, OUTPUT_TOL = 1e-5, 1e-4


def kohya(module):
    return "lora_unet_" + module.replace(".", "_")


def convs(model, kernel=(3, 3)):
    """{diffusers module name: torch Conv2d} of a torch UNet's convolutions of that kernel."""
    return {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Conv2d) and m.kernel_size == kernel}


def lycoris_file(layers, form, doras, seed):
    """(kohya-named tensors, {module: LyCORIS's merged weight}, {module: LyCORIS's weight change}) of one form on
    each of `layers` ({module: torch layer}), the i-th with DoRA doras[i % len(doras)]: None, "out" (a dora_scale
    per output row: wd_on_out) or "in" (per input column / channel: wd_on_out=False)."""
    g = torch.Generator().manual_seed(seed)
    tensors, merged, deltas = {}, {}, {}
    for i, (name, layer) in enumerate(layers.items()):
        dora = doras[i % len(doras)]
        factors = lycoris_factors(form, layer.weight, RANK, g, scale=0.5 if form == "LoHa Tucker" else 0.2)
        delta = lycoris_delta(form, factors, ALPHA / RANK).reshape(layer.weight.shape)
        scale = None if dora is None else lycoris_dora_scale(layer.weight, dora == "out", g)
        merged[name] = lycoris_merged(layer.weight, delta, scale, dora != "in")
        deltas[name] = delta
        tensors.update({f"{kohya(name)}.{role}": t for role, t in factors.items()})
        tensors[f"{kohya(name)}.alpha"] = torch.tensor(ALPHA)
        if scale is not None:
            tensors[f"{kohya(name)}.dora_scale"] = scale
    return tensors, merged, deltas


def with_weights(model, weights):
    """A copy of the torch `model` holding `weights` ({module: weight})."""
    out = copy.deepcopy(model)
    with torch.no_grad():
        for name, w in weights.items():
            out.get_submodule(name).weight.copy_(w)
    return out


def effective_weight(layer):
    """What a LoRAConv / LoRALinear with one adapter computes with, as a torch (out, in[, kh, kw]) weight: W + s B A,
    times its DoRA factor per row or per input column (its forward is checked through the model's output)."""
    (a, b, s), = layer.adapters()
    conv = a.ndim == 4
    rows = layer.base_rows(a.reshape(a.shape[0], -1).shape[1], mx.float32)
    w = rows + s * (b.astype(mx.float32) @ a.astype(mx.float32).reshape(a.shape[0], -1))
    d, on = layer.lora_dora[0], layer._dora_on[0]
    if d is not None:
        if on == "out":
            w = w * d[:, None]
        else:
            w = (w.reshape(w.shape[0], -1, a.shape[-1]) * d).reshape(w.shape)
    w = np.array(w)
    return torch.from_numpy(w.reshape(w.shape[0], *a.shape[1:]).transpose(0, 3, 1, 2) if conv else w)


# -- the SD 1.5 UNet's convolutions ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def unet_twin():
    """(the tiny SD 1.5 torch UNet, its inputs, its noise prediction as a function of a torch UNet, the plain one)."""
    from diffusers import UNet2DConditionModel
    torch.manual_seed(0)
    model = randomize_(UNet2DConditionModel(**UNETS["sd15"]["config"]), seed=1, scale=0.1).eval()
    x = unet_inputs("sd15")

    def run(m):
        with torch.no_grad():
            return m(torch.from_numpy(x["sample"]), torch.from_numpy(x["timestep"]),
                     torch.from_numpy(x["context"])).sample.numpy()
    return model, x, run, run(model)


def ours_unet(model):
    args = unet.ModelArgs.from_dict(dict(model.config))
    ours = unet.Model(args)
    ours.load_weights(list(ours.sanitize({k: mx.array(v.detach().numpy())
                                          for k, v in model.state_dict().items()}).items()), strict=True)
    return ours, args


def run_ours(ours, x):
    return np.array(ours(mx.array(x["sample"]), mx.array(x["timestep"]), mx.array(x["context"]), None))


DORAS = (None, "out", "in")


@pytest.mark.parametrize("form", ["LoCon Tucker", "LoHa Tucker", "LoKr Tucker"])
def test_tucker_forms_on_unet_convolutions_match_lycoris(unet_twin, tmp_path, form):
    """A Tucker form on every 3x3 convolution of the tiny SD 1.5 UNet (its downsampler's stride 2 included), a third
    of them plain, a third with a dora_scale per output channel, a third per input channel: each layer's weight
    within 1e-5 of LyCORIS's (its weight change, or its DoRA-merged weight), the noise prediction within 1e-4 of the
    twin holding LyCORIS's merged weights."""
    model, x, run_torch, plain = unet_twin
    layers = convs(model)
    assert any(m.stride == (2, 2) for m in layers.values()) and len(layers) >= 9
    tensors, merged, deltas = lycoris_file(layers, form, DORAS, seed=len(form))
    core = {"LoCon Tucker": ".lora_mid.weight", "LoHa Tucker": ".hada_t2", "LoKr Tucker": ".lokr_t2"}[form]
    assert sum(k.endswith(core) for k in tensors) == len(layers)
    assert {tuple(v.shape[:2]) == (1, m.in_channels) for k, v in tensors.items() if k.endswith(".dora_scale")
            for m in [layers[next(n for n in layers if k.startswith(kohya(n) + "."))]]} == {True, False}
    path = save(tmp_path / "tucker.safetensors", tensors)
    ours, args = ours_unet(model)
    lora.check(SimpleNamespace(name="unet", arch=unet, args=args), path)
    lora.apply_loras(ours, unet, [(path, 1.0)], component="unet")
    modules = dict(ours.named_modules())
    worst = 0.0
    for i, (name, layer) in enumerate(layers.items()):
        got = effective_weight(modules[name])
        if DORAS[i % 3] is None:
            ref, got = deltas[name], got - layer.weight.detach()
        else:
            ref = merged[name]
            # the magnitudes matter: LyCORIS's DoRA-merged weight is far from W + dW
            undecomposed = layer.weight.detach() + deltas[name]
            assert float((ref - undecomposed).abs().max() / ref.abs().max()) > 1e-2
        worst = max(worst, float((got - ref).abs().max() / ref.abs().max()))
    ref_out = run_torch(with_weights(model, merged))
    err = max_rel_err(run_ours(ours, x), ref_out)
    moved = max_rel_err(ref_out, plain)
    print(f"UNet {form} (plain, row and column DoRA): weights max_rel_err {worst:.1e}, output {err:.1e} "
          f"(moved {moved:.1e})")
    assert worst <= WEIGHT_TOL and err <= OUTPUT_TOL
    assert moved > 1e-2


def test_tucker_dora_on_quantized_convolutions(unet_twin, tmp_path):
    """A LoCon Tucker with row and column dora_scales on the UNet's 3x3 convolutions kept 8-bit affine-quantized
    (loading/quantize.QuantizedConv2d, never dequantized for good: DoRA's norms read its decoded kernel), against
    LyCORIS's merge on a twin holding the dequantized kernels."""
    from mlxdiff.loading.quantize import QuantizedConv2d
    from mlxdiff.lora.apply import _put
    model, x, run_torch, _ = unet_twin
    ours, args = ours_unet(model)
    modules = dict(ours.named_modules())
    dequantized = copy.deepcopy(model)
    layers = {}
    with torch.no_grad():
        for name, conv in convs(model).items():
            if (9 * conv.in_channels) % 32 == 0:
                q = QuantizedConv2d(modules[name], bits=8, group_size=32)
                _put(ours, name, q)
                w = np.array(q.dense_weight().astype(mx.float32)).transpose(0, 3, 1, 2)
                dequantized.get_submodule(name).weight.copy_(torch.from_numpy(w))
                layers[name] = dequantized.get_submodule(name)
    assert len(layers) >= 4
    tensors, merged, _ = lycoris_file(layers, "LoCon Tucker", ("out", "in"), seed=51)
    path = save(tmp_path / "tucker_dora_q8.safetensors", tensors)
    lora.check(SimpleNamespace(name="unet", arch=unet, args=args), path)
    lora.apply_loras(ours, unet, [(path, 1.0)], component="unet")
    wrapped = [m for _, m in ours.named_modules() if isinstance(m, lora.LoRAConv)]
    assert len(wrapped) == len(layers) and all(isinstance(m.base, QuantizedConv2d) for m in wrapped)
    ref = run_torch(with_weights(dequantized, merged))
    err = max_rel_err(run_ours(ours, x), ref)
    moved = max_rel_err(ref, run_torch(dequantized))
    print(f"UNet LoCon Tucker + DoRA on 8-bit convolutions: output max_rel_err {err:.1e} (moved {moved:.1e})")
    assert err <= OUTPUT_TOL and moved > 1e-2


def test_peft_conv_dora_matches_peft_merged(unet_twin, tmp_path):
    """PEFT's DoRA on the UNet's 3x3 and 1x1 convolutions (DoraConv2dLayer: m / ||W + s B A|| per output channel),
    in PEFT's own names (`unet.<module>.lora_A.weight`, `.lora_magnitude_vector`), against PEFT's merge()."""
    from peft import LoraConfig, inject_adapter_in_model
    from peft.tuners.tuners_utils import BaseTunerLayer
    from peft.utils import get_peft_model_state_dict
    model, x, run_torch, plain = unet_twin
    targets = sorted(set(convs(model)) | set(convs(model, (1, 1))))
    peft_model = inject_adapter_in_model(LoraConfig(r=RANK, lora_alpha=RANK, target_modules=targets,
                                                    init_lora_weights=False, use_dora=True), copy.deepcopy(model))
    g = torch.Generator().manual_seed(21)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "magnitude" in name:
                p.mul_(1 + 0.3 * torch.randn(p.shape, generator=g))
            elif "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    state = get_peft_model_state_dict(peft_model)
    assert sum("magnitude" in k for k in state) == len(targets)
    with torch.no_grad():
        for m in peft_model.modules():
            if isinstance(m, BaseTunerLayer):
                m.merge()
    path = save(tmp_path / "peft_dora.safetensors", {f"unet.{k}": v for k, v in state.items()})
    ours, args = ours_unet(model)
    lora.check(SimpleNamespace(name="unet", arch=unet, args=args), path)
    lora.apply_loras(ours, unet, [(path, 1.0)], component="unet")
    assert sum(isinstance(m, lora.LoRAConv) and m.lora_dora[0] is not None for _, m in ours.named_modules()) == \
        len(targets)
    ref = run_torch(peft_model.eval())
    err = max_rel_err(run_ours(ours, x), ref)
    print(f"PEFT conv DoRA: output max_rel_err {err:.1e} (moved {max_rel_err(ref, plain):.1e})")
    assert err <= OUTPUT_TOL and max_rel_err(ref, plain) > 1e-2


# -- FLUX.1's fused linear layers: a per-column dora_scale -----------------------------------------------------------

# BFL layer -> the diffusers layers whose rows it stacks, in order
FUSED = {
    "double_blocks.0.img_attn.qkv": ["transformer_blocks.0.attn.to_q", "transformer_blocks.0.attn.to_k",
                                     "transformer_blocks.0.attn.to_v"],
    "double_blocks.1.img_attn.proj": ["transformer_blocks.1.attn.to_out.0"],
    "single_blocks.0.linear1": ["single_transformer_blocks.0.attn.to_q", "single_transformer_blocks.0.attn.to_k",
                                "single_transformer_blocks.0.attn.to_v", "single_transformer_blocks.0.proj_mlp"],
    "single_blocks.1.linear2": ["single_transformer_blocks.1.proj_out"],
}


def flux1_column_dora(model, form, seed):
    """(kohya-named tensors of `form` with a per-column dora_scale on BFL's fused layers of the diffusers FLUX.1
    `model`, {diffusers layer: LyCORIS's merged weight}: the fused layer's weight_decompose split into its parts'
    rows)."""
    g = torch.Generator().manual_seed(seed)
    tensors, merged = {}, {}
    for bfl, parts in FUSED.items():
        layers = [model.get_submodule(p) for p in parts]
        weight = torch.cat([m.weight.detach() for m in layers])
        factors = lycoris_factors(form, weight, RANK, g)
        scale = lycoris_dora_scale(weight, False, g)
        assert scale.shape == (1, weight.shape[1])
        whole = lycoris_merged(weight, lycoris_delta(form, factors, ALPHA / RANK), scale, wd_on_out=False)
        start = 0
        for p, m in zip(parts, layers):
            merged[p] = whole[start:start + m.out_features]
            start += m.out_features
        name = kohya(bfl)
        tensors.update({f"{name}.{role}": t for role, t in factors.items()})
        tensors[f"{name}.alpha"] = torch.tensor(ALPHA)
        tensors[f"{name}.dora_scale"] = scale
    return tensors, merged


@pytest.fixture(scope="module")
def flux1_twin(tmp_path_factory):
    model = make_torch_model("dev", seed=5)
    folder = tmp_path_factory.mktemp("flux1_tucker") / "transformer"
    model.save_pretrained(str(folder))
    return model, folder


@pytest.mark.parametrize("form", ["LoKr"])    # (a LoRA's: through the pipeline, below)
def test_flux1_column_dora_matches_lycoris(flux1_twin, tmp_path, form):
    """A LoKr with a per-column dora_scale (LyCORIS's wd_on_out=False) on FLUX.1's fused qkv and linear1
    (and the unfused proj, linear2): every part's weight within 1e-5 of LyCORIS's merged fused weight's rows (the
    column norms taken over the whole fused layer), the output within 1e-4 of the twin holding them."""
    model, folder = flux1_twin
    tensors, merged = flux1_column_dora(model, form, seed=31 + len(form))
    path = save(tmp_path / f"flux1_{form}_columns.safetensors", tensors)
    ours = load_ours(folder, flux1)
    lora.check(SimpleNamespace(name="transformer", arch=flux1, args=ours.args), path)
    lora.apply_loras(ours, flux1, [(path, 1.0)])
    modules = dict(ours.named_modules())
    worst = max(float((effective_weight(modules[p]) - w).abs().max() / w.abs().max()) for p, w in merged.items())
    x = make_inputs("dev")
    plain = torch_forward(model, x)
    ref = torch_forward(with_weights(model, merged), x)
    err = max_rel_err(mlx_forward(ours, x), ref)
    print(f"FLUX.1 {form} column DoRA: weights max_rel_err {worst:.1e}, output {err:.1e} "
          f"(moved {max_rel_err(ref, plain):.1e})")
    assert worst <= WEIGHT_TOL and err <= OUTPUT_TOL and max_rel_err(ref, plain) > 1e-2
    # the column norms span the fused layer: per-part norms (each part's own columns) would be far off
    assert all(modules[p].lora_dora[0].shape == (modules[p].base.weight.shape[1],) for p in merged)


# -- through the pipelines -------------------------------------------------------------------------------------------

def test_sd15_pipeline_loha_tucker_conv_dora_matches_diffusers(tmp_path):
    """A LoHa Tucker with a per-row dora_scale on the tiny SD 1.5 pipeline's 3x3 UNet convolutions: mlxdiff.load(
    loras=) against diffusers' StableDiffusionPipeline holding LyCORIS's merged weights, from the same noise."""
    import diffusers
    from ldm_helpers import showing_moves
    parts = sd15_components()
    folder = tmp_path / "sd15"
    diffusers.StableDiffusionPipeline(**parts).save_pretrained(str(folder))
    tensors, merged, _ = lycoris_file(convs(parts["unet"]), "LoHa Tucker", ("out",), seed=41)
    path = save(tmp_path / "loha_tucker_dora.safetensors", tensors)
    pipe = diffusers.StableDiffusionPipeline(**{**parts, "unet": with_weights(parts["unet"], merged)})
    plain = diffusers.StableDiffusionPipeline(**parts)
    h, w, steps, guidance = 32, 40, 2, 4.0
    noise = np.random.default_rng(6).standard_normal((1, 4, h // 4, w // 4)).astype(np.float32)

    def run(lycoris=True):
        return reference(pipe if lycoris else plain, prompt="a red fox", height=h, width=w,
                         num_inference_steps=steps, guidance_scale=guidance, latents=torch.tensor(noise))
    ref_latents, ref_image = parity.assert_inputs_matter(showing_moves("sd15 LoHa Tucker", run), {},
                                                         {"the LoRA": {"lycoris": False}})
    ours = mlxdiff.load(str(folder), loras=[(str(path), 1.0)]).generate(
        "a red fox", width=w, height=h, steps=steps, guidance=guidance, latents=noise, progress_bar=False)
    err, shift = max_rel_err(ours.latents, ref_latents), parity.levels(ours.image, ref_image)
    print(f"sd15 LoHa Tucker + conv DoRA pipeline: latents max_rel_err {err:.1e}, image {shift} levels")
    assert err <= parity.LATENT_TOL and shift <= parity.IMAGE_LEVELS


def test_flux1_pipeline_column_dora_matches_diffusers(tmp_path):
    """A LoRA with a per-column dora_scale on the tiny FLUX.1 dev pipeline's fused layers: mlxdiff.load(loras=)
    against diffusers' FluxPipeline holding LyCORIS's merged weights, from the same noise."""
    from diffusers import FluxPipeline
    parts = flux1_components("dev", seed=3)
    folder = tmp_path / "flux1"
    FluxPipeline(**parts).save_pretrained(str(folder))
    tensors, merged = flux1_column_dora(parts["transformer"], "LoRA", seed=43)
    path = save(tmp_path / "flux1_column_dora.safetensors", tensors)
    pipes = {True: FluxPipeline(**{**parts, "transformer": with_weights(parts["transformer"], merged)}),
             False: FluxPipeline(**parts)}
    noise = packed_noise(4)

    def run(lycoris=True):
        return reference_run(pipes[lycoris], noise, prompt="a red fox in the snow", num_inference_steps=2,
                             guidance_scale=3.5, max_sequence_length=512)
    ref_latents, ref_image = parity.assert_inputs_matter(run, {}, {"the LoRA": {"lycoris": False}})
    result = mlxdiff.load(str(folder), loras=[(str(path), 1.0)]).generate(
        "a red fox in the snow", latents=noise, width=W, height=H, steps=2, guidance=3.5, progress_bar=False)
    check_parity(result, ref_latents, ref_image, "FLUX.1 column DoRA pipeline")


# -- bad input -------------------------------------------------------------------------------------------------------

def _r(*shape):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(sum(shape))) * 0.1


LAYER = "lora_unet_conv_in"      # the tiny SD 1.5 UNet's: 4 in, 32 out, 3x3

BAD = {
    "lora_mid of another rank": ({".lora_down.weight": _r(2, 4, 1, 1), ".lora_mid.weight": _r(3, 2, 3, 3),
                                  ".lora_up.weight": _r(32, 2, 1, 1)}, "not a LoCon in Tucker form"),
    "lora_mid alone": ({".lora_mid.weight": _r(2, 2, 3, 3)}, "needs its layer's lora_down and lora_up"),
    "hada_t1 of another rank": ({".hada_w1_a": _r(2, 32), ".hada_w1_b": _r(2, 4), ".hada_t1": _r(3, 2, 3, 3),
                                 ".hada_w2_a": _r(2, 32), ".hada_w2_b": _r(2, 4), ".hada_t2": _r(2, 2, 3, 3)},
                                "not a Tucker LoHa"),
    "lokr_t2 on a whole w2": ({".lokr_w1": _r(4, 2), ".lokr_w2": _r(8, 2, 3, 3), ".lokr_t2": _r(2, 2, 3, 3)},
                              "not a Tucker LoKr"),
    "Tucker kernel of another size": ({".lora_down.weight": _r(2, 4, 1, 1), ".lora_mid.weight": _r(2, 2, 5, 5),
                                       ".lora_up.weight": _r(32, 2, 1, 1)}, "does not fit layer 'conv_in'"),
    "column dora_scale of another width": ({".lora_down.weight": _r(2, 4, 3, 3), ".lora_up.weight": _r(32, 2, 1, 1),
                                            ".dora_scale": _r(1, 5, 1, 1) + 1}, "wd_on_out=False"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_tucker_and_dora_are_one_line(unet_twin, tmp_path, case):
    tensors, needle = BAD[case]
    path = save(tmp_path / "bad.safetensors", {LAYER + k: v for k, v in tensors.items()})
    args = unet.ModelArgs.from_dict(dict(unet_twin[0].config))
    with pytest.raises(MlxdiffError) as e:
        lora.check(SimpleNamespace(name="unet", arch=unet, args=args), path)
    message = str(e.value)
    print(message)
    assert "\n" not in message and needle in message and str(path) in message and LAYER in message
