"""Parity of mlxdiff.models.mmdit with diffusers' SD3Transformer2DModel (MMDiT and MMDiT-X), from a diffusers folder
and from an original single file (Stability's `model.diffusion_model.*` names)."""

import json

import numpy as np
import pytest

import mlxdiff  # noqa: F401  (OpenBLAS preload before mlx)
import mlx.core as mx

from helpers import load_ours, max_rel_err, randomize_, saved_model_fixture
from mlxdiff.formats.safetensors import load_folder, load_safetensors
from mlxdiff.loading.build import build
from mlxdiff.models import mmdit
from twins import sd3_to_sai

# Every dimension differs from the others (D, 4D, heads, head dim, joint, pooled, channels, patch^2*out, text
# length, grid), so a swapped axis cannot pass. pos_embed_max_size exceeds the latent grid on both axes, so the
# centre crop (top != left) matters.
CONFIGS = {
    # SD3.5 Medium-like: dual attention (MMDiT-X) in blocks 0 and 2, qk RMSNorm, patch 2, in != out channels
    "mmditx": dict(sample_size=128, patch_size=2, in_channels=5, num_layers=4, attention_head_dim=12,
                   num_attention_heads=3, joint_attention_dim=20, caption_projection_dim=36, pooled_projection_dim=26,
                   out_channels=7, pos_embed_max_size=9, dual_attention_layers=(0, 2), qk_norm="rms_norm"),
    # SD3.0-like: no dual attention, no qk norm (head size 64, as the originals), patch 3
    "mmdit": dict(sample_size=128, patch_size=3, in_channels=4, num_layers=3, attention_head_dim=64,
                  num_attention_heads=2, joint_attention_dim=24, caption_projection_dim=128, pooled_projection_dim=40,
                  out_channels=5, pos_embed_max_size=7, dual_attention_layers=(), qk_norm=None),
}
# Parameter noise scale for randomize_. Without qk norm (head size 64, D=128) noise of 0.2 makes the attention
# logits so large that the model is chaotic: torch's own float32 output is up to 3.5e-2 away from its float64
# output, so no float32 reimplementation could be compared at 1e-4. At 0.1 torch float32 is within 1e-6 of float64.
RANDOM_SCALE = {"mmditx": 0.2, "mmdit": 0.1}
LATENT_HW = {"mmditx": (10, 14), "mmdit": (9, 15)}   # grids 5x7 of 9x9 and 3x5 of 7x7
TEXT_LEN = {"mmditx": 11, "mmdit": 13}


def make_torch_model(name, seed):
    import torch
    from diffusers import SD3Transformer2DModel
    torch.manual_seed(seed)
    model = SD3Transformer2DModel(**CONFIGS[name])
    randomize_(model, seed=seed, scale=RANDOM_SCALE[name])
    with torch.no_grad():  # the position table is a buffer, which randomize_ leaves alone; random rows make a wrong
        table = model.pos_embed.pos_embed  # crop offset impossible to miss
        table.copy_(torch.randn(table.shape, generator=torch.Generator().manual_seed(seed + 1)))
    return model.eval()


def make_inputs(name, seed=0):
    cfg, (h, w) = CONFIGS[name], LATENT_HW[name]
    rng = np.random.default_rng(seed)
    return dict(hidden_states=rng.standard_normal((2, cfg["in_channels"], h, w)).astype(np.float32),
                encoder_hidden_states=rng.standard_normal((2, TEXT_LEN[name], cfg["joint_attention_dim"])).astype(
                    np.float32),
                pooled_projections=rng.standard_normal((2, cfg["pooled_projection_dim"])).astype(np.float32),
                timestep=np.array([981.0, 203.5], dtype=np.float32))


def torch_forward(model, inputs, skip_layers=None):
    import torch
    with torch.no_grad():
        out = model(**{k: torch.from_numpy(v) for k, v in inputs.items()}, skip_layers=skip_layers, return_dict=False)
    return out[0].numpy()


def mlx_forward(model, inputs, skip_layers=None):
    out = model(**{k: mx.array(v) for k, v in inputs.items()}, skip_layers=skip_layers)
    return np.array(out.astype(mx.float32))


saved = saved_model_fixture(make_torch_model, CONFIGS, "sd3")   # (config name, torch model, its folder)


@pytest.mark.parametrize("skip_layers", [None, [1], [0, -1]], ids=["all", "skip1", "skip_first_last"])
def test_folder_parity(saved, skip_layers):
    name, torch_model, folder = saved
    if skip_layers and -1 in skip_layers:  # the last (context_pre_only) block skipped too
        skip_layers = [0, CONFIGS[name]["num_layers"] - 1]
    inputs = make_inputs(name)
    ref = torch_forward(torch_model, inputs, skip_layers)
    ours = mlx_forward(load_ours(folder, mmdit), inputs, skip_layers)
    err = max_rel_err(ours, ref)
    print(f"{name} skip={skip_layers}: max_rel_err {err:.2e}")
    assert ours.shape == (2, CONFIGS[name]["out_channels"], *LATENT_HW[name])
    assert err <= 1e-4
    if skip_layers:  # skipping must matter, or the test above proves nothing about it
        assert max_rel_err(torch_forward(torch_model, inputs), ref) > 1e-2


def test_crop_too_large_is_a_clear_error(saved):
    from mlxdiff.errors import MlxdiffError
    name, _, folder = saved
    cfg = CONFIGS[name]
    inputs = make_inputs(name)
    side = (cfg["pos_embed_max_size"] + 1) * cfg["patch_size"]
    inputs["hidden_states"] = np.zeros((2, cfg["in_channels"], side, cfg["patch_size"]), np.float32)
    with pytest.raises(MlxdiffError, match="pos_embed_max_size"):
        load_ours(folder, mmdit)(**{k: mx.array(v) for k, v in inputs.items()})


# -- original single-file naming ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def single_file(saved, tmp_path_factory):
    """The saved model's weights written in original naming, as Stability's sd3.5_*.safetensors (plus a stray
    VAE key, which the transformer loader must leave out)."""
    import torch
    from safetensors.torch import save_file
    name, torch_model, folder = saved
    sd = {k: v.detach().clone().contiguous() for k, v in torch_model.state_dict().items()}
    original = sd3_to_sai(sd, CONFIGS[name]["num_layers"])
    assert sum(v.numel() for v in original.values()) == sum(v.numel() for v in sd.values())  # nothing dropped
    tensors = {"model.diffusion_model." + k: v for k, v in original.items()}
    tensors["first_stage_model.decoder.conv_in.bias"] = torch.zeros(3)
    path = tmp_path_factory.mktemp(f"sf_{name}") / "sd3_original.safetensors"
    save_file(tensors, str(path))
    return name, torch_model, folder, path


def test_single_file_parity(single_file):
    import torch
    from diffusers import SD3Transformer2DModel
    name, torch_model, folder, path = single_file
    # diffusers' own converter validates the test-side naming: it must give back the exact state dict
    ref_model = SD3Transformer2DModel.from_single_file(str(path), config=str(folder), local_files_only=True,
                                                       torch_dtype=torch.float32).eval()
    expected, got = torch_model.state_dict(), ref_model.state_dict()
    assert expected.keys() == got.keys()
    for k in expected:
        assert torch.equal(expected[k], got[k]), k

    weights = load_safetensors(path)
    config = mmdit.config_from_original(weights)
    saved_config = json.loads((folder / "config.json").read_text())
    for key, value in config.items():
        assert saved_config[key] == (list(value) if isinstance(value, tuple) else value), key
    assert config.keys() == {k for k in saved_config if not k.startswith("_")}

    mapped = mmdit.original_to_diffusers(weights)
    folder_weights = load_folder(folder)
    assert mapped.keys() == folder_weights.keys()
    for k in mapped:
        assert mx.array_equal(mapped[k], folder_weights[k]).item(), k

    ours_model = build(mmdit, config, mapped, str(path))
    inputs = make_inputs(name, seed=1)
    for skip in (None, [1]):
        ref = torch_forward(ref_model, inputs, skip)
        err = max_rel_err(mlx_forward(ours_model, inputs, skip), ref)
        print(f"{name} single file skip={skip}: max_rel_err {err:.2e}")
        assert err <= 1e-4


def test_config_from_original_real_shapes():
    """Shapes only (no data): the released SD3.5 Medium / Large layouts give their hub configs."""
    medium = {"pos_embed": (1, 147456, 1536), "x_embedder.proj.weight": (1536, 16, 2, 2),
              "context_embedder.weight": (1536, 4096), "y_embedder.mlp.0.weight": (1536, 2048),
              "final_layer.linear.weight": (64, 1536)}
    large = {"pos_embed": (1, 36864, 2432), "x_embedder.proj.weight": (2432, 16, 2, 2),
             "context_embedder.weight": (2432, 4096), "y_embedder.mlp.0.weight": (2432, 2048),
             "final_layer.linear.weight": (64, 2432)}
    for i in range(24):
        medium[f"joint_blocks.{i}.x_block.attn.ln_q.weight"] = (64,)
        if i <= 12:
            medium[f"joint_blocks.{i}.x_block.attn2.qkv.weight"] = (4608, 1536)
    for i in range(38):
        large[f"joint_blocks.{i}.x_block.attn.ln_q.weight"] = (64,)
    as_arrays = lambda d: {k: mx.zeros(s, dtype=mx.bfloat16) for k, s in d.items()}  # noqa: E731  lazy, never evaluated
    m = mmdit.config_from_original(as_arrays(medium))
    assert m == dict(sample_size=128, patch_size=2, in_channels=16, num_layers=24, attention_head_dim=64,
                     num_attention_heads=24, joint_attention_dim=4096, caption_projection_dim=1536,
                     pooled_projection_dim=2048, out_channels=16, pos_embed_max_size=384,
                     dual_attention_layers=list(range(13)), qk_norm="rms_norm")
    assert vars(mmdit.ModelArgs.from_dict(m)) == vars(mmdit.ModelArgs())  # the defaults are SD3.5 Medium
    g = mmdit.config_from_original(as_arrays(large))
    assert (g["num_layers"], g["num_attention_heads"], g["pos_embed_max_size"], g["dual_attention_layers"]) == \
        (38, 38, 192, [])


def test_bf16_weights_stay_bf16_and_compute_in_float32(saved, tmp_path):
    """dtype policy: bf16 weights are kept as stored; the arithmetic is float32. The reference is diffusers with the
    same bf16-rounded weights, run in float32."""
    import torch
    name, _, _ = saved
    bf16_model = make_torch_model(name, seed=len(name)).to(torch.bfloat16)
    bf16_model.save_pretrained(str(tmp_path))
    ours = load_ours(tmp_path, mmdit)
    from mlx.utils import tree_flatten
    assert {v.dtype for _, v in tree_flatten(ours.parameters())} == {mx.bfloat16}
    inputs = make_inputs(name, seed=2)
    out = ours(**{k: mx.array(v) for k, v in inputs.items()})
    assert out.dtype == mx.float32
    ref = torch_forward(bf16_model.float(), inputs)
    err = max_rel_err(np.array(out), ref)
    print(f"{name} bf16 weights, float32 compute: max_rel_err {err:.2e}")
    assert err <= 1e-4


def test_embedding_tables_match_diffusers():
    """The sinusoid and the 2D sin-cos table (the pos_embed a randomly initialised Model starts with)."""
    import torch
    from diffusers.models.embeddings import get_2d_sincos_pos_embed, get_timestep_embedding
    from mlxdiff.models.embeddings import sincos_2d, timestep_embedding
    t = np.array([999.0, 503.25, 1.0, 0.0], np.float32)
    for dim, flip, shift in [(256, True, 0), (33, False, 1)]:
        ref = get_timestep_embedding(torch.from_numpy(t), dim, flip_sin_to_cos=flip, downscale_freq_shift=shift)
        assert max_rel_err(np.array(timestep_embedding(mx.array(t), dim, flip, shift)), ref.numpy()) <= 1e-4
    ref = get_2d_sincos_pos_embed(24, 7, base_size=5, interpolation_scale=1.0, output_type="pt")
    assert max_rel_err(np.array(sincos_2d(24, 7, base_size=5)), ref.numpy()) <= 1e-5
    model = mmdit.Model(mmdit.ModelArgs.from_dict(CONFIGS["mmditx"]))
    ref = get_2d_sincos_pos_embed(36, 9, base_size=64, output_type="pt")
    assert max_rel_err(np.array(model.pos_embed.pos_embed[0]), ref.numpy()) <= 1e-5


def test_compiled_blocks_match_diffusers(saved):
    """Each block compiled whole (models/fused.compiled_block), its outputs paced as the pipelines pace them: the
    same numbers as diffusers, as the eager blocks give."""
    from mlxdiff.pipelines.base import evaluate_each_block
    from mlxdiff.policy import RunPolicy, installed
    name, torch_model, folder = saved
    inputs = make_inputs(name)
    ref = torch_forward(torch_model, inputs)
    model = load_ours(folder, mmdit)
    with installed(RunPolicy(compile_blocks=True)):
        out = model(**{k: mx.array(v) for k, v in inputs.items()}, after_block=evaluate_each_block)
        ours = np.array(out.astype(mx.float32))
        assert all(b.__dict__.get("_compiled") for b in model.transformer_blocks)   # really compiled
    err = max_rel_err(ours, ref)
    print(f"{name} compiled blocks: max_rel_err {err:.2e}")
    assert err <= 1e-4
