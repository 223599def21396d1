"""LoRAs on the UNet family (SD 1.5 / SDXL) against diffusers: tiny random UNets and CLIP text encoders (the
configs of tests/test_unet.py and tests/test_clip.py), random LoRA files written as kohya's sd-scripts names them
(lora_unet_ / lora_te_ / lora_te1_ / lora_te2_, lora_down / lora_up / .alpha; a LoCon: 3x3 convolutions as 4-D
down (rank, in, 3, 3) and up (out, rank, 1, 1) factors, SD 1.5's 1x1-conv projections as 4-D 1x1 pairs) and as
diffusers' training scripts write them (PEFT on the torch models, get_peft_model_state_dict, save_lora_weights with
the LoraConfig as metadata, unet.* / text_encoder.* / text_encoder_2.*). The reference is diffusers' own loader:
StableDiffusion(XL)LoraLoaderMixin.load_lora_weights on the torch twins (which converts kohya's names itself: that it
accepts every layer of these files proves their naming), set_adapters for the scales; the UNet's noise prediction
and every text-encoder hidden state must agree within 1e-4 (float32) with mlxdiff's models after lora.components,
lora.check and lora.apply_loras, as Pipeline.load_lora runs them."""

import copy
import re
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import mlxdiff  # noqa: F401  (OpenBLAS preload before mlx)
import mlx.core as mx
import mlx.nn as nn

import fixture_guard
from helpers import max_rel_err, randomize_
from lora_helpers import save
from mlxdiff import lora
from mlxdiff.errors import MlxdiffError
from mlxdiff.models import clip, unet
from ldm_helpers import CLIPS, UNETS, unet_inputs as inputs

TOL = 1e-4
# family -> {component: CLIP config}, and kohya's prefix of each component
ENCODERS = {"sd15": {"text_encoder": "L"}, "sdxl": {"text_encoder": "L", "text_encoder_2": "G"},
            "sgm": {"text_encoder": "L", "text_encoder_2": "G"}}
KOHYA = {"sd15": {"unet": "lora_unet_", "text_encoder": "lora_te_"},
         "sdxl": {"unet": "lora_unet_", "text_encoder": "lora_te1_", "text_encoder_2": "lora_te2_"}}
KOHYA["sgm"] = KOHYA["sdxl"]
UNET_TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "proj_in", "proj_out", "ff.net.0.proj", "ff.net.2", "conv1",
                "conv2", "conv_shortcut", "time_emb_proj", "linear_1", "linear_2", "conv_in", "conv_out"]
TE_TARGETS = ["q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2"]


# -- the models: torch twins and mlxdiff's, the same weights --------------------------------------------------------

@pytest.fixture(autouse=True)
def bases_unchanged(request):
    """Fixtures are immutable: the tests load LoRAs onto copies (diffusers_with, the dequantized twins); after each
    test the shared torch twins are as built (fixture_guard: weights, adapters, hooks)."""
    yield from fixture_guard.unchanged(request, ["bases"])


@pytest.fixture(scope="module")
def bases():
    """family -> {component: torch model} (random, eval)."""
    from diffusers import UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection
    out = {}
    for family, encoders in ENCODERS.items():
        torch.manual_seed(0)
        models = {"unet": randomize_(UNet2DConditionModel(**UNETS[family]["config"]), seed=1, scale=0.1).eval()}
        for i, (name, which) in enumerate(encoders.items()):
            cls = CLIPTextModel if which == "L" else CLIPTextModelWithProjection
            models[name] = randomize_(cls(CLIPTextConfig(**CLIPS[which])), seed=2 + i).eval()
        out[family] = models
    return out


def arch_args(name, torch_model):
    if name == "unet":
        return unet, unet.ModelArgs.from_dict(dict(torch_model.config))
    which = "L" if not hasattr(torch_model, "text_projection") else "G"
    return clip, clip.ModelArgs.from_dict({**CLIPS[which], "architectures": [type(torch_model).__name__]})


def ours_model(name, torch_model):
    arch, args = arch_args(name, torch_model)
    model = arch.Model(args)
    weights = {k: mx.array(v.detach().numpy()) for k, v in torch_model.state_dict().items()}
    model.load_weights(list(model.sanitize(weights).items()), strict=True)
    return model


def run_torch(models, family):
    x, out = inputs(family), {}
    with torch.no_grad():
        added = {k: torch.from_numpy(v) for k, v in x["added"].items()} if "added" in x else None
        out["unet"] = [models["unet"](torch.from_numpy(x["sample"]), torch.from_numpy(x["timestep"]),
                                      torch.from_numpy(x["context"]), added_cond_kwargs=added).sample.numpy()]
        for name, which in ENCODERS[family].items():
            o = models[name](torch.from_numpy(x["ids"][which]), output_hidden_states=True)
            out[name] = [h.numpy() for h in o.hidden_states] + [o.last_hidden_state.numpy()]
            if which == "G":
                out[name].append(o.text_embeds.numpy())
    return out


def run_ours(models, family):
    x, out = inputs(family), {}
    added = {k: mx.array(v) for k, v in x["added"].items()} if "added" in x else None
    out["unet"] = [np.array(models["unet"](mx.array(x["sample"]), mx.array(x["timestep"]), mx.array(x["context"]),
                                           added))]
    for name, which in ENCODERS[family].items():
        o = models[name](x["ids"][which])
        out[name] = [np.array(h) for h in o.hidden_states] + [np.array(o.last_hidden_state)]
        if which == "G":
            out[name].append(np.array(o.text_embeds))
    return out


def diffusers_with(bases, family, loras):
    """The torch twins (copies) with `loras` [(file, scale)] loaded by diffusers' own LoRA loader."""
    from diffusers.loaders.lora_pipeline import StableDiffusionLoraLoaderMixin, StableDiffusionXLLoraLoaderMixin

    class Pipeline(StableDiffusionLoraLoaderMixin if family == "sd15" else StableDiffusionXLLoraLoaderMixin):
        components = {}          # what load_lora_weights needs of a pipeline: its models
        hf_device_map = None

        def __init__(self, models):
            vars(self).update(models)

    from diffusers.utils.peft_utils import set_weights_and_activate_adapters
    models = {k: copy.deepcopy(m) for k, m in bases[family].items()}
    pipe = Pipeline(models)
    for i, (path, _) in enumerate(loras):
        pipe.load_lora_weights(str(path), adapter_name=f"l{i}")
    for model in models.values():   # pipe.set_adapters with numbers (its UNet scale expansion cannot read the
        set_weights_and_activate_adapters(model, [f"l{i}" for i in range(len(loras))], [s for _, s in loras])
        # per-level layers_per_block of the SDXL-like config)
    return models


def lora_layers(models, ours) -> dict:
    """{component: how many of its layers have LoRAs} (diffusers': PEFT's wrapped layers; ours: LoRALinear)."""
    if ours:
        return {k: sum(isinstance(m, lora.LoRALinear) for m in model.modules()) for k, model in models.items()}
    return {k: sum(hasattr(m, "lora_A") and bool(m.lora_A) for m in model.modules()) for k, model in models.items()}


def ours_with(bases, family, loras, models=None):
    """mlxdiff's models (of the same weights) with `loras` applied as Pipeline.load_lora does it: each file's
    components must be the pipeline's, checked against each component's spec, then applied at build."""
    models = models or {k: ours_model(k, m) for k, m in bases[family].items()}
    for path, scale in loras:
        assert set(lora.components(path)) <= set(models), lora.components(path)
        for name in lora.components(path):
            arch, args = arch_args(name, bases[family][name])
            lora.check(SimpleNamespace(name=name, arch=arch, args=args), path, scale)
    for name, model in models.items():
        lora.apply_loras(model, arch_args(name, bases[family][name])[0], loras, component=name)
    return models


def compare(bases, family, loras, what, ours=None, reference_bases=None):
    """diffusers' and mlxdiff's models with `loras`: LoRAs on as many layers of each component (every layer the
    files name: diffusers drops none, as it warns of keys it cannot place), every output within TOL of diffusers',
    and the LoRAs visibly change it (the base's outputs differ)."""
    reference_bases = reference_bases or bases
    ref_models = diffusers_with(reference_bases, family, loras)
    ours = ours_with(bases, family, loras, ours)
    counts = lora_layers(ref_models, False)
    assert lora_layers(ours, True) == counts and all(counts.values()), (lora_layers(ours, True), counts)
    assert_matches(run_ours(ours, family), run_torch(ref_models, family), run_torch(reference_bases[family], family),
                   what)
    return ours


def assert_matches(ours, ref, base, what):
    for name in ref:
        for i, (o, r, b) in enumerate(zip(ours[name], ref[name], base[name])):
            if i == 0 and name != "unet":
                continue   # the token embeddings: no LoRA there
            err = max_rel_err(o, r)
            print(f"{what} {name}[{i}]: max rel err {err:.2e}, LoRA's change {max_rel_err(b, r):.2e}")
            assert err <= TOL, (what, name, i, err)
            assert max_rel_err(b, r) > 100 * TOL, (what, name, i, "the LoRA changes nothing")


# -- LoRA files -------------------------------------------------------------------------------------------------

def kohya_locon(bases, family, path, seed, rank=4, conv_rank=3, alpha=2.0, conv_alpha=1.0, scale=0.15,
                rename=None):
    """Every Linear and Conv2d of the UNet (LyCORIS' reach: sd-scripts' and conv_in / conv_out / time and add
    embeddings) and the text encoders' attention and MLP layers, as sd-scripts (networks/lora.py with conv_dim)
    saves them: lora_down (rank, in[, kh, kw]), lora_up (out, rank[, 1, 1]), .alpha per layer (float32: network_alpha,
    conv_alpha on the 3x3 convolutions; one alpha per kind, as sd-scripts trains: diffusers' converter reads the
    attention layers' own .alpha wrongly and gives them the most common one), CLIP in transformers 4's names
    (text_model_encoder_layers_...)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, prefix in KOHYA[family].items():
        for module, m in bases[family][name].named_modules():
            a = alpha
            if isinstance(m, torch.nn.Linear):
                down, up = (rank, m.in_features), (m.out_features, rank)
            elif isinstance(m, torch.nn.Conv2d):
                r, a = (conv_rank, conv_alpha) if m.kernel_size != (1, 1) else (rank, alpha)
                down, up = (r, m.in_channels, *m.kernel_size), (m.out_channels, r, 1, 1)
            else:
                continue
            if name != "unet":   # sd-scripts' CLIP layers: attention and MLP, in transformers 4's names
                if ".layers." not in module:
                    continue
                module = module if module.startswith("text_model.") else "text_model." + module
            elif rename:
                module = rename(module)
            elif module.startswith("add_embedding"):
                continue   # diffusers' converter cannot read it in these names (SDXL's kohya files say label_emb)
            key = prefix + module.replace(".", "_")
            out[f"{key}.lora_down.weight"] = torch.randn(down, generator=g) * scale
            out[f"{key}.lora_up.weight"] = torch.randn(up, generator=g) * scale
            out[f"{key}.alpha"] = torch.tensor(a)
    return save(path, out)


def peft_file(bases, family, path, seed, rank=4, alpha=6.0):
    """The diffusers training scripts' file: PEFT adapters on copies of the torch models (conv layers included,
    init_lora_weights=False: random A and B; rank_pattern / alpha_pattern on some layers),
    get_peft_model_state_dict, save_lora_weights with each LoraConfig as its lora_adapter_metadata."""
    from diffusers.loaders.lora_pipeline import StableDiffusionLoraLoaderMixin, StableDiffusionXLLoraLoaderMixin
    from peft import LoraConfig, inject_adapter_in_model
    from peft.utils import get_peft_model_state_dict
    torch.manual_seed(seed)
    layers, metadata = {}, {}
    for name, model in bases[family].items():
        model = copy.deepcopy(model)
        targets = UNET_TARGETS if name == "unet" else TE_TARGETS
        config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, init_lora_weights=False,
                            rank_pattern={"conv2": 2, "fc1": 3}, alpha_pattern={"to_k": 1.5, "conv_in": 5.0})
        inject_adapter_in_model(config, model)
        layers[f"{name}_lora_layers"] = get_peft_model_state_dict(model)
        metadata[f"{name}_lora_adapter_metadata"] = config.to_dict()
    mixin = StableDiffusionLoraLoaderMixin if family == "sd15" else StableDiffusionXLLoraLoaderMixin
    mixin.save_lora_weights(str(path.parent), weight_name=path.name, **layers, **metadata)
    return path


@pytest.mark.parametrize("family", ["sd15", "sdxl"])
def test_kohya_locon_matches_diffusers(bases, family, tmp_path):
    """A kohya LoCon on every layer (convolutions 3x3 and 1x1, time / add embeddings, attention, ff, proj_in/out)
    and on every text-encoder layer, at scale 0.8: diffusers' loader and mlxdiff's agree."""
    path = kohya_locon(bases, family, tmp_path / "locon.safetensors", seed=3)
    assert lora.components(path) == sorted(["unet", *ENCODERS[family]])
    compare(bases, family, [(path, 0.8)], f"{family} kohya")


@pytest.mark.parametrize("family", ["sd15", "sdxl"])
def test_two_loras_peft_and_kohya_with_scales(bases, family, tmp_path):
    """A diffusers/PEFT file (unet.* / text_encoder.* [/ text_encoder_2.*], metadata with rank and alpha patterns)
    at 0.7 together with a kohya LoCon at -0.45: both stack on the same layers, each at its own scale."""
    peft = peft_file(bases, family, tmp_path / "peft.safetensors", seed=4)
    names = __import__("safetensors").safe_open(str(peft), "pt").keys()
    assert any(k.startswith("unet.") for k in names) and any(k.startswith("text_encoder.") for k in names)
    kohya = kohya_locon(bases, family, tmp_path / "locon.safetensors", seed=5, rank=2, conv_rank=2)
    compare(bases, family, [(peft, 0.7), (kohya, -0.45)], f"{family} peft+kohya")


def test_quantized_base_matches_diffusers_on_its_dequantized_weights(bases, tmp_path):
    """SDXL's UNet and text encoders affine-quantized (4 bits, group 32: the linear layers whose width allows it;
    the LoRA wraps the quantized layer, never dequantizing it) with a kohya LoCon: the same as diffusers' LoRA on a
    torch model holding the dequantized weights."""
    family = "sdxl"
    path = kohya_locon(bases, family, tmp_path / "locon.safetensors", seed=6)
    models = {k: ours_model(k, m) for k, m in bases[family].items()}
    dequantized = {k: copy.deepcopy(m) for k, m in bases[family].items()}
    quantized = 0
    for name, model in models.items():
        nn.quantize(model, group_size=32, bits=4,
                    class_predicate=lambda p, m: isinstance(m, nn.Linear) and m.weight.shape[1] % 32 == 0)
        state = dequantized[name].state_dict()
        for p, m in model.named_modules():
            if isinstance(m, nn.QuantizedLinear):
                w = mx.dequantize(m.weight, m.scales, m.biases, group_size=32, bits=4)
                state[p + ".weight"].copy_(torch.from_numpy(np.array(w)))
                quantized += 1
    assert quantized > 20
    ours = compare(bases, family, [(path, 1.0)], "sdxl 4-bit", models, {family: dequantized})
    wrapped = [m for model in ours.values() for m in model.modules() if isinstance(m, lora.LoRALinear)]
    assert sum(isinstance(m.base, nn.QuantizedLinear) for m in wrapped) > 20


# -- what is refused, in one line ------------------------------------------------------------------------------------

def refusal(bases, family, name, path):
    arch, args = arch_args(name, bases[family][name])
    with pytest.raises(MlxdiffError) as e:
        lora.check(SimpleNamespace(name=name, arch=arch, args=args), path)
    message = str(e.value)
    assert "\n" not in message and str(path) in message, message
    return message


def pair(rows, cols, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(4, cols, generator=g), torch.randn(rows, 4, generator=g)


def test_refusals_are_one_line(bases, tmp_path):
    a, b = pair(64, 64)
    sd3 = save(tmp_path / "sd3.safetensors", {"lora_unet_joint_blocks_0_x_block_attn_qkv.lora_down.weight": a,
                                              "lora_unet_joint_blocks_0_x_block_attn_qkv.lora_up.weight": b})
    assert lora.components(sd3) == ["transformer"]
    assert "a LoRA for SD3" in refusal(bases, "sd15", "unet", sd3)
    flux2 = save(tmp_path / "flux2.safetensors",
                 {"transformer.single_transformer_blocks.0.attn.to_qkv_mlp_proj.lora_A.weight": a,
                  "transformer.single_transformer_blocks.0.attn.to_qkv_mlp_proj.lora_B.weight": b})
    assert "a LoRA for FLUX.2" in refusal(bases, "sdxl", "unet", flux2)
    # an SDXL LoRA on SD 1.5: its layers do not fit (another width, another layout)
    sdxl = kohya_locon(bases, "sdxl", tmp_path / "sdxl.safetensors", seed=7)
    assert "another model" in refusal(bases, "sd15", "unet", sdxl)
    # and the other way round
    sd15 = kohya_locon(bases, "sd15", tmp_path / "sd15.safetensors", seed=7)
    assert "another model" in refusal(bases, "sdxl", "unet", sd15)
    # a 3x3 LoCon pair on a linear layer, a linear pair on a 3x3 convolution
    c = torch.randn(2, 32, 3, 3)
    wrong = save(tmp_path / "conv_on_linear.safetensors", {
        "lora_unet_time_embedding_linear_1.lora_down.weight": c,
        "lora_unet_time_embedding_linear_1.lora_up.weight": torch.randn(128, 2, 1, 1)})
    assert "do not fit" in refusal(bases, "sd15", "unet", wrong)
    wrong = save(tmp_path / "linear_on_conv.safetensors", {
        "lora_unet_conv_in.lora_down.weight": torch.randn(2, 4), "lora_unet_conv_in.lora_up.weight": b[:32, :2]})
    assert "do not fit" in refusal(bases, "sd15", "unet", wrong)
    # LoCon's Tucker form is read (tests/test_lycoris_tucker.py); one whose core is not rank x rank is not
    tucker = save(tmp_path / "tucker.safetensors", {
        "lora_unet_conv_in.lora_down.weight": torch.randn(2, 4, 1, 1),
        "lora_unet_conv_in.lora_mid.weight": torch.randn(3, 2, 3, 3),
        "lora_unet_conv_in.lora_up.weight": torch.randn(32, 2, 1, 1)})
    assert "Tucker" in refusal(bases, "sd15", "unet", tucker)


def test_sgm_names_on_uneven_levels_are_refused(bases, tmp_path):
    """kohya's SDXL names (SGM's input_blocks / middle_block / output_blocks): the UNet component, read through
    models/unet.py's original-name table, refused in one line while it has none."""
    a, b = pair(48, 48)
    key = "lora_unet_input_blocks_4_1_transformer_blocks_0_attn1_to_q"
    path = save(tmp_path / "sgm.safetensors", {f"{key}.lora_down.weight": a, f"{key}.lora_up.weight": b})
    assert lora.components(path) == ["unet"]
    assert "SGM" in refusal(bases, "sdxl", "unet", path)   # (levels of 1 and 2 layers: no flat numbering)


def sgm(name, layers=2):
    """SGM's (kohya's SDXL) name of a diffusers UNet layer, for a UNet of `layers` resnets on each level whose first
    up level has attentions (the "sgm" config)."""
    top = {"time_embedding.linear_1": "time_embed.0", "time_embedding.linear_2": "time_embed.2",
           "add_embedding.linear_1": "label_emb.0.0", "add_embedding.linear_2": "label_emb.0.2",
           "conv_in": "input_blocks.0.0", "conv_out": "out.2"}
    if name in top:
        return top[name]
    resnet = {"conv1": "in_layers.2", "time_emb_proj": "emb_layers.1", "conv2": "out_layers.3",
              "conv_shortcut": "skip_connection"}
    blocks, level, part, j, rest = re.fullmatch(r"(\w+?)\.(?:(\d+)\.)?(\w+)\.(\d+)\.(.+)", name).groups()
    j, rest = int(j), (resnet[rest] if part == "resnets" else rest)
    if blocks == "mid_block":
        return f"middle_block.{1 if part == 'attentions' else 2 * j}.{rest}"
    level = int(level)
    if blocks == "down_blocks":
        if part == "downsamplers":
            return f"input_blocks.{1 + level * (layers + 1) + layers}.0.op"
        return f"input_blocks.{1 + level * (layers + 1) + j}.{0 if part == 'resnets' else 1}.{rest}"
    if part == "upsamplers":
        return f"output_blocks.{level * (layers + 1) + layers}.{2 if level == 0 else 1}.conv"
    return f"output_blocks.{level * (layers + 1) + j}.{0 if part == 'resnets' else 1}.{rest}"


def test_kohya_sdxl_sgm_names_match_diffusers(bases, tmp_path):
    """kohya's SDXL LoCon in SGM's names (lora_unet_input_blocks_4_1_transformer_blocks_0_attn1_to_q,
    middle_block, output_blocks, label_emb, the resnets' in_layers / out_layers / emb_layers / skip_connection, the
    samplers' op / conv) through models/unet.py's original-name table, against diffusers' own SGM mapping."""
    path = kohya_locon(bases, "sgm", tmp_path / "sgm.safetensors", seed=8, rename=sgm)
    assert lora.components(path) == ["text_encoder", "text_encoder_2", "unet"]
    compare(bases, "sgm", [(path, 0.9)], "sgm")


# -- through the pipeline: mlxdiff.load(loras=) against diffusers' pipeline with load_lora_weights --------------------

@pytest.mark.parametrize("family", ["sd15", "sdxl"])
def test_lora_through_the_pipeline_matches_diffusers(family, tmp_path):
    """A kohya LoCon (UNet and text encoders) at scale 0.8 on the tiny pipelines of tests/ldm_helpers.py:
    mlxdiff.load(folder, loras=[(file, 0.8)]) against diffusers' pipeline with load_lora_weights and the adapter at
    0.8, from the same noise: final latents within 1e-4, image within 2 levels (tests/parity.py); the LoRA scale
    (0.8 -> 0.4) and the prompt each move diffusers' result by more than that."""
    import diffusers
    from ldm_helpers import reference, sd15_components, sdxl_components, showing_moves
    from parity import IMAGE_LEVELS, LATENT_TOL, assert_inputs_matter, levels
    from diffusers.utils.peft_utils import set_weights_and_activate_adapters
    cls = diffusers.StableDiffusionXLPipeline if family == "sdxl" else diffusers.StableDiffusionPipeline
    parts = sdxl_components() if family == "sdxl" else sd15_components()
    folder = tmp_path / family
    cls(**parts).save_pretrained(str(folder))
    path = kohya_locon({family: {k: parts[k] for k in KOHYA[family]}}, family, tmp_path / "locon.safetensors", seed=3,
                       scale=0.1)
    pipe = cls.from_pretrained(str(folder), **({} if family == "sdxl" else dict(safety_checker=None,
                                                                                 requires_safety_checker=False)))
    pipe.load_lora_weights(str(path), adapter_name="locon")
    h, w, steps, guidance = 48, 40, 3, 4.0
    noise = np.random.default_rng(6).standard_normal((1, 4, h // 4, w // 4)).astype(np.float32)

    def run(lora_scale, **kw):
        for name in KOHYA[family]:      # pipe.set_adapters: it cannot expand a scale over per-level layer counts
            set_weights_and_activate_adapters(getattr(pipe, name), ["locon"], [lora_scale])
        return reference(pipe, height=h, width=w, num_inference_steps=steps, guidance_scale=guidance,
                         latents=torch.tensor(noise), **kw)
    ref_latents, ref_image = assert_inputs_matter(showing_moves(f"{family} lora", run), dict(
        prompt="a red fox", lora_scale=0.8), {"the LoRA scale": {"lora_scale": 0.4},
                                               "the prompt": {"prompt": "a blue boat on a lake"}})
    ours = mlxdiff.load(str(folder), loras=[(str(path), 0.8)]).generate(
        "a red fox", width=w, height=h, steps=steps, guidance=guidance, latents=noise, progress_bar=False)
    err, shift = max_rel_err(ours.latents, ref_latents), levels(ours.image, ref_image)
    print(f"{family} lora pipeline: latents max_rel_err {err:.1e}, image {shift} levels")
    assert err <= LATENT_TOL and shift <= IMAGE_LEVELS, (err, shift)
