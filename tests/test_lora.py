"""LoRA (mlxdiff/lora/) on the SD3.5 and FLUX.2 transformers, against diffusers' own LoRA loading on the same
files, float32, tiny configs:

- files written the way the tools write them: diffusers/PEFT (`add_adapter(LoraConfig)` ->
  `get_peft_model_state_dict` -> `save_lora_weights`, alpha in the header's lora_adapter_metadata), kohya
  (`lora_unet_<original name with underscores>.lora_down/lora_up/.alpha`, fused qkv as one layer) and BFL-named
  FLUX.2 (`diffusion_model.double_blocks.N.img_attn.qkv.lora_A.weight`, ...);
- transformer outputs within 1e-4 and whole pipelines' images within 2/255 of diffusers with the same LoRA; two
  LoRAs at once with their own scales; a GGUF Q4_K_M base against diffusers' GGUF transformer within 2/255, whose
  resident memory grows by the LoRA's own bytes only;
- bad input in one line: unknown layer, wrong shape, another architecture's LoRA, text-encoder LoRAs, a missing
  file, a bad --lora FILE:SCALE (exit 2).
"""

import copy
import json

import numpy as np
import pytest
import torch

import mlxdiff
import mlx.core as mx
from helpers import load_ours, max_rel_err, randomize_
from mlxdiff import lora
from mlxdiff.errors import MlxdiffError
from mlxdiff.models import flux2, mmdit
from twins import H, SEQ, TAPS, W, build_pipeline

RANK = 4

# -- writing LoRA files as the tools do ----------------------------------------------------------------------------

FLUX2_TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out",
                 "ff.linear_in", "ff.linear_out", "ff_context.linear_in", "ff_context.linear_out",
                 "to_qkv_mlp_proj", "single_transformer_blocks.0.attn.to_out",
                 "single_transformer_blocks.1.attn.to_out"]
SD3_TARGETS = ["attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "attn.add_q_proj", "attn.add_k_proj",
               "attn.add_v_proj", "attn.to_add_out", "attn2.to_q", "attn2.to_out.0", "ff.net.0.proj", "ff.net.2",
               "ff_context.net.0.proj", "norm1.linear", "norm1_context.linear", "norm_out.linear", "proj_out"]


def peft_adapter(model, targets, seed, alpha=8, scale=0.1, rslora=False):
    """(PEFT state dict, LoraConfig dict) of a seeded random LoRA on a copy of the torch `model`."""
    from peft import LoraConfig, inject_adapter_in_model
    from peft.utils import get_peft_model_state_dict
    config = LoraConfig(r=RANK, lora_alpha=alpha, target_modules=targets, init_lora_weights=False,
                        use_rslora=rslora)
    model = inject_adapter_in_model(config, copy.deepcopy(model))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * scale)
    return get_peft_model_state_dict(model), model.peft_config["default"].to_dict()


def peft_file(transformer, pipeline_class, targets, folder, seed, alpha=8, scale=0.1, rslora=False, **others):
    """A diffusers/PEFT LoRA of `transformer` (a torch model; not modified) saved by pipeline_class.save_lora_weights
    under `folder` (with `others`: text_encoder=(model, targets), ... as well); returns the file."""
    state, config = peft_adapter(transformer, targets, seed, alpha, scale, rslora)
    kw = dict(transformer_lora_layers=state, transformer_lora_adapter_metadata=config)
    for i, (name, (model, names)) in enumerate(others.items()):
        kw[f"{name}_lora_layers"], kw[f"{name}_lora_adapter_metadata"] = peft_adapter(model, names, seed + i + 1,
                                                                                     alpha=RANK * 3, scale=scale)
    pipeline_class.save_lora_weights(str(folder), **kw)
    return folder / "pytorch_lora_weights.safetensors"


def save(tensors, path, metadata=None):
    from safetensors.torch import save_file
    save_file({k: v.clone().contiguous() for k, v in tensors.items()}, str(path), metadata=metadata)
    return path


def random_pair(g, rows, cols, rank=RANK, scale=0.1):
    return torch.randn(rank, cols, generator=g) * scale, torch.randn(rows, rank, generator=g) * scale


def kohya_named(g, layers, alpha):
    """A random LoRA as kohya's trainers write it: lora_unet_<layer>.lora_down / lora_up / alpha for each
    {layer: (rows, cols)}."""
    out = {}
    for name, (rows, cols) in layers.items():
        down, up = random_pair(g, rows, cols)
        out[f"lora_unet_{name}.lora_down.weight"] = down
        out[f"lora_unet_{name}.lora_up.weight"] = up
        out[f"lora_unet_{name}.alpha"] = torch.tensor(alpha)
    return out


def flux2_kohya_tensors(cfg, seed, alpha=2.0):
    """{kohya name: tensor} (BFL layer names, dots as underscores, fused qkv) for a FLUX.2 config, as kohya's
    sd-scripts (networks/lora_flux2) writes them: lora_down (rank, in), lora_up (out, rank), alpha."""
    g = torch.Generator().manual_seed(seed)
    dim = cfg["num_attention_heads"] * cfg["attention_head_dim"]
    mlp = int(dim * cfg["mlp_ratio"])
    layers = {}
    for i in range(cfg["num_layers"]):
        for s in ("img", "txt"):
            layers[f"double_blocks_{i}_{s}_attn_qkv"] = (3 * dim, dim)
            layers[f"double_blocks_{i}_{s}_attn_proj"] = (dim, dim)
            layers[f"double_blocks_{i}_{s}_mlp_0"] = (2 * mlp, dim)
            layers[f"double_blocks_{i}_{s}_mlp_2"] = (dim, mlp)
    for i in range(cfg["num_single_layers"]):
        layers[f"single_blocks_{i}_linear1"] = (3 * dim + 2 * mlp, dim)
        layers[f"single_blocks_{i}_linear2"] = (dim, dim + mlp)
    return kohya_named(g, layers, alpha)


def kohya_to_bfl(tensors):
    """The same LoRA in BFL names with the ai-toolkit prefix and lora_A/lora_B, alpha baked into lora_B."""
    out = {}
    for key, value in tensors.items():
        if not key.endswith(".lora_down.weight"):
            continue
        name = key[len("lora_unet_"):-len(".lora_down.weight")]
        up = tensors[f"lora_unet_{name}.lora_up.weight"]
        scale = float(tensors[f"lora_unet_{name}.alpha"]) / value.shape[0]
        dotted = (name.replace("double_blocks_", "double_blocks.").replace("single_blocks_", "single_blocks.")
                  .replace("_img_", ".img_").replace("_txt_", ".txt_").replace("_linear", ".linear")
                  .replace("attn_qkv", "attn.qkv").replace("attn_proj", "attn.proj").replace("mlp_", "mlp."))
        out[f"diffusion_model.{dotted}.lora_A.weight"] = value
        out[f"diffusion_model.{dotted}.lora_B.weight"] = up * scale
    return out


def bfl_to_peft(tensors):
    """BFL-named lora_A/lora_B -> diffusers/PEFT names (fused qkv: A shared, B split by rows)."""
    out = {}
    for key, value in tensors.items():
        name, role = key[len("diffusion_model."):].rsplit(".lora_", 1)
        parts = name.split(".")
        if parts[0] == "double_blocks":
            block = f"transformer_blocks.{parts[1]}."
            rest = ".".join(parts[2:])
            if rest.endswith("attn.qkv"):
                names = (["attn.to_q", "attn.to_k", "attn.to_v"] if rest.startswith("img")
                         else ["attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"])
                pieces = [value] * 3 if role.startswith("A") else list(value.chunk(3))
                for n, piece in zip(names, pieces):
                    out[f"transformer.{block}{n}.lora_{role}"] = piece
                continue
            target = {"img_attn.proj": "attn.to_out.0", "txt_attn.proj": "attn.to_add_out",
                      "img_mlp.0": "ff.linear_in", "img_mlp.2": "ff.linear_out",
                      "txt_mlp.0": "ff_context.linear_in", "txt_mlp.2": "ff_context.linear_out"}[rest]
        else:
            block = f"single_transformer_blocks.{parts[1]}."
            target = {"linear1": "attn.to_qkv_mlp_proj", "linear2": "attn.to_out"}[parts[2]]
        out[f"transformer.{block}{target}.lora_{role}"] = value
    return out


# -- FLUX.2 transformer --------------------------------------------------------------------------------------------

FLUX2_CFG = dict(patch_size=1, in_channels=20, out_channels=None, num_layers=2, num_single_layers=2,
                 attention_head_dim=16, num_attention_heads=3, joint_attention_dim=28, timestep_guidance_channels=32,
                 mlp_ratio=2.5, axes_dims_rope=(4, 4, 4, 4), rope_theta=2000, eps=1e-6, guidance_embeds=True)


@pytest.fixture(scope="module")
def flux2_twin(tmp_path_factory):
    from diffusers import Flux2Transformer2DModel
    model = randomize_(Flux2Transformer2DModel(**FLUX2_CFG), seed=3, scale=0.15).eval()
    folder = tmp_path_factory.mktemp("lora_flux2")
    model.save_pretrained(str(folder / "transformer"))
    return model, folder


def flux2_inputs(seed=0, grid=(3, 5), text_len=6, cfg=FLUX2_CFG):
    from diffusers import Flux2Pipeline
    rng = np.random.default_rng(seed)
    img_ids = Flux2Pipeline._prepare_latent_ids(torch.zeros(1, 1, *grid))
    text = rng.standard_normal((1, text_len, cfg["joint_attention_dim"])).astype(np.float32)
    inputs = dict(hidden_states=rng.standard_normal((1, grid[0] * grid[1], cfg["in_channels"])).astype(np.float32),
                  encoder_hidden_states=text, timestep=np.array([0.7], np.float32),
                  img_ids=img_ids.numpy(), txt_ids=Flux2Pipeline._prepare_text_ids(torch.from_numpy(text)).numpy())
    if cfg["guidance_embeds"]:
        inputs["guidance"] = np.array([3.5], np.float32)
    return inputs


def torch_forward(model, inputs):
    with torch.no_grad():
        return model(**{k: torch.from_numpy(v) for k, v in inputs.items()}, return_dict=False)[0].numpy()


def mlx_forward(model, inputs):
    return np.array(model(**{k: mx.array(v) for k, v in inputs.items()}).astype(mx.float32))


def with_diffusers_loras(transformer, pipeline_class, files_scales):
    """A copy of the torch transformer with each (file, scale) loaded by diffusers (pipeline_class.lora_state_dict:
    its format conversions; load_lora_adapter; set_adapters with the scales)."""
    model = copy.deepcopy(transformer)
    names = []
    for i, (file, _) in enumerate(files_scales):
        state, meta = pipeline_class.lora_state_dict(str(file), return_lora_metadata=True)
        model.load_lora_adapter(state, prefix="transformer", adapter_name=f"l{i}", metadata=meta)
        names.append(f"l{i}")
    model.set_adapters(names, weights=[s for _, s in files_scales])
    return model.eval()


def ours_with(folder, arch, files_scales):
    model = load_ours(folder, arch)
    return lora.apply_loras(model, arch, files_scales)


def test_flux2_peft_and_kohya_match_diffusers(flux2_twin, tmp_path):
    """PEFT (alpha 8 / rank 4 from the metadata) and kohya (alpha 2 from .alpha keys, fused qkv) files, each alone
    and both at once with their own scales: the transformer output within 1e-4 of diffusers with the same files."""
    from diffusers import Flux2Pipeline
    model, folder = flux2_twin
    peft = peft_file(model, Flux2Pipeline, FLUX2_TARGETS, tmp_path / "peft", seed=1)
    kohya = save(flux2_kohya_tensors(FLUX2_CFG, seed=2), tmp_path / "kohya.safetensors")
    inputs = flux2_inputs()
    base = torch_forward(model, inputs)
    for files in ([(peft, 1.0)], [(kohya, 1.0)], [(peft, 0.7), (kohya, -0.6)]):
        ref = torch_forward(with_diffusers_loras(model, Flux2Pipeline, files), inputs)
        ours = mlx_forward(ours_with(folder / "transformer", flux2, files), inputs)
        err = max_rel_err(ours, ref)
        print(f"{[f.name for f, _ in files]}: max_rel_err {err:.2e}, moved by the LoRA {max_rel_err(ref, base):.2e}")
        assert err <= 1e-4
        assert max_rel_err(ref, base) > 1e-2      # the LoRA matters


def test_flux2_bfl_names_equal_peft_form(flux2_twin, tmp_path):
    """A BFL-named LoRA (ai-toolkit's `diffusion_model.` + BFL layers, fused qkv) gives the same output as the same
    LoRA in diffusers/PEFT names (A shared by q, k, v; B split by rows)."""
    model, folder = flux2_twin
    bfl = kohya_to_bfl(flux2_kohya_tensors(FLUX2_CFG, seed=4))
    bfl_file = save(bfl, tmp_path / "bfl.safetensors")
    peft_form = save(bfl_to_peft(bfl), tmp_path / "peft_form.safetensors")
    inputs = flux2_inputs(1)
    a = mlx_forward(ours_with(folder / "transformer", flux2, [(bfl_file, 0.8)]), inputs)
    b = mlx_forward(ours_with(folder / "transformer", flux2, [(peft_form, 0.8)]), inputs)
    assert max_rel_err(a, b) <= 1e-6
    assert max_rel_err(a, mlx_forward(load_ours(folder / "transformer", flux2), inputs)) > 1e-2


# -- SD3.5 transformer ---------------------------------------------------------------------------------------------

SD3_CFG = dict(sample_size=16, patch_size=2, in_channels=16, num_layers=3, attention_head_dim=8, num_attention_heads=3,
               joint_attention_dim=40, caption_projection_dim=24, pooled_projection_dim=36, out_channels=16,
               pos_embed_max_size=20, dual_attention_layers=(0,), qk_norm="rms_norm")


@pytest.fixture(scope="module")
def sd3_twin(tmp_path_factory):
    from diffusers import SD3Transformer2DModel
    model = randomize_(SD3Transformer2DModel(**SD3_CFG), seed=5, scale=0.15).eval()
    folder = tmp_path_factory.mktemp("lora_sd3")
    model.save_pretrained(str(folder / "transformer"))
    return model, folder


def sd3_inputs(seed=0):
    rng = np.random.default_rng(seed)
    return dict(hidden_states=rng.standard_normal((1, 16, 8, 6)).astype(np.float32),
                encoder_hidden_states=rng.standard_normal((1, 7, SD3_CFG["joint_attention_dim"])).astype(np.float32),
                pooled_projections=rng.standard_normal((1, SD3_CFG["pooled_projection_dim"])).astype(np.float32),
                timestep=np.array([700.0], np.float32))


def sd3_kohya_tensors(cfg, seed, alpha=3.0):
    """{kohya name: tensor} in Stability's MMDiT names (dots as underscores, fused qkv), the layers kohya's
    sd-scripts (networks/lora_sd3) trains, plus the adaLN modulations and the final layer."""
    g = torch.Generator().manual_seed(seed)
    d = cfg["num_attention_heads"] * cfg["attention_head_dim"]
    last = cfg["num_layers"] - 1
    layers = {"final_layer_adaLN_modulation_1": (2 * d, d), "final_layer_linear": (4 * cfg["out_channels"], d)}
    for i in range(cfg["num_layers"]):
        b = f"joint_blocks_{i}_"
        dual = i in cfg["dual_attention_layers"]
        layers.update({b + "x_block_attn_qkv": (3 * d, d), b + "x_block_attn_proj": (d, d),
                       b + "x_block_mlp_fc1": (4 * d, d), b + "x_block_mlp_fc2": (d, 4 * d),
                       b + "x_block_adaLN_modulation_1": ((9 if dual else 6) * d, d),
                       b + "context_block_attn_qkv": (3 * d, d),
                       b + "context_block_adaLN_modulation_1": ((2 if i == last else 6) * d, d)})
        if dual:
            layers.update({b + "x_block_attn2_qkv": (3 * d, d), b + "x_block_attn2_proj": (d, d)})
        if i != last:
            layers.update({b + "context_block_attn_proj": (d, d), b + "context_block_mlp_fc1": (4 * d, d),
                           b + "context_block_mlp_fc2": (d, 4 * d)})
    return kohya_named(g, layers, alpha)


def sd3_kohya_to_peft(tensors, cfg):
    """The test side's own diffusers naming of sd3_kohya_tensors (alpha baked into lora_B; the original (shift, scale)
    halves of the 2-chunk modulations swapped to diffusers' (scale, shift))."""
    last = cfg["num_layers"] - 1
    simple = {"x_block_attn_proj": "attn.to_out.0", "x_block_mlp_fc1": "ff.net.0.proj", "x_block_mlp_fc2": "ff.net.2",
              "x_block_adaLN_modulation_1": "norm1.linear", "context_block_attn_proj": "attn.to_add_out",
              "context_block_mlp_fc1": "ff_context.net.0.proj", "context_block_mlp_fc2": "ff_context.net.2",
              "context_block_adaLN_modulation_1": "norm1_context.linear", "x_block_attn2_proj": "attn2.to_out.0"}
    qkv = {"x_block_attn_qkv": ("attn.to_q", "attn.to_k", "attn.to_v"),
           "context_block_attn_qkv": ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"),
           "x_block_attn2_qkv": ("attn2.to_q", "attn2.to_k", "attn2.to_v")}

    def swap(t):
        shift, scale = t.chunk(2)
        return torch.cat([scale, shift])

    out = {}
    for key, down in tensors.items():
        if not key.endswith(".lora_down.weight"):
            continue
        name = key[len("lora_unet_"):-len(".lora_down.weight")]
        up = tensors[f"lora_unet_{name}.lora_up.weight"] * float(tensors[f"lora_unet_{name}.alpha"]) / down.shape[0]
        if name.startswith("final_layer"):
            targets = {"final_layer_adaLN_modulation_1": [("norm_out.linear", swap(up))],
                       "final_layer_linear": [("proj_out", up)]}[name]
        else:
            i, rest = name[len("joint_blocks_"):].split("_", 1)
            block = f"transformer_blocks.{i}."
            if rest in qkv:
                targets = [(block + n, piece) for n, piece in zip(qkv[rest], up.chunk(3))]
            else:
                targets = [(block + simple[rest], swap(up) if rest == "context_block_adaLN_modulation_1"
                            and int(i) == last else up)]
        for target, piece in targets:
            out[f"transformer.{target}.lora_A.weight"] = down
            out[f"transformer.{target}.lora_B.weight"] = piece
    return out


def test_sd3_peft_and_kohya_match_diffusers(sd3_twin, tmp_path):
    """SD3.5 (dual attention, qk norm, the context-pre-only last block): a PEFT file (attention, attn2,
    feed-forwards, adaLN and output layers; rsLoRA scaling from the metadata) and a kohya file in Stability's names
    (fused qkv, the last block's and the final layer's swapped modulation halves), alone and together: the
    transformer output within 1e-4 of diffusers (the kohya file through the test's own diffusers-named copy, since
    diffusers reads no kohya SD3 names)."""
    from diffusers import StableDiffusion3Pipeline
    model, folder = sd3_twin
    peft = peft_file(model, StableDiffusion3Pipeline, SD3_TARGETS, tmp_path / "peft", seed=6, alpha=6, rslora=True)
    tensors = sd3_kohya_tensors(SD3_CFG, seed=7)
    kohya = save(tensors, tmp_path / "kohya.safetensors")
    kohya_as_peft = save(sd3_kohya_to_peft(tensors, SD3_CFG), tmp_path / "kohya_as_peft.safetensors")
    inputs = sd3_inputs()
    base = torch_forward(model, inputs)
    for ours_files, their_files in (([(peft, 1.0)], [(peft, 1.0)]), ([(kohya, 1.0)], [(kohya_as_peft, 1.0)]),
                                    ([(peft, 0.5), (kohya, 1.3)], [(peft, 0.5), (kohya_as_peft, 1.3)])):
        ref = torch_forward(with_diffusers_loras(model, StableDiffusion3Pipeline, their_files), inputs)
        ours = mlx_forward(ours_with(folder / "transformer", mmdit, ours_files), inputs)
        err = max_rel_err(ours, ref)
        print(f"SD3 {[f.name for f, _ in ours_files]}: max_rel_err {err:.2e}, moved {max_rel_err(ref, base):.2e}")
        assert err <= 1e-4
        assert max_rel_err(ref, base) > 1e-2


# -- whole pipelines -----------------------------------------------------------------------------------------------

def diffusers_image(pipe, files_scales, **kw):
    """diffusers' pipeline image (float HWC, rounded as its PIL output is) with the LoRAs loaded, then unloaded."""
    names = []
    try:
        for i, (file, _) in enumerate(files_scales):
            pipe.load_lora_weights(str(file), adapter_name=f"l{i}")
            names.append(f"l{i}")
        pipe.set_adapters(names, adapter_weights=[s for _, s in files_scales])
        image = pipe(output_type="np", **kw).images[0]
    finally:
        pipe.unload_lora_weights()
    return (image * 255).round() / 255.0


def image_of(result):
    return np.asarray(result.image).astype(np.float32) / 255.0


def kohya_text_encoders(peft):
    """The CLIP-L / CLIP-G parts of a diffusers LoRA file in kohya's names (lora_te1_ / lora_te2_ + the module path
    with underscores, lora_down / lora_up, alpha = the file's lora_alpha)."""
    from safetensors import safe_open
    meta = json.loads(safe_open(str(peft), "pt").metadata()["lora_adapter_metadata"])
    out = {}
    for key, value in load_file_torch(peft).items():
        for prefix, kohya in (("text_encoder_2.", "lora_te2_"), ("text_encoder.", "lora_te1_")):
            if key.startswith(prefix):
                module, role = key[len(prefix):].rsplit(".lora_", 1)
                name = kohya + module.replace(".", "_")
                out[f"{name}.lora_{'down' if role[0] == 'A' else 'up'}.weight"] = value
                out[f"{name}.alpha"] = torch.tensor(float(meta[prefix + "lora_alpha"]))
                break
    return out


CLIP_TARGETS = ["q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2"]
PROMPT_EMBEDS = ("prompt_embeds", "negative_prompt_embeds", "pooled_prompt_embeds", "negative_pooled_prompt_embeds")


def test_sd3_pipeline_with_lora_matches_diffusers(sd3_tiny, tmp_path):
    """An SD3.5 diffusers/PEFT LoRA file with transformer, CLIP-L and CLIP-G parts (each its own alpha in the
    metadata), mlxdiff.load(folder, loras=[(file, 0.8)]) against diffusers with the same file (the transformer part
    through load_lora_adapter, the encoders' in PEFT's LoRA layers: this environment's PEFT is too old for the
    transformers load_adapter that load_lora_weights calls for text encoders) on the same noise, CFG with a negative
    prompt: images within 2/255, prompt embeddings within 1e-4. With keep="all", unload_loras and load_lora change
    the kept components in place: the plain image comes back, and the CLIP parts in kohya's lora_te1_/lora_te2_
    names give diffusers' embeddings again."""
    from diffusers import StableDiffusion3Pipeline
    folder, pipe = sd3_tiny
    peft = peft_file(pipe.transformer, StableDiffusion3Pipeline, SD3_TARGETS, tmp_path / "peft", seed=8, scale=0.2,
                     text_encoder=(pipe.text_encoder, CLIP_TARGETS),
                     text_encoder_2=(pipe.text_encoder_2, CLIP_TARGETS))
    kohya_te = save(kohya_text_encoders(peft), tmp_path / "kohya_te.safetensors")
    ref_pipe = StableDiffusion3Pipeline(**{
        **pipe.components,
        "transformer": with_diffusers_loras(pipe.transformer, StableDiffusion3Pipeline, [(peft, 0.8)]),
        **{name: with_peft_lora(getattr(pipe, name), peft, name, 0.8) for name in ("text_encoder", "text_encoder_2")}})
    noise = np.random.default_rng(3).standard_normal((1, 16, 20, 12)).astype(np.float32)
    ref = ref_pipe(prompt="a red fox", negative_prompt="blurry", height=40, width=24, num_inference_steps=3,
                   guidance_scale=4.5, latents=torch.from_numpy(noise), output_type="np").images[0]
    ref = (ref * 255).round() / 255.0
    ref_embeds = [e.detach().numpy() for e in ref_pipe.encode_prompt(
        prompt="a red fox", prompt_2=None, prompt_3=None, negative_prompt="blurry", do_classifier_free_guidance=True)]
    plain_embeds = [e.detach().numpy() for e in pipe.encode_prompt(
        prompt="a red fox", prompt_2=None, prompt_3=None, negative_prompt="blurry", do_classifier_free_guidance=True)]
    run = dict(negative_prompt="blurry", width=24, height=40, steps=3, guidance=4.5, latents=noise,
               progress_bar=False)
    ours_pipe = mlxdiff.load(str(folder), loras=[(str(peft), 0.8)], keep="all")
    assert {n for n, spec in ours_pipe.components.items() if spec is not None and spec.loras} == {
        "transformer", "text_encoder", "text_encoder_2"}
    ours = image_of(ours_pipe.generate("a red fox", **run))
    assert ours.shape == ref.shape
    assert np.abs(ours - ref).max() <= 2 / 255

    def embeds_match(p):
        ours_embeds = p.encode_prompt("a red fox", "blurry").as_numpy()
        for name, r, plain in zip(PROMPT_EMBEDS, ref_embeds, plain_embeds):
            assert max_rel_err(ours_embeds[name], r) <= 1e-4, name
            assert max_rel_err(plain, r) > 1e-2, name      # the encoders' LoRA matters

    embeds_match(ours_pipe)
    plain = ours_pipe.unload_loras().generate("a red fox", **run)
    assert "transformer" in plain.reused
    assert np.abs(ours - image_of(plain)).max() > 10 / 255      # the LoRA shows in the image
    embeds_match(ours_pipe.load_lora(kohya_te, scale=0.8))     # the kept encoders, changed in place
    ours_pipe.release()


@pytest.fixture(scope="module")
def klein(tmp_path_factory):
    return build_pipeline("klein_distilled", tmp_path_factory.mktemp("lora_klein"))


def klein_run(noise):
    return dict(width=W, height=H, steps=3, guidance=1.0, latents=noise, max_sequence_length=SEQ,
                text_encoder_out_layers=TAPS, progress_bar=False)


def test_flux2_pipeline_with_two_loras_matches_diffusers(klein, tmp_path):
    """FLUX.2 klein with a kohya and a PEFT LoRA at scales 0.9 and -0.5 (pipe.load_lora on a loaded pipeline)
    against diffusers with both adapters: images within 2/255."""
    from diffusers import Flux2KleinPipeline
    _, folder, pipe = klein
    cfg = dict(pipe.transformer.config)
    kohya = save(flux2_kohya_tensors(cfg, seed=9), tmp_path / "kohya.safetensors")
    peft = peft_file(pipe.transformer, Flux2KleinPipeline, FLUX2_TARGETS, tmp_path / "peft", seed=10)
    noise = np.random.default_rng(5).standard_normal((1, 20, H // 4, W // 4)).astype(np.float32)
    files = [(kohya, 0.9), (peft, -0.5)]
    ref = diffusers_image(pipe, files, prompt="a red fox in the snow", height=H, width=W, num_inference_steps=3,
                          guidance_scale=1.0, latents=torch.from_numpy(noise), max_sequence_length=SEQ,
                          text_encoder_out_layers=TAPS)
    ours_pipe = mlxdiff.load(str(folder))
    for file, scale in files:
        ours_pipe.load_lora(file, scale=scale)
    ours = image_of(ours_pipe.generate("a red fox in the snow", **klein_run(noise)))
    assert np.abs(ours - ref).max() <= 2 / 255
    plain = image_of(ours_pipe.unload_loras().generate("a red fox in the snow", **klein_run(noise)))
    assert np.abs(ours - plain).max() > 10 / 255


# -- a GGUF Q4_K_M base --------------------------------------------------------------------------------------------

# D = 256 (4 heads of 64): the quantized layers' input widths must be multiples of 256 (K-quant blocks)
GGUF_CFG = dict(patch_size=1, in_channels=20, out_channels=None, num_layers=1, num_single_layers=1,
                attention_head_dim=64, num_attention_heads=4, joint_attention_dim=120, timestep_guidance_channels=160,
                mlp_ratio=3.0, axes_dims_rope=(16, 16, 16, 16), rope_theta=2000, eps=1e-6, guidance_embeds=False)
KEEP = ("img_in.", "txt_in.", "time_in.", "final_layer.", "single_stream_modulation.", "double_stream_modulation_")


def write_q4_k_m(path, tensors):
    """BFL-named float tensors -> a GGUF in city96's Q4_K_M mix (as tests/test_gguf_models.py describes it): small
    and 1-D tensors F32, embedders / modulations / final layer F16, attention qkv Q5_K, the rest Q4_K."""
    from gguf import GGMLQuantizationType as Q
    from gguf import GGUFWriter
    from gguf_helpers import encode
    writer = GGUFWriter(str(path), "flux")
    for name, value in tensors.items():
        value = np.asarray(value, np.float32)
        if value.ndim == 1 or value.size <= 1024:
            writer.add_tensor(name, value)
        elif any(k in name for k in KEEP) or value.shape[1] % 256:
            writer.add_tensor(name, value.astype(np.float16))
        else:
            qtype = Q.Q5_K if "attn.qkv.weight" in name else Q.Q4_K
            writer.add_tensor(name, encode(value, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def gguf_klein(klein, tmp_path_factory):
    """(pipeline folder with a D=256 transformer, its Q4_K_M GGUF, a BFL-named LoRA of it)."""
    import shutil
    from diffusers import Flux2Transformer2DModel
    from twins import flux2_to_bfl
    _, folder, _ = klein
    root = tmp_path_factory.mktemp("lora_gguf")
    shutil.copytree(folder, root / "pipeline")
    twin = randomize_(Flux2Transformer2DModel(**GGUF_CFG), seed=21, scale=0.05).eval()
    twin.save_pretrained(str(root / "pipeline" / "transformer"))
    state = {k: v.detach().numpy() for k, v in flux2_to_bfl(twin.state_dict(), GGUF_CFG).items()}
    path = write_q4_k_m(root / "klein-Q4_K_M.gguf", state)
    bfl = save(kohya_to_bfl(flux2_kohya_tensors(GGUF_CFG, seed=22, alpha=4.0)), root / "bfl_lora.safetensors")
    return root / "pipeline", path, bfl


def test_gguf_base_with_lora_matches_diffusers_gguf(gguf_klein):
    """A BFL-named LoRA on a Q4_K_M GGUF transformer (kept as the file's blocks, float32 compute) against diffusers'
    GGUF transformer (GGUFQuantizationConfig) with the same LoRA through load_lora_weights: images within 2/255 (the
    file's blocks decode to the same float32 weights on both sides; 1/255 measured)."""
    from diffusers import Flux2KleinPipeline, Flux2Transformer2DModel, GGUFQuantizationConfig
    folder, path, bfl = gguf_klein
    gguf_model = Flux2Transformer2DModel.from_single_file(
        str(path), config=str(folder / "transformer"), local_files_only=True, torch_dtype=torch.float32,
        quantization_config=GGUFQuantizationConfig(compute_dtype=torch.float32)).eval()
    assert any(type(m).__name__ == "GGUFLinear" for m in gguf_model.modules())
    pipe = Flux2KleinPipeline.from_pretrained(str(folder), transformer=gguf_model)
    noise = np.random.default_rng(6).standard_normal((1, 20, H // 4, W // 4)).astype(np.float32)
    ref = diffusers_image(pipe, [(bfl, 1.0)], prompt="a red fox in the snow", height=H, width=W,
                          num_inference_steps=3, guidance_scale=1.0, latents=torch.from_numpy(noise),
                          max_sequence_length=SEQ, text_encoder_out_layers=TAPS)
    ours = mlxdiff.load(str(folder), transformer=str(path), loras=[(bfl, 1.0)], keep="all")
    image = image_of(ours.generate("a red fox in the snow", **klein_run(noise)))
    print(f"GGUF + LoRA: max |diff| {np.abs(image - ref).max() * 255:.1f}/255")
    assert np.abs(image - ref).max() <= 2 / 255
    plain = image_of(ours.unload_loras().generate("a red fox in the snow", **klein_run(noise)))
    assert np.abs(image - plain).max() > 10 / 255
    ours.release()


def test_lora_on_quantized_base_adds_only_its_bytes(gguf_klein):
    """On the GGUF base (RawLinear blocks) and on the same model quantized while loading to 4 bits
    (QuantizedLinear): the layers stay quantized (the very same arrays, under LoRALinear) and the resident memory
    grows by the LoRA file's bytes only: its arrays are the file's tensors (a fused qkv's lora_A is one array shared
    by q, k and v, its lora_B's parts share one buffer), and MLX's active memory grows by that, give or take the
    allocator's rounding of each buffer up to a page. The matmul strategies swap the base under the LoRA (4-bit
    layers multiplying through a per-call dequantized weight give the same output)."""
    import mlx.nn as nn
    from mlxdiff.formats.gguf import RawLinear
    from mlxdiff.loading import sources
    from mlxdiff.loading.quantize import materialize, setting
    from mlxdiff.loading.matmul import DequantizedLinear, use_strategy
    folder, path, bfl = gguf_klein
    lora_bytes = lora.lora_nbytes(bfl)
    base_config = json.loads((folder / "transformer" / "config.json").read_text())
    gguf_spec = sources.transformer_from_file(path, flux2, base_config)
    folder_spec = sources.ComponentSpec("transformer", flux2, base_config,
                                        [folder / "transformer" / "diffusion_pytorch_model.safetensors"],
                                        quantize=setting(4))
    import dataclasses
    for spec in (gguf_spec, folder_spec):   # the budget checks (memory.check_fits, keep="auto") count the LoRA too
        with_lora = dataclasses.replace(spec, loras=((str(bfl), 1.0),))
        assert with_lora.loaded_nbytes() == spec.loaded_nbytes() + lora_bytes
    for spec, kind in ((gguf_spec, RawLinear), (folder_spec, nn.QuantizedLinear)):
        model = spec.build()
        materialize(model)
        layers = {p: m for p, m in model.named_modules() if isinstance(m, kind)}
        arrays = {p: id(m["weight"]) for p, m in layers.items()}
        before = mx.get_active_memory()
        lora.apply_loras(model, flux2, [(bfl, 1.0)])
        added = mx.get_active_memory() - before
        print(f"{kind.__name__}: LoRA file {lora_bytes} bytes, resident memory +{added}")
        modules = dict(model.named_modules())
        held = {id(x): x.nbytes for m in modules.values() if isinstance(m, lora.LoRALinear)
                for x in m.lora_a + m.lora_b}
        assert sum(held.values()) == lora_bytes
        n_tensors = len(mx.load(str(bfl)))
        assert lora_bytes <= added <= lora_bytes + 4096 * n_tensors
        wrapped = [p for p in layers if isinstance(modules[p], lora.LoRALinear)]
        assert wrapped and all(isinstance(modules[p].base, kind) and id(modules[p].base["weight"]) == arrays[p]
                               for p in wrapped)
    inputs = flux2_inputs(cfg=GGUF_CFG)
    qmm = mlx_forward(model, inputs)
    use_strategy(model, "dequantize")
    modules = dict(model.named_modules())
    assert all(isinstance(modules[p].base, DequantizedLinear) for p in wrapped)
    assert max_rel_err(mlx_forward(model, inputs), qmm) <= 1e-5


# -- the command line and bad input --------------------------------------------------------------------------------

from mlxdiff import default_model  # noqa: E402

MODEL = str(default_model.FOLDER)
CHEAP = ["--model", MODEL, "--prompt", "a red circle", "--steps", "1", "--width", "16", "--height", "16",
         "--seed", "3", "--no-progress"]


@pytest.fixture(scope="module")
def shapes_lora(tmp_path_factory):
    """A kohya LoRA for the embedded default model's transformer (FLUX.2 klein layout)."""
    cfg = json.loads((default_model.FOLDER / "transformer" / "config.json").read_text())
    folder = tmp_path_factory.mktemp("lora_cli")
    return save(flux2_kohya_tensors(cfg, seed=11, alpha=4.0), folder / "shapes.safetensors")


def test_cli_lora_writes_what_the_api_draws(shapes_lora, tmp_path, capsys):
    """--lora FILE:SCALE draws what mlxdiff.load(..., loras=[(FILE, SCALE)]) draws, and the PNG records it."""
    from PIL import Image
    from mlxdiff.generate import main
    out = tmp_path / "out.png"
    assert main([*CHEAP, "--lora", f"{shapes_lora}:0.5", "--output", str(out)]) == 0
    png = Image.open(out)
    assert png.text["mlxdiff:lora"] == "shapes.safetensors:0.5"
    api = mlxdiff.load(MODEL, loras=[(shapes_lora, 0.5)]).generate("a red circle", steps=1, width=16, height=16,
                                                                  seed=3, progress_bar=False)
    assert np.array_equal(np.asarray(png.convert("RGB")), np.asarray(api.image))


def bad_files(root):
    """name -> (LoRA file, what the one line must say)."""
    g = torch.Generator().manual_seed(0)
    cfg = json.loads((default_model.FOLDER / "transformer" / "config.json").read_text())
    dim = cfg["num_attention_heads"] * cfg["attention_head_dim"]
    a, b = random_pair(g, dim, dim)
    good = {"transformer.transformer_blocks.0.attn.to_q.lora_A.weight": a,
            "transformer.transformer_blocks.0.attn.to_q.lora_B.weight": b}
    files = {
        "unknown layer": ({**good, "transformer.transformer_blocks.9.attn.to_q.lora_A.weight": a,
                           "transformer.transformer_blocks.9.attn.to_q.lora_B.weight": b},
                          "transformer.transformer_blocks.9.attn.to_q.lora_A.weight"),
        "wrong shape": ({"transformer.transformer_blocks.0.attn.to_q.lora_A.weight": a[:, :-1],
                         "transformer.transformer_blocks.0.attn.to_q.lora_B.weight": b}, "another model size"),
        "SD3 LoRA": (sd3_kohya_tensors(SD3_CFG, seed=1), "a LoRA for SD3"),
        "FLUX.1 LoRA": ({"transformer.single_transformer_blocks.0.proj_mlp.lora_A.weight": a,
                         "transformer.single_transformer_blocks.0.proj_mlp.lora_B.weight": b}, "FLUX.1"),
        "SDXL LoRA": ({"lora_unet_down_blocks_0_attentions_0_proj_in.lora_down.weight": a,
                       "lora_unet_down_blocks_0_attentions_0_proj_in.lora_up.weight": b}, "UNet"),
        "text encoder": ({**good, "lora_te1_text_model_encoder_layers_0_self_attn_q_proj.lora_down.weight": a,
                          "lora_te1_text_model_encoder_layers_0_self_attn_q_proj.lora_up.weight": b},
                         "text-encoder"),
        "no lora_B": ({"transformer.transformer_blocks.0.attn.to_q.lora_A.weight": a}, "no lora_B partner"),
        "not a LoRA": ({"transformer_blocks.0.attn.to_q.weight": b}, "not a LoRA tensor"),
        # a DoRA is read (test_flux1_lora.py); one whose magnitude does not have the layer's rows is refused
        "DoRA": ({**good, "transformer.transformer_blocks.0.attn.to_q.lora_magnitude_vector": b[:-1, 0]},
                 "is not the DoRA magnitude"),
        "LyCORIS DoRA": ({**good, "transformer.transformer_blocks.0.attn.to_q.dora_scale": b[:1, :]},
                         "wd_on_out"),
    }
    return {name: (save(t, root / f"{name.replace(' ', '_')}.safetensors"), needle)
            for name, (t, needle) in files.items()}


def assert_one_line(capsys, rc, out, *needles):
    err = capsys.readouterr().err
    lines = [line for line in err.strip().splitlines() if line.strip()]
    assert rc == 2 and len(lines) == 1 and lines[0].startswith("mlxdiff: error:"), err
    for n in needles:
        assert n in lines[0], (n, lines[0])
    assert not out.exists()


def test_bad_lora_files_are_one_line(tmp_path, capsys):
    """Each bad LoRA file: exit 2, one line naming the file and what is wrong with it (the key where there is one),
    no PNG; the same refusal from the API as MlxdiffError."""
    from mlxdiff.generate import main
    out = tmp_path / "out.png"
    for name, (file, needle) in bad_files(tmp_path).items():
        rc = main([*CHEAP, "--lora", str(file), "--output", str(out)])
        assert_one_line(capsys, rc, out, file.name, needle)
    # and the other way round, on SD3.5 (kohya's names of these layers are FLUX.1's as well as FLUX.2's)
    with pytest.raises(MlxdiffError, match="a LoRA for FLUX.1 / FLUX.2"):
        lora.plan(mmdit.Model(mmdit.ModelArgs.from_dict(SD3_CFG)), mmdit,
                  save(flux2_kohya_tensors(FLUX2_CFG, seed=1), tmp_path / "flux2.safetensors"))


@pytest.mark.parametrize("value, needle", [
    ("{missing}", "LoRA file not found"), ("{lora}:abc", "SCALE 'abc' is not a number"),
    ("{lora}:nan", "lora_scale=nan"), ("{lora}:1e9", "lora_scale=1000000000.0"), (":0.5", "no file"),
    ("{folder}", "is a folder"), ("{ckpt}", "expected a .safetensors LoRA file")])
def test_bad_lora_arguments_are_one_line(value, needle, shapes_lora, tmp_path, capsys):
    from mlxdiff.generate import main
    (tmp_path / "x.ckpt").write_bytes(b"\0" * 16)
    arg = value.format(missing=tmp_path / "missing.safetensors", lora=shapes_lora, folder=tmp_path,
                       ckpt=tmp_path / "x.ckpt")
    out = tmp_path / "out.png"
    assert_one_line(capsys, main([*CHEAP, "--lora", arg, "--output", str(out)]), out, needle)


def test_api_lora_arguments():
    with pytest.raises(MlxdiffError, match="loras="):
        mlxdiff.load(MODEL, loras="style.safetensors")
    with pytest.raises(MlxdiffError, match="lora_scale=200"):
        mlxdiff.load(MODEL, loras=[("style.safetensors", 200)])
    with pytest.raises(MlxdiffError, match="not a file or a"):
        mlxdiff.load(MODEL, loras=[(1, 2, 3)])


def test_layer_kinds_and_row_views():
    """linear_dims reads every kind of base mlxdiff builds; a row range of a LoRALinear (what FLUX.2's single blocks
    take of their fused projection, formats/quantized.linear_rows) is the same rows of its output."""
    import mlx.nn as nn
    from mlxdiff.formats.fp8 import Fp8Linear
    from mlxdiff.formats.gguf import RawLinear
    from mlxdiff.formats.quantized import linear_rows
    from mlxdiff.loading.matmul import to_dequantized
    dense = nn.Linear(128, 96, bias=False)
    quantized = nn.QuantizedLinear.from_linear(dense, group_size=64, bits=4)
    for layer in (dense, quantized, to_dequantized(quantized), RawLinear(256, 96, "Q4_K"), Fp8Linear(128, 96)):
        assert lora.linear_dims(layer) in ((128, 96), (256, 96)), type(layer).__name__
    assert lora.linear_dims(nn.Conv2d(3, 4, 2)) is None and lora.linear_dims(nn.RMSNorm(8)) is None
    g = np.random.default_rng(0)
    a, b = (mx.array(g.standard_normal(s).astype(np.float32)) for s in ((4, 128), (96, 4)))
    layer = lora.LoRALinear(quantized, [(a, b, 0.5)])
    layer.add(a, b * 2, -0.25)
    x = mx.array(g.standard_normal((2, 3, 128)).astype(np.float32))
    full = np.array(layer(x))
    expect = np.array(quantized(x)) + 0.5 * np.array((x @ a.T) @ b.T) - 0.25 * np.array((x @ a.T) @ (2 * b).T)
    assert max_rel_err(full, expect) <= 1e-6
    assert max_rel_err(np.array(linear_rows(layer, 32, 80)(x)), full[..., 32:80]) <= 1e-6
    assert isinstance(lora.remove_loras(nn.Sequential(layer)).layers[0], nn.QuantizedLinear)


CLIP_TARGETS = ["q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2"]


def with_peft_lora(model, file, component, scale):
    """A copy of a torch model with the `component.` part of a diffusers LoRA file in PEFT's LoRA layers (its
    LoraConfig from the file's metadata), scaled by `scale`."""
    from peft import LoraConfig, inject_adapter_in_model, set_peft_model_state_dict
    from peft.tuners.lora import LoraLayer
    from safetensors import safe_open
    meta = json.loads(safe_open(str(file), "pt").metadata()["lora_adapter_metadata"])
    config = LoraConfig(**{k[len(component) + 1:]: v for k, v in meta.items() if k.startswith(component + ".")})
    model = inject_adapter_in_model(config, copy.deepcopy(model))
    state = {k[len(component) + 1:]: v for k, v in load_file_torch(file).items() if k.startswith(component + ".")}
    assert not set_peft_model_state_dict(model, state).unexpected_keys
    for m in model.modules():
        if isinstance(m, LoraLayer):
            m.scale_layer(scale)
    return model.eval()


def load_file_torch(path):
    from safetensors.torch import load_file
    return load_file(str(path))


def test_t5_text_encoder_lora_matches_peft(sd3_tiny, tmp_path):
    """SD3.5's T5 part (kohya's lora_te3_ names, mlxdiff's = transformers' module paths): the encoder output
    within 1e-4 of transformers' T5 with the same LoRA in PEFT's layers."""
    from peft import LoraConfig, inject_adapter_in_model, set_peft_model_state_dict
    from peft.tuners.lora import LoraLayer
    from mlxdiff.models import t5
    _, pipe = sd3_tiny
    encoder = pipe.text_encoder_3
    encoder.save_pretrained(str(tmp_path / "t5"))
    state, config = peft_adapter(encoder, ["q", "k", "v", "o", "wi_0", "wi_1", "wo"], seed=13, alpha=6, scale=0.2)
    kohya = {}
    for key, value in state.items():
        module, role = key.rsplit(".lora_", 1)
        name = "lora_te3_" + module.replace(".", "_")
        kohya[f"{name}.lora_{'down' if role[0] == 'A' else 'up'}.weight"] = value
        kohya[f"{name}.alpha"] = torch.tensor(6.0)
    file = save(kohya, tmp_path / "t5_lora.safetensors")
    ref_model = inject_adapter_in_model(LoraConfig(**config), copy.deepcopy(encoder))
    assert not set_peft_model_state_dict(ref_model, state).unexpected_keys
    for m in ref_model.modules():
        if isinstance(m, LoraLayer):
            m.scale_layer(0.7)
    ids = np.array([[5, 17, 230, 9, 1]])
    with torch.no_grad():
        ref = ref_model(torch.from_numpy(ids)).last_hidden_state.numpy()
        plain = encoder(torch.from_numpy(ids)).last_hidden_state.numpy()
    ours_model = lora.apply_loras(load_ours(tmp_path / "t5", t5), t5, [(file, 0.7)], component="text_encoder_3")
    ours = np.array(ours_model(mx.array(ids)).astype(mx.float32))
    assert max_rel_err(ours, ref) <= 1e-4
    assert max_rel_err(plain, ref) > 1e-2
