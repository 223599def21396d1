"""SD 1.x / SDXL original single files (ldm / SGM names) and stable-diffusion.cpp GGUFs -> mlxdiff specs.

Tiny SD1.5-like and SDXL-like models (diffusers UNet and VAE, transformers CLIP-L and an OpenCLIP-bigG-like
CLIPTextModelWithProjection, dimensions that differ between the two) with random weights are written as one
checkpoint in the original naming (tests/ldm_helpers.py); diffusers' own converters must give back their state dicts
exactly (the proof that the file is in the original naming), then `sd_single_file` + `spec.build()` must match the
torch models (<= 1e-4 relative, float32). The GGUFs are written as sd.cpp's convert writes them (its names, F16
kernels, F32 biases, Q8_0 / Q4_0 for what it quantizes) and compared with the torch models run on the weights as
the file decodes them (gguf-py's dequantize).
"""

import copy

import numpy as np
import pytest

import mlxdiff  # noqa: F401
import mlx.core as mx
import mlx.nn as nn

import fixture_guard
from helpers import max_rel_err, randomize_
from ldm_helpers import BIG_G, BIG_G_PREFIX, CLIP_L, FAMILIES, _checkpoint, _numpy, _state, vae_to_ldm, write_sdcpp_gguf
from mlxdiff.errors import MlxdiffError
from mlxdiff.pipelines.stable_diffusion.single_file import sd_single_file

TOL = 1e-4


def _torch(state):
    import torch
    return {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in state.items()}


def _load(model, state):
    """_state's inverse: the twin gets exactly these weights (only the position_ids buffer may be left)."""
    state = {k: v for k, v in state.items() if not k.endswith("position_ids")}
    if type(model).__name__ == "CLIPTextModel":
        state = {k.removeprefix("text_model."): v for k, v in state.items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and all(k.endswith("position_ids") for k in missing), (missing, unexpected)
    return model


def _diffusers_states(checkpoint, models, spec) -> dict:
    """diffusers' own converters (single_file_utils) run on the checkpoint: {component: torch state dict}."""
    from diffusers.loaders import single_file_utils as su
    ckpt = _torch(checkpoint)
    out = {"unet": su.convert_ldm_unet_checkpoint(ckpt, dict(models["unet"].config)),
           "vae": su.convert_ldm_vae_checkpoint(ckpt, dict(models["vae"].config)),
           "text_encoder": su.convert_ldm_clip_checkpoint(
               {k: v for k, v in ckpt.items() if k.startswith(spec["clip_prefix"])})}
    if spec["big_g"]:
        out["text_encoder_2"] = su.convert_open_clip_checkpoint(models["text_encoder_2"], ckpt, prefix=BIG_G_PREFIX)
    return out


@pytest.fixture(autouse=True)
def family_unchanged(request):
    """Fixtures are immutable: tests load weights into copies (_load on deepcopies); after each test the shared torch
    twins, checkpoint and file are as built (fixture_guard)."""
    yield from fixture_guard.unchanged(request, ["family"])


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    """(name, spec, torch models, checkpoint dict, its .safetensors path)."""
    import torch
    from diffusers import AutoencoderKL, UNet2DConditionModel
    from safetensors.numpy import save_file
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection
    name, spec = request.param, FAMILIES[request.param]
    torch.manual_seed(0)
    models = {"unet": randomize_(UNet2DConditionModel(**spec["unet"]).eval(), seed=1, scale=0.1),
              "vae": randomize_(AutoencoderKL(**spec["vae"]).eval(), seed=2, scale=0.1),
              "text_encoder": randomize_(CLIPTextModel(CLIPTextConfig(**CLIP_L)).eval(), seed=3, scale=0.1)}
    if spec["big_g"]:
        models["text_encoder_2"] = randomize_(CLIPTextModelWithProjection(CLIPTextConfig(**BIG_G)).eval(), seed=4,
                                              scale=0.1)
    checkpoint = _checkpoint(models, spec)
    path = tmp_path_factory.mktemp(f"sd_{name}") / f"{name}.safetensors"
    save_file(checkpoint, str(path))
    return name, spec, models, checkpoint, path


def _compare(name, spec, models, sources, tag):
    """Each component built from `sources` against its torch twin in `models`."""
    import torch
    rng = np.random.default_rng(5)
    errors = {}
    # UNet
    cfg, (h, w) = spec["unet"], spec["size"]
    sample = rng.standard_normal((2, 4, h, w)).astype(np.float32)
    t = np.array([999.0, 17.5], np.float32)
    context = rng.standard_normal((2, 7, cfg["cross_attention_dim"])).astype(np.float32)
    added = None
    if cfg.get("addition_embed_type"):
        added = {"text_embeds": rng.standard_normal((2, 96)).astype(np.float32),
                 "time_ids": np.array([[1024, 768, 0, 16, 1024, 768], [512, 512, 8, 0, 640, 512]], np.float32)}
    with torch.no_grad():
        ref = models["unet"](torch.from_numpy(sample), torch.from_numpy(t), torch.from_numpy(context),
                             added_cond_kwargs=added and {k: torch.from_numpy(v) for k, v in added.items()}).sample
    ours = sources.components["unet"].build()(mx.array(sample), mx.array(t), mx.array(context),
                                              added and {k: mx.array(v) for k, v in added.items()})
    errors["unet"] = max_rel_err(np.array(ours), ref.numpy())
    # VAE: decode and encode
    vae = sources.components["vae"].build()
    z = rng.standard_normal((1, 4, 6, 10)).astype(np.float32)
    with torch.no_grad():
        ref_image = models["vae"].decode(torch.from_numpy(z)).sample.numpy()
        ref_mean = models["vae"].encode(torch.from_numpy(ref_image)).latent_dist.mean.numpy()
    errors["vae decode"] = max_rel_err(np.array(vae.decode(mx.array(z))), ref_image)
    errors["vae encode"] = max_rel_err(np.array(vae.encode_moments(mx.array(ref_image))[0]), ref_mean)
    # text encoders: last and penultimate hidden states, and bigG's projection
    ids = np.array([[0, 17, 300, 999, 2, 1, 1], [0, 5, 999, 8, 9, 2, 1]], np.int32)
    for component in ("text_encoder", "text_encoder_2"):
        if component not in models:
            continue
        with torch.no_grad():
            ref = models[component](torch.from_numpy(ids).long(), output_hidden_states=True)
        out = sources.components[component].build()(mx.array(ids))
        errors[f"{component} last"] = max_rel_err(np.array(out.last_hidden_state), ref.last_hidden_state.numpy())
        errors[f"{component} penultimate"] = max_rel_err(np.array(out.hidden_states[-2]),
                                                         ref.hidden_states[-2].numpy())
        if component == "text_encoder_2":
            errors[f"{component} projection"] = max_rel_err(np.array(out.text_embeds), ref.text_embeds.numpy())
    print(f"{name} {tag}: " + ", ".join(f"{k} {v:.1e}" for k, v in errors.items()))
    assert max(errors.values()) <= TOL, errors


def test_checkpoint_is_the_original_naming(family):
    """diffusers' own single-file converters read our checkpoint back into the exact diffusers state dicts."""
    name, spec, models, checkpoint, _ = family
    for component, state in _diffusers_states(checkpoint, models, spec).items():
        expected = _state(models[component])
        state = {k: v for k, v in state.items() if not k.endswith("position_ids")}
        assert state.keys() == expected.keys(), (component, sorted(state.keys() ^ expected.keys())[:5])
        for k, v in expected.items():
            assert np.array_equal(state[k].numpy(), v.numpy()), (component, k)


def test_safetensors_matches_diffusers(family):
    name, spec, models, _, path = family
    sources = sd_single_file(path)
    assert sources.family == "sd"
    assert sources.pipeline_class == ("StableDiffusionXLPipeline" if spec["big_g"] else "StableDiffusionPipeline")
    assert set(sources.components) == {"unet", "vae", "text_encoder"} | ({"text_encoder_2"} if spec["big_g"] else set())
    assert sources.components["text_encoder"].args.with_projection is False
    vae_args = sources.components["vae"].args
    assert (vae_args.scaling_factor, vae_args.shift_factor) == ((0.13025, None) if spec["big_g"] else (0.18215, None))
    assert sources.scheduler_config["_class_name"] == ("EulerDiscreteScheduler" if spec["big_g"] else "PNDMScheduler")
    _compare(name, spec, models, sources, "safetensors")


def test_sdcpp_gguf_matches_diffusers_on_its_weights(family, tmp_path):
    import gguf
    from mlxdiff.formats.gguf import RawLinear, check_gguf
    name, spec, models, checkpoint, _ = family
    path = tmp_path / f"{name}-{spec['qtype']}.gguf"
    decoded = write_sdcpp_gguf(path, checkpoint, getattr(gguf.GGMLQuantizationType, spec["qtype"]))
    types = {t.type_name for t in check_gguf(path).tensors}
    assert {"F16", "F32", spec["qtype"]} <= types, types
    twins = {}
    for component, state in _diffusers_states(decoded, models, spec).items():
        twins[component] = _load(copy.deepcopy(models[component]), state)
    sources = sd_single_file(path)
    unet = sources.components["unet"].build()
    kept = (nn.QuantizedLinear, RawLinear)   # affine triplets, or the file's blocks (float32 compute's default)
    assert any(isinstance(m, kept) for _, m in unet.named_modules()), "the UNet was not kept quantized"
    _compare(name, spec, twins, sources, f"gguf {spec['qtype']}")


def _write(path, tensors):
    from safetensors.numpy import save_file
    save_file({k: np.asarray(v, np.float32) for k, v in tensors.items()}, str(path))
    return path


def _one_line(excinfo, *words):
    message = str(excinfo.value)
    assert "\n" not in message, message
    for word in words:
        assert word in message, message


def test_refusals(family, tmp_path):
    name, spec, _, checkpoint, path = family
    z = np.zeros((4, 4), np.float32)
    cases = {
        "sd35": ({"model.diffusion_model.joint_blocks.0.x_block.attn.qkv.weight": z}, "SD3.5"),
        "flux": ({"model.diffusion_model.double_blocks.0.img_attn.qkv.weight": z}, "FLUX"),
        "other": ({"encoder.layer.0.weight": z}, "not an SD 1.x / 2.x / XL checkpoint"),
        "novae": ({k: v for k, v in checkpoint.items() if not k.startswith("first_stage_model.")}, "has no VAE"),
        "noclip": ({k: v for k, v in checkpoint.items() if not k.startswith(spec["clip_prefix"])}, "text encoder"),
    }
    if spec["big_g"]:
        cases["no_bigg"] = ({k: v for k, v in checkpoint.items() if not k.startswith(BIG_G_PREFIX)},
                            "conditioner.embedders.1.model.")
        cases["sd2"] = ({k: v for k, v in checkpoint.items() if ".label_emb." not in k}, "prediction_type")
    for case, (tensors, words) in cases.items():
        with pytest.raises(MlxdiffError) as e:
            sd_single_file(_write(tmp_path / f"{case}.safetensors", tensors))
        _one_line(e, f"{case}.safetensors", words)
    truncated = tmp_path / "truncated.safetensors"
    truncated.write_bytes(path.read_bytes()[:-1000])
    with pytest.raises(MlxdiffError) as e:
        sd_single_file(truncated)
    _one_line(e, "truncated.safetensors")
    with pytest.raises(MlxdiffError) as e:
        sd_single_file(path, prediction_type="x0")
    _one_line(e, "prediction_type")


def test_vae_file_replaces_the_checkpoints(family, tmp_path):
    """vae_file= in diffusers' names (a save_pretrained VAE, as the fp16-fixed SDXL VAE is published) or in ldm names
    with the prefix (a VAE extracted from a checkpoint): the file's weights are used, with the model's VAE config."""
    import torch
    from safetensors.torch import save_file
    name, spec, models, checkpoint, path = family
    other = randomize_(copy.deepcopy(models["vae"]), seed=9, scale=0.1)
    diffusers_file = tmp_path / "vae_diffusers.safetensors"
    save_file({k: v.contiguous() for k, v in other.state_dict().items()}, str(diffusers_file))
    ldm_file = _write(tmp_path / "vae_ldm.safetensors", {
        "first_stage_model." + k: np.ascontiguousarray(v)
        for k, v in vae_to_ldm(_numpy(_state(other)), len(spec["vae"]["block_out_channels"])).items()})
    z = np.random.default_rng(6).standard_normal((1, 4, 6, 8)).astype(np.float32)
    with torch.no_grad():
        expected = other.decode(torch.from_numpy(z)).sample.numpy()
    for file in (diffusers_file, ldm_file):
        vae = sd_single_file(path, vae_file=file).components["vae"]
        assert vae.files == [file]
        assert vae.args.scaling_factor == (0.13025 if spec["big_g"] else 0.18215)
        err = max_rel_err(np.array(vae.build().decode(mx.array(z))), expected)
        assert err <= TOL, (file.name, err)
    with pytest.raises(MlxdiffError) as e:
        sd_single_file(path, vae_file=_write(tmp_path / "notavae.safetensors", {"a.weight": np.zeros((2, 2))}))
    _one_line(e, "notavae.safetensors", "not an SD VAE")
