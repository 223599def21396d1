"""VAE tiling: our tiled decode / encode against diffusers' own (`enable_tiling()`), float32, tiny configs whose
latents span several tiles in both directions; what the blend changes against untiled decoding; and the memory
bound that is the point of tiling. Weights reach our model only through our loader (save_pretrained folder)."""

import numpy as np
import pytest

import mlxdiff  # noqa: F401
import mlx.core as mx

from helpers import load_ours, max_rel_err, in_fresh_process, mlx_peak_above_live, randomize_
from mlxdiff.errors import MlxdiffError
from mlxdiff.models import vae, vae_flux2

TOL = 1e-4

# tile: the latent tile given to our tiled_decode and set on the twin (None: both use the config's sample_size,
# diffusers' default tile_sample_min_size, with tile_latent_min_size = sample_size / 2**(levels - 1)).
# latent: (batch, h, w), every size distinct and not a multiple of the tile stride, so edge tiles are partial.
SD3_SPECS = {
    "config_default_tile": dict(block_out_channels=(8, 12, 20), layers_per_block=1, latent_channels=6,
                                norm_num_groups=4, use_quant_conv=False, use_post_quant_conv=False, sample_size=32,
                                tile=None, overlap=0.25, latent=(2, 20, 28)),
    "quant_convs_four_levels": dict(block_out_channels=(10, 15, 25, 20), layers_per_block=1, latent_channels=7,
                                    norm_num_groups=5, use_quant_conv=True, use_post_quant_conv=True,
                                    sample_size=1024, tile=6, overlap=0.25, latent=(1, 15, 17)),
}
FLUX2_SPECS = {
    "attention": dict(block_out_channels=(8, 12, 16), layers_per_block=1, latent_channels=5, norm_num_groups=4,
                      tile=8, overlap=0.25, latent=(1, 18, 26)),
    "small_decoder_wide_overlap": dict(block_out_channels=(12, 18), decoder_block_out_channels=(9, 15),
                                       layers_per_block=2, latent_channels=7, norm_num_groups=3,
                                       mid_block_add_attention=False, tile=10, overlap=0.4, latent=(2, 22, 17)),
}


def twin_config(spec):
    return {k: v for k, v in spec.items() if k not in ("tile", "overlap", "latent")}


def make_twin(arch, spec, seed):
    import torch
    from diffusers import AutoencoderKL, AutoencoderKLFlux2
    n = len(spec["block_out_channels"])
    cls = AutoencoderKL if arch is vae else AutoencoderKLFlux2
    model = cls(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * n,
                up_block_types=("UpDecoderBlock2D",) * n, **twin_config(spec))
    randomize_(model, seed=seed)
    if arch is vae_flux2:  # not used by decode/encode, but loaded strictly
        g = torch.Generator().manual_seed(seed + 100)
        with torch.no_grad():
            model.bn.running_mean.copy_(torch.randn(model.bn.running_mean.shape, generator=g))
            model.bn.running_var.copy_(torch.rand(model.bn.running_var.shape, generator=g) * 2 + 0.1)
    model.eval()
    factor = 2 ** (n - 1)
    model.enable_tiling()
    if spec["tile"] is not None:
        model.tile_latent_min_size = spec["tile"]
        model.tile_sample_min_size = spec["tile"] * factor
    model.tile_overlap_factor = spec["overlap"]
    return model


def twin_and_ours(arch, spec, tmp_path, seed=3):
    twin = make_twin(arch, spec, seed)
    twin.save_pretrained(str(tmp_path))
    return twin, load_ours(tmp_path, arch, dtype=None)   # build's default compute dtype


def inputs(spec, twin, seed=0):
    rng = np.random.default_rng(seed)
    batch, h, w = spec["latent"]
    f = 2 ** (len(spec["block_out_channels"]) - 1)
    latent = rng.standard_normal((batch, twin.config.latent_channels, h, w)).astype(np.float32)
    image = rng.uniform(-1, 1, (batch, 3, h * f, w * f)).astype(np.float32)
    return latent, image


def tile_counts(size, tile, overlap):
    """How many tiles diffusers' loop visits along an axis of `size`."""
    return len(range(0, size, int(tile * (1 - overlap))))


def check_tiled_parity(arch, spec, tmp_path):
    import torch
    twin, ours = twin_and_ours(arch, spec, tmp_path)
    latent, image = inputs(spec, twin)
    latent_tile, sample_tile = ours.tile_sizes(spec["tile"])
    assert (latent_tile, sample_tile) == (twin.tile_latent_min_size, twin.tile_sample_min_size)
    # several tiles in both directions, so blend_v, blend_h and partial edge tiles all occur
    assert min(tile_counts(n, latent_tile, spec["overlap"]) for n in latent.shape[2:]) >= 3
    assert min(tile_counts(n, sample_tile, spec["overlap"]) for n in image.shape[2:]) >= 3
    with torch.no_grad():  # the twin tiles because tiling is enabled and the inputs exceed its tiles
        decoded = twin.decode(torch.from_numpy(latent)).sample.numpy()
        posterior = twin.encode(torch.from_numpy(image)).latent_dist
    tiled = ours.tiled_decode(mx.array(latent), spec["tile"], spec["overlap"])
    mean, logvar = ours.tiled_encode_moments(mx.array(image), spec["tile"], spec["overlap"])
    errors = {"decode": max_rel_err(tiled, decoded), "mean": max_rel_err(mean, posterior.mean.numpy()),
              "logvar": max_rel_err(logvar, posterior.logvar.numpy())}
    assert all(e <= TOL for e in errors.values()), errors
    # automatic tiling: these inputs exceed the tile, so decode / encode tile by themselves
    auto = ours.decode(mx.array(latent), tile_latent_size=spec["tile"], overlap=spec["overlap"])
    assert np.array_equal(np.array(auto), np.array(tiled))
    auto_mean = ours.encode(mx.array(image), tile_latent_size=spec["tile"], overlap=spec["overlap"])
    assert np.array_equal(np.array(auto_mean), np.array(mean))
    return errors


@pytest.mark.parametrize("name", list(SD3_SPECS))
def test_sd3_tiled_matches_diffusers(name, tmp_path):
    check_tiled_parity(vae, SD3_SPECS[name], tmp_path)


@pytest.mark.parametrize("name", list(FLUX2_SPECS))
def test_flux2_tiled_matches_diffusers(name, tmp_path):
    check_tiled_parity(vae_flux2, FLUX2_SPECS[name], tmp_path)


# The blend's inherent difference from untiled decoding: each tile is decoded with only its own context (3x3
# convolutions, group-norm statistics, the mid-block attention), and the cross-fade only smooths the seams. Random
# tiny weights have no spatial smoothness, so it is large (tens of percent); the reference for it is diffusers' own
# tiled decode of the same twin (enable_tiling), which ours must match within TOL, while differing from the untiled
# decode by more than BLEND_AT_LEAST (so the automatic path really tiled, and the parity is not the untiled one's).
BLEND_AT_LEAST = 100 * TOL


def test_tiled_vs_untiled_decode(tmp_path):
    import torch
    spec = SD3_SPECS["config_default_tile"]
    twin, ours = twin_and_ours(vae, spec, tmp_path)
    latent, _ = inputs(spec, twin)
    z = mx.array(latent)
    untiled = ours.decode(z, tiling=False)
    with torch.no_grad():
        twin.disable_tiling()
        reference_untiled = twin.decode(torch.from_numpy(latent)).sample.numpy()
        twin.enable_tiling()     # the config's own tile (spec["tile"] None), as ours' automatic decode takes it
        reference_tiled = twin.decode(torch.from_numpy(latent)).sample.numpy()
    assert max_rel_err(untiled, reference_untiled) <= TOL  # tiling=False is the plain decode
    tiled = ours.decode(z)  # automatic: 20x28 exceeds the config's 8x8 latent tile
    assert np.array_equal(np.array(tiled), np.array(ours.tiled_decode(z)))
    assert max_rel_err(tiled, reference_tiled) <= TOL      # the blend diffusers' tiling gives
    reference_difference = max_rel_err(reference_tiled, reference_untiled)
    assert reference_difference > BLEND_AT_LEAST, reference_difference
    assert max_rel_err(tiled, untiled) > BLEND_AT_LEAST
    # a latent that fits in one tile is decoded untiled by default
    small = z[:, :, :8, :8]
    assert np.array_equal(np.array(ours.decode(small)), np.array(ours.decode(small, tiling=False)))
    # forced tiling of a latent no larger than the stride (6 = 8 * 0.75) visits one tile: the plain decode
    single = z[:, :, :6, :6]
    assert np.array_equal(np.array(ours.decode(single, tiling=True)), np.array(ours.decode(single, tiling=False)))


def test_tiling_arguments_are_checked(tmp_path):
    ours = vae.Model(vae.ModelArgs(block_out_channels=(8, 12), layers_per_block=1, latent_channels=4,
                                   norm_num_groups=4, down_block_types=("DownEncoderBlock2D",) * 2,
                                   up_block_types=("UpDecoderBlock2D",) * 2))
    assert ours.tile_sizes() == (512, 1024)  # diffusers' defaults for a 2-level VAE with sample_size 1024
    assert ours.tile_sizes(12) == (12, 24)
    z = mx.zeros((1, 4, 6, 6))
    with pytest.raises(MlxdiffError, match="overlap"):
        ours.tiled_decode(z, 4, overlap=1.0)
    with pytest.raises(MlxdiffError, match="does not advance"):
        ours.tiled_decode(z, 1, overlap=0.5)
    with pytest.raises(MlxdiffError, match="tile_latent_size"):
        ours.tiled_decode(z, 0)


def decode_peak(model, z, **kw):
    """MLX peak memory above what is live before the call (weights and input), in bytes."""
    with mlx_peak_above_live() as peak:
        out = model.decode(z, **kw)
        mx.eval(out)
    return peak.bytes, out


@in_fresh_process
def test_tiled_decode_memory_is_bounded_by_the_tile():
    """SD3's layout at half its widths (3 levels of 64/128/256 channels, 16 latent channels, 32 groups): a 32x32
    latent (128x128 image) decoded whole and in 8x8 latent tiles (32x32 pixels, 5x5 tiles with the overlap).

    MLX's active peak on mlx-cpu, op after op (tests/helpers.mlx_peak_above_live): untiled 100.3 MiB, tiled 6.59 MiB
    (15.2x less), one 8x8 tile decoded alone 6.31 MiB (`python -m pytest -n 0 -s tests/test_vae_tiling.py -k
    bounded_by_the_tile` prints them): the tiled peak is one tile's activations plus image-sized buffers,
    independent of the image size."""
    mx.random.seed(0)
    levels = 3
    model = vae.Model(vae.ModelArgs(block_out_channels=(64, 128, 256), layers_per_block=1, latent_channels=16,
                                    norm_num_groups=32, down_block_types=("DownEncoderBlock2D",) * levels,
                                    up_block_types=("UpDecoderBlock2D",) * levels))
    mx.eval(model.parameters())
    z = mx.random.normal((1, 16, 32, 32))
    mx.eval(z)
    untiled_peak, untiled = decode_peak(model, z, tiling=False)
    tiled_peak, tiled = decode_peak(model, z, tiling=True, tile_latent_size=8)
    one_tile_peak, _ = decode_peak(model, z[:, :, :8, :8], tiling=False)
    image_bytes = tiled.nbytes
    print(f"MLX active peak above the live arrays: untiled {untiled_peak / 2**20:.2f} MiB, tiled {tiled_peak / 2**20:.2f}"
          f" MiB, one tile {one_tile_peak / 2**20:.2f} MiB; image {image_bytes / 2**20:.4f} MiB")
    assert tiled.shape == untiled.shape == (1, 3, 128, 128)
    assert untiled_peak > 10 * tiled_peak, (untiled_peak, tiled_peak)
    # one tile's decode plus the assembled image (rows, their concatenation, the previous row of tiles)
    assert tiled_peak <= one_tile_peak + 4 * image_bytes, (tiled_peak, one_tile_peak, image_bytes)
