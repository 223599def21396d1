"""Qwen-Image VAE parity (models/vae_qwenimage.py, one frame) against diffusers' AutoencoderKLQwenImage, float32, a
tiny random config with distinct dimensions (3 levels, temperal_downsample like the real one's last levels; no
attention scale: diffusers' encoder cannot run one, ModelArgs refuses it). diffusers runs its 3-D causal
convolutions on [B, C, 1, H, W]; ours runs 2-D convolutions on the kernels' last temporal slice, so matching outputs
also prove that reduction. Weights reach our model only through our loaders (a save_pretrained folder, or the Wan /
ComfyUI names written by the inverse map, qwenimage_helpers.to_original)."""

import numpy as np
import pytest

import mlxdiff  # noqa: F401
import mlx.core as mx

from helpers import load_ours, max_rel_err, randomize_
from mlxdiff.errors import MlxdiffError
from mlxdiff.formats.safetensors import load_folder
from mlxdiff.loading.build import build
from mlxdiff.loading.spec import ARCHITECTURES
from mlxdiff.models import vae_qwenimage
from qwenimage_helpers import to_original

TOL = 1e-4
CONFIG = dict(base_dim=6, z_dim=5, dim_mult=[1, 2, 3], num_res_blocks=2, attn_scales=[],
              temperal_downsample=[False, True], latents_mean=[0.3, -0.2, 0.1, 0.5, -0.4],
              latents_std=[1.5, 0.7, 2.1, 1.1, 0.9])
IMAGE = (2, 3, 40, 56)


@pytest.fixture(scope="module")
def twin():
    import torch
    from diffusers import AutoencoderKLQwenImage
    model = randomize_(AutoencoderKLQwenImage(**CONFIG), seed=7).eval()
    with torch.no_grad():      # RMS gammas around 1 (randomize_ centres only *norm.weight on 1)
        for name, p in model.named_parameters():
            if name.endswith("gamma"):
                p.add_(1.0)
    return model


@pytest.fixture(scope="module")
def folder(twin, tmp_path_factory):
    path = tmp_path_factory.mktemp("qwenimage_vae")
    twin.save_pretrained(str(path))
    return path


@pytest.fixture(scope="module")
def ours(folder):
    return load_ours(folder, vae_qwenimage)


def inputs(seed=0):
    rng = np.random.default_rng(seed)
    b, c, h, w = IMAGE
    image = rng.uniform(-1, 1, IMAGE).astype(np.float32)
    latent = (rng.standard_normal((b, CONFIG["z_dim"], h // 4, w // 4)) * 0.5).astype(np.float32)
    return image, latent


def reference(twin, image, latent):
    import torch
    with torch.no_grad():
        posterior = twin.encode(torch.from_numpy(image)[:, :, None]).latent_dist     # [B, C, 1, H, W]
        decoded = twin.decode(torch.from_numpy(latent)[:, :, None]).sample
    return posterior, decoded[:, :, 0].numpy()


def check(model, twin):
    image, latent = inputs()
    posterior, decoded = reference(twin, image, latent)
    mean, logvar = model.encode_moments(mx.array(image))
    out = model.decode(mx.array(latent))
    assert out.shape == decoded.shape == IMAGE
    # the random twin's output is not all clamped to [-1, 1] (so the decode comparison means something)
    assert (np.abs(decoded) < 0.999).mean() > 0.5
    errors = {"mean": max_rel_err(mean, posterior.mean[:, :, 0].numpy()),
              "logvar": max_rel_err(logvar, posterior.logvar[:, :, 0].numpy()),
              "decode": max_rel_err(out, decoded)}
    assert all(e <= TOL for e in errors.values()), errors
    return errors


def test_registered():
    assert ARCHITECTURES["AutoencoderKLQwenImage"] is vae_qwenimage


def test_defaults_are_qwen_image():
    from diffusers import AutoencoderKLQwenImage
    import inspect
    params = inspect.signature(AutoencoderKLQwenImage.__init__).parameters
    args = vae_qwenimage.ModelArgs()
    for name in ("base_dim", "z_dim", "dim_mult", "num_res_blocks", "attn_scales", "temperal_downsample",
                 "input_channels", "latents_mean", "latents_std"):
        default, ours = params[name].default, getattr(args, name)
        assert (list(ours) == default) if isinstance(default, list) else ours == default, name


def test_encode_and_decode_match_diffusers(ours, twin):
    check(ours, twin)
    # the 5-D T = 1 form is taken too
    image, latent = inputs()
    assert np.array_equal(np.array(ours.encode(mx.array(image)[:, :, None])), np.array(ours.encode(mx.array(image))))
    with pytest.raises(MlxdiffError, match="frames"):
        ours.decode(mx.zeros((1, CONFIG["z_dim"], 2, 4, 4)))


def test_pipeline_latent_convention(ours, twin):
    """QwenImageImg2ImgPipeline._encode_vae_image: posterior.sample(generator) then (x - mean) * (1 / std); the
    decode tail: x / (1 / std) + mean."""
    import torch
    from diffusers.utils.torch_utils import randn_tensor
    image, _ = inputs(1)
    posterior, _ = reference(twin, image, np.zeros((1, CONFIG["z_dim"], 1, 1), np.float32))
    sampled = posterior.sample(generator=torch.Generator().manual_seed(3))
    noise = randn_tensor(posterior.mean.shape, generator=torch.Generator().manual_seed(3))
    mean_t = torch.tensor(CONFIG["latents_mean"]).view(1, -1, 1, 1, 1)
    inv_std_t = 1.0 / torch.tensor(CONFIG["latents_std"]).view(1, -1, 1, 1, 1)
    expected = ((sampled - mean_t) * inv_std_t)[:, :, 0].numpy()

    mean, logvar = ours.encode_moments(mx.array(image))
    latents = ours.scale_latents(ours.sample_latents(mean, logvar, mx.array(noise[:, :, 0].numpy())))
    assert max_rel_err(latents, expected) <= TOL
    back = ours.unscale_latents(mx.array(expected))
    assert max_rel_err(back, (torch.from_numpy(expected)[:, :, None] / inv_std_t + mean_t)[:, :, 0].numpy()) <= TOL


def test_tiled_decode_matches_diffusers_tiling(ours, twin):
    import torch
    _, latent = inputs(2)
    twin.enable_tiling(tile_sample_min_height=32, tile_sample_min_width=32, tile_sample_stride_height=24,
                       tile_sample_stride_width=24)
    try:
        with torch.no_grad():
            ref = twin.decode(torch.from_numpy(latent)[:, :, None]).sample[:, :, 0].numpy()
    finally:
        twin.use_tiling = False
    out = ours.decode(mx.array(latent), tiling=True, tile_latent_size=8, overlap=0.25)
    assert max_rel_err(out, ref) <= TOL
    assert ours.decode_bytes((1, 5, 10, 14), mx.float32) > 0


def test_banded_convolutions_are_exact(ours):
    _, latent = inputs(3)
    plain = np.array(ours.decode(mx.array(latent)))
    ours.set_memory_policy(after_stage=mx.eval, band_bytes=4096)
    try:
        banded = np.array(ours.decode(mx.array(latent)))
    finally:
        ours.set_memory_policy()
    assert np.allclose(banded, plain, atol=1e-5)


# -- the Wan / ComfyUI naming ----------------------------------------------------------------------------------


def test_original_names(folder, twin):
    from diffusers.loaders.single_file_utils import convert_wan_vae_to_diffusers
    weights = load_folder(folder)
    original = {to_original(k, CONFIG["num_res_blocks"]): v for k, v in weights.items()}
    assert len(original) == len(weights)
    # the inverse map is diffusers' converter's inverse (num_res_blocks 2: what its decoder table handles)
    converted = convert_wan_vae_to_diffusers({k: 0 for k in original})
    assert sorted(converted) == sorted(weights)
    assert vae_qwenimage.has_original_names(original) and not vae_qwenimage.has_original_names(weights)
    renamed = vae_qwenimage.original_to_diffusers(original)
    assert sorted(renamed) == sorted(weights)
    assert all(renamed[k] is weights[k] or np.array_equal(np.array(renamed[k]), np.array(weights[k]))
               for k in weights)
    ours = build(vae_qwenimage, dict(CONFIG), renamed, "original names")
    check(ours, twin)


def test_config_from_original_shapes(folder):
    weights = load_folder(folder)
    original = {to_original(k, CONFIG["num_res_blocks"]): v for k, v in weights.items()}
    with pytest.raises(MlxdiffError, match="latent statistics"):
        vae_qwenimage.config_from_original(original)
    # the real layout's names (shapes only): Qwen-Image's config back
    import torch
    from diffusers import AutoencoderKLQwenImage
    with torch.device("meta"):
        real = AutoencoderKLQwenImage()
    shapes = {to_original(k, 2): np.empty(tuple(v.shape), np.float32) for k, v in real.state_dict().items()}
    config = vae_qwenimage.config_from_original(shapes)
    args = vae_qwenimage.ModelArgs.from_dict(config)
    default = vae_qwenimage.ModelArgs()
    assert {k: list(v) if isinstance(v, (list, tuple)) else v for k, v in args.__dict__.items()} == \
        {k: list(v) if isinstance(v, (list, tuple)) else v for k, v in default.__dict__.items()}
    assert vae_qwenimage.original_keymap(4, 2) == vae_qwenimage.ORIGINAL_KEYMAP


def test_bad_config():
    with pytest.raises(MlxdiffError, match="attn_scales"):
        vae_qwenimage.ModelArgs.from_dict({**CONFIG, "attn_scales": [0.5]})
    with pytest.raises(MlxdiffError, match="temperal_downsample"):
        vae_qwenimage.ModelArgs.from_dict({**CONFIG, "temperal_downsample": [True]})
    with pytest.raises(MlxdiffError, match="latents_std"):
        vae_qwenimage.ModelArgs.from_dict({**CONFIG, "latents_std": [1.0]})
