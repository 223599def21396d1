"""Parity of mlxdiff.models.vae_qwenimage21 with diffusers' AutoencoderKLQwenImage21 at a tiny config: decode and
encode (the posterior's mean and logvar) of one RGBA frame, a temporal level (the zero-padded AvgDown3D / the last
copy of DupUp3D) and a spatial-only one. Tiling is vae_qwenimage.Model's (tests/test_vae_qwenimage.py)."""

import numpy as np
import pytest
import torch

import mlxdiff  # noqa: F401  (OpenBLAS preload before mlx)
import mlx.core as mx

from helpers import load_ours, max_rel_err, randomize_
from mlxdiff.errors import MlxdiffError
from mlxdiff.models import vae_qwenimage21

# every width differs: encoder 6 / decoder 10 base, 12 latent channels, 4 image channels (RGBA); three levels down
# (factor 8), the first spatial only, the others also temporal (the real one: (False, True, True, True))
CONFIG = dict(base_dim=6, decoder_base_dim=10, z_dim=12, dim_mult=[1, 2, 4, 4], num_res_blocks=1,
              temperal_downsample=[False, True, True], latents_mean=[0.1 * i for i in range(12)],
              latents_std=[1.0 + 0.1 * i for i in range(12)], in_channels=4, out_channels=4,
              scale_factor_spatial=8)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    from diffusers import AutoencoderKLQwenImage21
    torch.manual_seed(0)
    model = randomize_(AutoencoderKLQwenImage21(**CONFIG), seed=1).eval()
    folder = tmp_path_factory.mktemp("vae_qwenimage21")
    model.save_pretrained(str(folder))
    return model, load_ours(folder, vae_qwenimage21)


def test_decode_and_encode(saved):
    torch_vae, ours = saved
    rng = np.random.default_rng(0)
    z = rng.standard_normal((2, 12, 1, 5, 7)).astype(np.float32)
    with torch.no_grad():
        ref = torch_vae.decode(torch.from_numpy(z)).sample.numpy()
    out = np.array(ours.decode(mx.array(z)))
    assert out.shape == (2, 4, 40, 56) and ref.shape == (2, 4, 1, 40, 56)
    err = max_rel_err(out, ref[:, :, 0])
    print(f"Qwen-Image 2.1 VAE decode: max_rel_err {err:.2e}")
    assert err <= 1e-4
    assert 0.05 < np.mean(np.abs(ref) >= 1.0) < 0.95 or np.abs(ref).max() < 1.0    # not all clamped

    image = rng.uniform(-1, 1, (2, 4, 1, 40, 56)).astype(np.float32)
    with torch.no_grad():
        dist = torch_vae.encode(torch.from_numpy(image)).latent_dist
    mean, logvar = ours.encode_moments(mx.array(image))
    for name, a, b in (("mean", mean, dist.mean), ("logvar", logvar, dist.logvar)):
        err = max_rel_err(np.array(a), b.numpy()[:, :, 0])
        print(f"Qwen-Image 2.1 VAE encode {name}: max_rel_err {err:.2e}")
        assert err <= 1e-4


def test_latent_scaling_and_config():
    model = vae_qwenimage21.Model(vae_qwenimage21.ModelArgs.from_dict(CONFIG))
    assert model.factor == 8
    x = mx.array(np.random.default_rng(2).standard_normal((1, 12, 2, 3)).astype(np.float32))
    assert np.allclose(np.array(model.unscale_latents(model.scale_latents(x))), np.array(x), atol=1e-5)
    assert vae_qwenimage21.ModelArgs().z_dim == 64 and len(vae_qwenimage21.LATENTS_STD) == 64
    with pytest.raises(MlxdiffError, match="dim_mult"):
        vae_qwenimage21.ModelArgs.from_dict(dict(CONFIG, dim_mult=[1, 2, 4, 3]))
    with pytest.raises(MlxdiffError, match="is_residual"):
        vae_qwenimage21.ModelArgs.from_dict(dict(CONFIG, is_residual=False))
