"""Parity of mlxdiff.models.flux3 with diffusers' Flux3Transformer2DModel (from a save_pretrained folder, through
mlxdiff's loader): the flow-map (step-distilled) and the base transformer, text-to-image and with two reference
images' tokens, position ids as the modular pipeline's blocks build them; a file's config off its shapes; the
transformer streamed block by block from its file, bit for bit the resident one."""

import numpy as np
import pytest

import mlxdiff  # noqa: F401  (OpenBLAS preload before mlx)
import mlx.core as mx

from helpers import load_ours, max_rel_err, randomize_, saved_model_fixture
from mlxdiff.errors import MlxdiffError
from mlxdiff.formats import tensor_shapes
from mlxdiff.loading import sources, streaming
from mlxdiff.loading.component import load_component
from mlxdiff.loading.streaming import StreamedBlock
from mlxdiff.memory import decide
from mlxdiff.models import flux3
from mlxdiff.policy import RunPolicy, installed

# every dimension differs from the others within a config (heads, head dim, D, MLP, in, cond in, joint, sinusoid
# channels, text length, image and reference tokens), so a swapped axis cannot pass
CONFIGS = {
    "distilled": dict(in_channels=20, cond_in_channels=20, num_layers=2, num_single_layers=2, attention_head_dim=16,
                      num_attention_heads=3, joint_attention_dim=28, timestep_channels=36, mlp_ratio=2.5,
                      axes_dims_rope=(2, 6, 4, 4), rope_theta=10000, eps=1e-6, flow_map=True),
    "base": dict(in_channels=12, cond_in_channels=12, num_layers=1, num_single_layers=3, attention_head_dim=24,
                 num_attention_heads=2, joint_attention_dim=40, timestep_channels=256, mlp_ratio=3.0,
                 axes_dims_rope=(6, 6, 6, 6), rope_theta=10000, eps=1e-6, flow_map=False),
}
GRID = {"distilled": (3, 7), "base": (5, 6)}          # the noise tokens' grid
REF_GRIDS = {"distilled": [(2, 3), (4, 2)], "base": [(3, 3), (2, 5)]}
TEXT_LEN = {"distilled": 9, "base": 11}


def make_torch_model(name, seed):
    import torch
    from diffusers import Flux3Transformer2DModel
    torch.manual_seed(seed)
    return randomize_(Flux3Transformer2DModel(**CONFIGS[name]), seed=seed).eval()


def make_inputs(name, refs=True, seed=0):
    """Random tokens, and the position ids exactly as the modular blocks build them (image H/W scaled by 0.5, the
    references on l = -1, -2, the text along l)."""
    import torch
    from diffusers.modular_pipelines.flux3.before_denoise import Flux3TextRoPEInputsStep, _prepare_image_ids
    cfg, (h, w), batch = CONFIGS[name], GRID[name], 2
    rng = np.random.default_rng(seed)
    text = rng.standard_normal((batch, TEXT_LEN[name], cfg["joint_attention_dim"])).astype(np.float32)
    inputs = dict(hidden_states=rng.standard_normal((batch, h * w, cfg["in_channels"])).astype(np.float32),
                  encoder_hidden_states=text, timestep=np.array([0.9731, 0.2125], dtype=np.float32),
                  img_ids=_prepare_image_ids(h, w, 0.5).numpy(),
                  txt_ids=Flux3TextRoPEInputsStep._prepare_text_ids(torch.from_numpy(text)).numpy())
    if cfg["flow_map"]:
        inputs["target_timestep"] = np.array([0.8113, 0.0], dtype=np.float32)
    if refs:
        grids = REF_GRIDS[name]
        n_ref = sum(a * b for a, b in grids)
        inputs["image_cond_hidden_states"] = rng.standard_normal(
            (batch, n_ref, cfg["cond_in_channels"])).astype(np.float32)
        inputs["image_cond_ids"] = np.concatenate([_prepare_image_ids(a, b, 0.5, l_coord=-(1 + i)).numpy()
                                                   for i, (a, b) in enumerate(grids)])
    return inputs


def torch_forward(model, inputs):
    import torch
    with torch.no_grad():
        out = model(**{k: torch.from_numpy(v) for k, v in inputs.items()}, return_dict=False)
    return out[0].float().numpy()


def mlx_forward(model, inputs):
    return np.array(model(**{k: mx.array(v) for k, v in inputs.items()}).astype(mx.float32))


saved = saved_model_fixture(make_torch_model, CONFIGS, "flux3")   # (config name, torch model, its folder)


def test_folder_parity(saved):
    name, torch_model, folder = saved
    ours_model = load_ours(folder, flux3)
    for refs in (False, True):
        inputs = make_inputs(name, refs)
        ref = torch_forward(torch_model, inputs)
        ours = mlx_forward(ours_model, inputs)
        err = max_rel_err(ours, ref)
        print(f"{name}, references {refs}: max_rel_err {err:.2e}")
        assert ours.shape == inputs["hidden_states"].shape
        assert err <= 1e-4
    # each input the comparison covers moves diffusers' output past the tolerance (the text positions least: the
    # text's share of a random twin's output is ~2%)
    moves = {"timestep": dict(timestep=inputs["timestep"][::-1].copy()),
             "the text": dict(encoder_hidden_states=inputs["encoder_hidden_states"][::-1].copy()),
             "the references": dict(image_cond_hidden_states=inputs["image_cond_hidden_states"][::-1].copy()),
             "the text positions": dict(txt_ids=inputs["txt_ids"] * 3),
             "the reference positions": dict(image_cond_ids=inputs["image_cond_ids"][::-1].copy())}
    if "target_timestep" in inputs:
        moves["target_timestep"] = dict(target_timestep=inputs["target_timestep"][::-1].copy())
    for what, change in moves.items():
        assert max_rel_err(torch_forward(torch_model, {**inputs, **change}), ref) > 1e-4, what


def test_inputs_that_do_not_belong_are_one_line(saved):
    name, _, folder = saved
    model = load_ours(folder, flux3)
    inputs = make_inputs(name)
    with pytest.raises(MlxdiffError, match="position ids"):
        mlx_forward(model, dict(inputs, img_ids=inputs["img_ids"][1:]))
    with pytest.raises(MlxdiffError, match="image_cond_ids"):
        mlx_forward(model, {k: v for k, v in inputs.items() if k != "image_cond_ids"})
    wrong = ({k: v for k, v in inputs.items() if k != "target_timestep"} if CONFIGS[name]["flow_map"]
             else dict(inputs, target_timestep=inputs["timestep"]))
    with pytest.raises(MlxdiffError, match="target_timestep"):
        mlx_forward(model, wrong)


def test_quantize_keeps_embedders_and_modulations():
    model = flux3.Model(flux3.ModelArgs(**CONFIGS["base"]))
    kept = {"x_embedders.image", "x_embedders.image_cond", "context_embedder", "timestep_embedder.linear_1",
            "early_stream_modulations.txt.linear", "single_stream_modulations.image_cond.linear", "norm_out.linear",
            "proj_out"}
    quantized = {"mode_blocks.image.0.attn.to_q", "txt_mode_blocks.0.ff.linear_in",
                 "single_transformer_blocks.2.attn.to_out.0"}
    for path in kept:
        assert not model.quant_predicate(path, None), path
    for path in quantized:
        assert model.quant_predicate(path, None), path


def test_config_from_a_file_s_shapes(saved):
    """A transformer file's config off its shapes (transformer=FILE): what the saved config says, but the RoPE
    axes, which the weights do not give (equal quarters of the head; the folder's config is used when there is
    one), with and without ComfyUI's prefix."""
    name, _, folder = saved
    shapes = tensor_shapes(next(folder.glob("*.safetensors")))
    for prefix in ("", flux3.ORIGINAL_PREFIX):
        names = {prefix + k: v for k, v in shapes.items()}
        assert flux3.is_original(names)
        config = flux3.config_from_original(names)
        want = dict(CONFIGS[name])
        want.pop("axes_dims_rope")
        assert config.pop("axes_dims_rope") == [want["attention_head_dim"] // 4] * 4
        assert config == want
    assert not flux3.is_original(["transformer_blocks.0.attn.to_q.weight", "double_blocks.0.img_attn.qkv.weight"])


def test_streamed_transformer_is_exact(tmp_path, monkeypatch):
    """Under a budget below its weights the transformer streams its blocks from the file (the per-mode blocks under
    mode_blocks.image / mode_blocks.image_cond included) and its output, references and all, is the resident one
    bit for bit. The twin's embedders are a large share of it, so the activations' reserve is set aside here (the
    distilled twin: its 8 blocks outweigh them)."""
    monkeypatch.setattr(streaming, "RESERVE_SHARE", 0.0)
    name = "distilled"
    make_torch_model(name, seed=3).save_pretrained(str(tmp_path))
    spec = sources.transformer_from_file(next(tmp_path.glob("*.safetensors")), flux3, CONFIGS[name])
    inputs = {k: mx.array(v) for k, v in make_inputs(name).items()}
    resident = load_component(spec, RunPolicy()).model
    with installed(decide(RunPolicy(), resident)):
        expected = np.array(resident(**inputs))
    policy = RunPolicy(memory_limit=int(0.95 * spec.loaded_nbytes(compute_dtype=mx.float32)))
    loaded = load_component(spec, policy)
    model = loaded.model
    blocks = [*model.mode_blocks.image, *model.mode_blocks.image_cond, *model.txt_mode_blocks,
              *model.single_transformer_blocks]
    assert sum(isinstance(b, StreamedBlock) for b in blocks) >= 2, loaded.notes
    with installed(decide(policy, model)):
        got = np.array(model(**inputs))
    assert np.array_equal(got, expected), np.abs(got - expected).max()
