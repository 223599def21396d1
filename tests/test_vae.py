"""VAE parity: SD3's AutoencoderKL and FLUX.2's AutoencoderKLFlux2 against diffusers, float32, tiny configs with
distinct dimensions. Weights reach our model only through our loaders (save_pretrained folder or a single file)."""

import json
from types import SimpleNamespace

import numpy as np
import pytest

import mlxdiff  # noqa: F401
import mlx.core as mx
from mlx.utils import tree_flatten

from helpers import load_ours, max_rel_err, randomize_
from mlxdiff.errors import MlxdiffError
from mlxdiff.formats.keymaps import remap, strip_prefix
from mlxdiff.formats.safetensors import load_folder, load_safetensors
from mlxdiff.loading.build import build
from mlxdiff.models import vae, vae_flux2
from twins import diffusers_to_ldm, make_flux2_twin

TOL = 1e-4

SD3_CONFIGS = {
    # 4 levels, so the LDM_KEYMAP constant (SD3.5's 4 levels) is what maps the single file
    "four_levels": dict(block_out_channels=(8, 12, 20, 16), layers_per_block=1, latent_channels=6, norm_num_groups=4,
                        use_quant_conv=False, use_post_quant_conv=False, image=(2, 24, 40)),
    "quant_convs": dict(block_out_channels=(10, 15, 25), layers_per_block=2, latent_channels=7, norm_num_groups=5,
                        use_quant_conv=True, use_post_quant_conv=True, image=(1, 20, 36)),
}
FLUX2_CONFIGS = {
    "attention": dict(block_out_channels=(8, 12, 16), layers_per_block=1, latent_channels=5, norm_num_groups=4,
                      image=(2, 24, 40)),
    "small_decoder": dict(block_out_channels=(12, 18), decoder_block_out_channels=(9, 15), layers_per_block=2,
                          latent_channels=7, norm_num_groups=3, mid_block_add_attention=False, image=(1, 20, 28)),
}


def make_sd3_twin(spec, seed):
    from diffusers import AutoencoderKL
    spec = {k: v for k, v in spec.items() if k != "image"}
    n = len(spec["block_out_channels"])
    model = AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * n,
                          up_block_types=("UpDecoderBlock2D",) * n, scaling_factor=1.5305, shift_factor=0.0609,
                          sample_size=1024,
                          **spec)
    return randomize_(model, seed=seed).eval()


def save_and_load(twin, folder, arch):
    """The twin saved with save_pretrained in `folder` and loaded back through our loader (build's default
    compute dtype)."""
    twin.save_pretrained(str(folder))
    return load_ours(folder, arch, dtype=None)


def inputs(spec, twin, seed=0):
    rng = np.random.default_rng(seed)
    batch, h, w = spec["image"]
    f = 2 ** (len(spec["block_out_channels"]) - 1)
    image = rng.uniform(-1, 1, (batch, 3, h, w)).astype(np.float32)
    latent = rng.standard_normal((batch, twin.config.latent_channels, h // f, w // f)).astype(np.float32)
    return image, latent


def reference(twin, image, latent):
    import torch
    with torch.no_grad():
        decoded = twin.decode(torch.from_numpy(latent)).sample.numpy()
        posterior = twin.encode(torch.from_numpy(image)).latent_dist
    return decoded, posterior.mean.numpy(), posterior.logvar.numpy()


def check_parity(ours, twin, spec):
    image, latent = inputs(spec, twin)
    decoded, mean, logvar = reference(twin, image, latent)
    assert decoded.shape == (latent.shape[0], 3) + tuple(spec["image"][1:])
    ours_mean, ours_logvar = ours.encode_moments(mx.array(image))
    errors = {"decode": max_rel_err(ours.decode(mx.array(latent)), decoded),
              "mean": max_rel_err(ours_mean, mean), "logvar": max_rel_err(ours_logvar, logvar)}
    assert all(e <= TOL for e in errors.values()), errors
    return errors


def assert_same_state(model, reference_model):
    ours, ref = model.state_dict(), reference_model.state_dict()
    assert ours.keys() == ref.keys()
    for k in ref:
        assert (ours[k] == ref[k]).all(), k


# -- SD3 AutoencoderKL -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", list(SD3_CONFIGS))
def test_sd3_vae_matches_diffusers(name, tmp_path):
    spec = SD3_CONFIGS[name]
    twin = make_sd3_twin(spec, seed=3)
    ours = save_and_load(twin, tmp_path, vae)
    assert ("quant_conv" in ours) == spec["use_quant_conv"]
    check_parity(ours, twin, spec)
    z = mx.array(np.linspace(-2, 2, 12, dtype=np.float32))
    assert np.allclose(np.array(ours.unscale_latents(ours.scale_latents(z))), np.array(z), atol=1e-6)
    assert np.allclose(np.array(ours.scale_latents(z)), (np.array(z) - 0.0609) * 1.5305, atol=1e-6)


def test_sd3_vae_bf16_weights_stay_bf16(tmp_path):
    """Stored bf16 stays bf16 in memory; the arithmetic is float32 (reference: the same bf16 weights in f32)."""
    import torch
    spec = SD3_CONFIGS["four_levels"]
    twin = make_sd3_twin(spec, seed=5).to(torch.bfloat16)
    ours = save_and_load(twin, tmp_path, vae)
    dtypes = {v.dtype for _, v in tree_flatten(ours.parameters())}
    assert dtypes == {mx.bfloat16}
    image, latent = inputs(spec, twin)
    decoded, _, _ = reference(twin.float(), image, latent)
    out = ours.decode(mx.array(latent))
    assert out.dtype == mx.float32
    assert max_rel_err(out, decoded) <= TOL


@pytest.mark.parametrize("name", list(SD3_CONFIGS))
def test_sd3_vae_from_ldm_single_file(name, tmp_path):
    """An SD3.5-style single file (`first_stage_model.` + ldm names): diffusers' from_single_file vs LDM_KEYMAP."""
    import torch
    from diffusers import AutoencoderKL
    from safetensors.torch import save_file
    spec = SD3_CONFIGS[name]
    levels = len(spec["block_out_channels"])
    twin = make_sd3_twin(spec, seed=7)
    twin.save_pretrained(str(tmp_path / "vae"))
    ldm = {"first_stage_model." + k: v for k, v in diffusers_to_ldm(twin.state_dict(), levels).items()}
    ldm["model.diffusion_model.pos_embed"] = torch.zeros(3, 5)  # other components share the file
    path = tmp_path / "sd3_single.safetensors"
    save_file(ldm, str(path))

    theirs = AutoencoderKL.from_single_file(str(path), config=str(tmp_path / "vae")).eval()
    assert_same_state(theirs, twin)  # the file is what diffusers considers ldm naming

    weights = strip_prefix(load_safetensors(path), "first_stage_model.")
    keymap = vae.LDM_KEYMAP if levels == 4 else vae.ldm_keymap(levels)
    assert vae.ldm_num_blocks(weights) == levels
    config = vae.config_from_ldm(weights, defaults=dict(vae.SD3_CONFIG, norm_num_groups=spec["norm_num_groups"]))
    for key in ("in_channels", "out_channels", "block_out_channels", "layers_per_block", "latent_channels",
                "use_quant_conv", "use_post_quant_conv", "mid_block_add_attention", "down_block_types",
                "up_block_types", "norm_num_groups", "scaling_factor", "shift_factor"):
        assert config[key] == getattr(twin.config, key) or list(config[key]) == list(getattr(twin.config, key)), key
    ours = build(vae, config, remap(weights, keymap), path)
    check_parity(ours, theirs, spec)


def test_sd3_vae_wrong_config_names_the_key(tmp_path):
    twin = make_sd3_twin(SD3_CONFIGS["four_levels"], seed=1)
    twin.save_pretrained(str(tmp_path))
    config = json.loads((tmp_path / "config.json").read_text())
    config["latent_channels"] = 9
    with pytest.raises(MlxdiffError, match="conv_in"):
        build(vae, config, load_folder(tmp_path), tmp_path)
    with pytest.raises(MlxdiffError, match="up_block_types"):
        vae.Model(vae.ModelArgs.from_dict(dict(config, up_block_types=["AttnUpDecoderBlock2D"] * 4)))
    with pytest.raises(MlxdiffError, match="not an ldm-named VAE"):
        vae.config_from_ldm({"decoder.conv_in.weight": mx.zeros((4, 4, 3, 3))})


# -- FLUX.2 AutoencoderKLFlux2 -----------------------------------------------------------------------------------

@pytest.mark.parametrize("name", list(FLUX2_CONFIGS))
def test_flux2_vae_matches_diffusers(name, tmp_path):
    spec = FLUX2_CONFIGS[name]
    twin = make_flux2_twin(spec, seed=11)
    ours = save_and_load(twin, tmp_path, vae_flux2)
    check_parity(ours, twin, spec)


@pytest.mark.parametrize("name", list(FLUX2_CONFIGS))
def test_flux2_latent_normalisation_matches_pipeline(name, tmp_path):
    """patchify + bn-normalise (Flux2Pipeline._encode_vae_image) and the inverse before decoding (its __call__)."""
    import torch
    from diffusers import Flux2Pipeline
    spec = FLUX2_CONFIGS[name]
    twin = make_flux2_twin(spec, seed=13)
    ours = save_and_load(twin, tmp_path, vae_flux2)
    image, latent = inputs(spec, twin, seed=1)
    pipe = SimpleNamespace(vae=twin, _patchify_latents=Flux2Pipeline._patchify_latents)
    with torch.no_grad():
        encoded = Flux2Pipeline._encode_vae_image(pipe, torch.from_numpy(image), None).numpy()
    assert max_rel_err(ours.patchify_and_normalize(ours.encode(mx.array(image))), encoded) <= TOL

    denoised = vae_flux2.patchify(mx.array(latent)) * 1.7 - 0.3  # some [B, 4C, h, w] transformer output
    z = torch.from_numpy(np.array(denoised))
    with torch.no_grad():  # the decode branch of Flux2Pipeline.__call__
        bn_mean = twin.bn.running_mean.view(1, -1, 1, 1)
        bn_std = torch.sqrt(twin.bn.running_var.view(1, -1, 1, 1) + twin.config.batch_norm_eps)
        z = Flux2Pipeline._unpatchify_latents(z * bn_std + bn_mean)
        decoded = twin.decode(z, return_dict=False)[0].numpy()
    assert max_rel_err(ours.decode(ours.denormalize_and_unpatchify(denoised)), decoded) <= TOL
    # patchify is a pure permutation: exact round trip, and the same layout as diffusers'
    x = mx.array(latent)
    assert mx.array_equal(vae_flux2.unpatchify(vae_flux2.patchify(x)), x)
    np.testing.assert_array_equal(np.array(vae_flux2.patchify(x)),
                                  Flux2Pipeline._patchify_latents(torch.from_numpy(latent)).numpy())


@pytest.mark.parametrize("name", list(FLUX2_CONFIGS))
def test_flux2_vae_from_original_names(name, tmp_path):
    """BFL `ae.safetensors` naming: ldm names with encoder.quant_conv / decoder.post_quant_conv and bn.*.

    diffusers has no single-file loader for AutoencoderKLFlux2 (its converter lives in
    scripts/convert_flux2_to_diffusers.py, outside the wheel), so the shared ldm part of the test file is checked
    with diffusers' convert_ldm_vae_checkpoint, which that script duplicates."""
    import torch
    from diffusers.loaders.single_file_utils import convert_ldm_vae_checkpoint
    from safetensors.torch import save_file
    spec = FLUX2_CONFIGS[name]
    levels = len(spec["block_out_channels"])
    twin = make_flux2_twin(spec, seed=17)
    state = twin.state_dict()
    ldm = diffusers_to_ldm(state, levels)
    converted = convert_ldm_vae_checkpoint(ldm, dict(twin.config))
    assert converted.keys() == {k for k in state if not k.startswith("bn.")}
    assert all(torch.equal(converted[k], state[k]) for k in converted)

    original = {("encoder." + k if k.startswith("quant_conv.") else "decoder." + k
                 if k.startswith("post_quant_conv.") else k): v for k, v in ldm.items()}
    assert "encoder.quant_conv.weight" in original and "bn.num_batches_tracked" in original
    path = tmp_path / "ae.safetensors"
    save_file(original, str(path))
    weights = load_safetensors(path)
    config = vae_flux2.config_from_original(weights)
    config["norm_num_groups"] = spec["norm_num_groups"]  # not readable from shapes (FLUX.2 uses 32)
    for key in ("block_out_channels", "layers_per_block", "latent_channels", "use_quant_conv", "use_post_quant_conv",
                "mid_block_add_attention", "decoder_block_out_channels"):
        want = getattr(twin.config, key)
        got = config.get(key)
        assert (list(got) if isinstance(got, (list, tuple)) else got) == \
            (list(want) if isinstance(want, (list, tuple)) else want), key
    keymap = vae_flux2.ORIGINAL_KEYMAP if levels == 4 else vae_flux2.original_keymap(levels)
    ours = build(vae_flux2, config, remap(weights, keymap), path)
    check_parity(ours, twin, spec)
    np.testing.assert_array_equal(np.array(ours.bn.running_var), twin.bn.running_var.numpy())
