"""UNet2DConditionModel parity against diffusers: tiny SD1.5-like and SDXL-like configs with distinct dimensions,
random (perturbed) weights, float32. Weights reach our model through save_pretrained's safetensors and `sanitize`."""

import json

import numpy as np
import pytest

import mlxdiff  # noqa: F401
import mlx.core as mx

from helpers import max_rel_err, randomize_
from mlxdiff.errors import MlxdiffError
from mlxdiff.models import unet
from ldm_helpers import UNET_CONFIGS as CONFIGS

TOL = 1e-4


@pytest.mark.parametrize("name", list(CONFIGS))
def test_unet_matches_diffusers(name, tmp_path):
    import torch
    from diffusers import UNet2DConditionModel

    spec = CONFIGS[name]
    torch.manual_seed(0)
    ref = UNet2DConditionModel(**spec["config"]).eval()
    randomize_(ref, seed=1, scale=0.1)
    ref.save_pretrained(tmp_path, safe_serialization=True)

    config = json.loads((tmp_path / "config.json").read_text())
    model = unet.Model(unet.ModelArgs.from_dict(config))
    weights = mx.load(str(tmp_path / "diffusion_pytorch_model.safetensors"))
    model.load_weights(list(model.sanitize(weights).items()), strict=True)

    rng = np.random.default_rng(2)
    b, (h, w), cfg = spec["batch"], spec["size"], spec["config"]
    sample = rng.standard_normal((b, cfg["in_channels"], h, w)).astype(np.float32)
    timesteps = np.array([999.0, 17.5], dtype=np.float32)
    context = rng.standard_normal((b, spec["seq"], cfg["cross_attention_dim"])).astype(np.float32)
    added = None
    if spec["text"]:
        added = {"text_embeds": rng.standard_normal((b, spec["text"])).astype(np.float32),
                 "time_ids": np.array([[1024, 768, 0, 16, 1024, 768], [512, 512, 8, 0, 640, 512]], np.float32)}

    with torch.no_grad():
        expected = ref(torch.from_numpy(sample), torch.from_numpy(timesteps), torch.from_numpy(context),
                       added_cond_kwargs=None if added is None else
                       {k: torch.from_numpy(v) for k, v in added.items()}).sample.numpy()
    ours = model(mx.array(sample), mx.array(timesteps), mx.array(context),
                 None if added is None else {k: mx.array(v) for k, v in added.items()})
    assert ours.shape == expected.shape
    err = max_rel_err(np.array(ours), expected)
    print(f"{name}: max rel err {err:.2e}")
    assert err <= TOL, f"{name}: max rel err {err:.2e}"


@pytest.mark.parametrize("name", list(CONFIGS))
def test_compiled_blocks_match_diffusers(name, tmp_path):
    """Each resnet and transformer compiled whole (models/fused.compiled_block, as a GPU phase with room decides),
    their outputs paced as the pipelines pace them: the same numbers as diffusers."""
    import torch
    from diffusers import UNet2DConditionModel
    from mlxdiff.pipelines.base import evaluate_each_block
    from mlxdiff.policy import RunPolicy, installed

    spec = CONFIGS[name]
    torch.manual_seed(0)
    ref = UNet2DConditionModel(**spec["config"]).eval()
    randomize_(ref, seed=1, scale=0.1)
    ref.save_pretrained(tmp_path, safe_serialization=True)
    model = unet.Model(unet.ModelArgs.from_dict(json.loads((tmp_path / "config.json").read_text())))
    model.load_weights(list(model.sanitize(mx.load(str(tmp_path / "diffusion_pytorch_model.safetensors"))).items()))
    rng = np.random.default_rng(3)
    b, (h, w), cfg = spec["batch"], spec["size"], spec["config"]
    sample = rng.standard_normal((b, cfg["in_channels"], h, w)).astype(np.float32)
    t = np.array([500.0, 3.0], dtype=np.float32)
    context = rng.standard_normal((b, spec["seq"], cfg["cross_attention_dim"])).astype(np.float32)
    added = None if not spec["text"] else {
        "text_embeds": rng.standard_normal((b, spec["text"])).astype(np.float32),
        "time_ids": np.array([[1024, 768, 0, 16, 1024, 768], [512, 512, 8, 0, 640, 512]], np.float32)}
    with torch.no_grad():
        expected = ref(torch.from_numpy(sample), torch.from_numpy(t), torch.from_numpy(context),
                       added_cond_kwargs=None if added is None else
                       {k: torch.from_numpy(v) for k, v in added.items()}).sample.numpy()
    with installed(RunPolicy(compile_blocks=True)):
        ours = np.array(model(mx.array(sample), mx.array(t), mx.array(context),
                              None if added is None else {k: mx.array(v) for k, v in added.items()},
                              after_block=evaluate_each_block))
        assert all(r.__dict__.get("_compiled") for r in model.down_blocks[0].resnets)   # really compiled
    err = max_rel_err(ours, expected)
    print(f"{name} compiled: max rel err {err:.2e}")
    assert err <= TOL


@pytest.mark.parametrize("change", [
    {"down_block_types": ["SimpleCrossAttnDownBlock2D", "DownBlock2D"]},
    {"class_embed_type": "timestep"},
    {"mid_block_type": "UNetMidBlock2DSimpleCrossAttn"},
])
def test_unsupported_config_is_refused(change):
    config = {"block_out_channels": [32, 64], "norm_num_groups": 16,
              "down_block_types": ["CrossAttnDownBlock2D", "DownBlock2D"],
              "up_block_types": ["UpBlock2D", "CrossAttnUpBlock2D"], **change}
    with pytest.raises(MlxdiffError, match="not supported"):
        unet.ModelArgs.from_dict(config)
