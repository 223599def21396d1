"""Parity of mlxdiff.models.qwenimage with diffusers' QwenImageTransformer2DModel: a batch of two prompts of
different lengths (the pipeline's padding mask), a non-square latent, the Edit-Plus case of several image grids in
img_shapes, bfloat16 loading, and a ComfyUI-style file (diffusers' names under `model.diffusion_model.`)."""

import json

import numpy as np
import pytest

import mlxdiff  # noqa: F401  (OpenBLAS preload before mlx)
import mlx.core as mx

from helpers import load_ours, max_rel_err
from mlxdiff.errors import MlxdiffError
from mlxdiff.formats.safetensors import load_folder, load_safetensors
from mlxdiff.loading.spec import ComponentSpec
from mlxdiff.models import qwenimage
from qwenimage_helpers import (CASES, CONFIG, TEXT_LEN, make_inputs, make_torch_model, mlx_forward, text_mask,
                               torch_forward)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    model = make_torch_model()
    folder = tmp_path_factory.mktemp("qwenimage")
    model.save_pretrained(str(folder))
    return model, folder


@pytest.mark.parametrize("case", list(CASES))
def test_folder_parity(saved, case):
    torch_model, folder = saved
    ours = load_ours(folder, qwenimage)
    inputs, mask = make_inputs(case), text_mask()
    for m in (mask, None):
        ref = torch_forward(torch_model, inputs, case, m)
        out = mlx_forward(ours, inputs, case, m)
        assert out.shape == (2, inputs["hidden_states"].shape[1], 4 * CONFIG["out_channels"])
        err = max_rel_err(out, ref)
        print(f"Qwen-Image transformer, {case}, mask {'on' if m is not None else 'off'}: max_rel_err {err:.2e}")
        assert err <= 1e-4
    # the mask, the timestep, the text and the positions each change the output, so the comparison sees them
    ref = torch_forward(torch_model, inputs, case, mask)
    assert max_rel_err(torch_forward(torch_model, inputs, case, None), ref) > 1e-3
    for key in ("timestep", "encoder_hidden_states"):
        moved = dict(inputs, **{key: inputs[key][::-1].copy()})
        assert max_rel_err(torch_forward(torch_model, moved, case, mask[::-1].copy()), ref) > 1e-3, key
        assert max_rel_err(mlx_forward(ours, moved, case, mask[::-1].copy()),
                           torch_forward(torch_model, moved, case, mask[::-1].copy())) <= 1e-4, key
    if case == "edit-plus":     # the reference grid's own positions: the same tokens as another grid differ
        other = [(1, 3, 5), (1, 2, 4)]
        moved = torch_forward(torch_model, inputs, case, mask, other)
        assert max_rel_err(moved, ref) > 1e-4      # 20 x the error above (random weights barely feel the RoPE)
        assert max_rel_err(mlx_forward(ours, inputs, case, mask, other), moved) <= 1e-5


def test_block_by_block_compiled_and_plain(saved):
    """The generate template's hooks: after_block sees every block's (text, image) streams; compiled blocks and the
    plain MLX ops (no fusion) give the same output as the default run."""
    from mlxdiff.policy import RunPolicy, installed
    _, folder = saved
    ours = load_ours(folder, qwenimage)
    inputs, mask = make_inputs("edit-plus"), text_mask()
    seen = []
    out = mlx_forward(ours, inputs, "edit-plus", mask)
    kwargs = {k: mx.array(v) for k, v in inputs.items()}
    ours(**kwargs, img_shapes=CASES["edit-plus"], encoder_hidden_states_mask=mx.array(mask),
         after_block=lambda *streams: seen.append([s.shape for s in streams]))
    n_img = inputs["hidden_states"].shape[1]
    width = CONFIG["num_attention_heads"] * CONFIG["attention_head_dim"]
    assert seen == [[(2, TEXT_LEN, width), (2, n_img, width)]] * CONFIG["num_layers"]
    for policy in (RunPolicy(compile_blocks=True), RunPolicy(fuse=False)):
        with installed(policy):
            assert max_rel_err(mlx_forward(ours, inputs, "edit-plus", mask), out) <= 1e-5, policy


def test_diffusers_img_shapes_form_and_checks(saved):
    """diffusers' per-batch-row img_shapes is taken too (its first row); grids that do not cover the tokens and a
    mask of the wrong shape are refused in one line."""
    _, folder = saved
    ours = load_ours(folder, qwenimage)
    inputs, mask = make_inputs("edit-plus"), text_mask()
    kwargs = {k: mx.array(v) for k, v in inputs.items()}
    ours_form = np.array(ours(**kwargs, img_shapes=CASES["edit-plus"], encoder_hidden_states_mask=mx.array(mask)))
    diffusers_form = np.array(ours(**kwargs, img_shapes=[CASES["edit-plus"]] * 2,
                                   encoder_hidden_states_mask=mx.array(mask)))
    assert np.array_equal(ours_form, diffusers_form)
    with pytest.raises(MlxdiffError, match="cover"):
        ours(**kwargs, img_shapes=CASES["text-to-image"])
    with pytest.raises(MlxdiffError, match="encoder_hidden_states_mask"):
        ours(**kwargs, img_shapes=CASES["edit-plus"], encoder_hidden_states_mask=mx.array(mask[:, :-1]))


def test_positions_are_qwen_embed_ropes(saved):
    """Our cos / sin tables equal diffusers' QwenEmbedRope frequencies (complex, per token) for both cases."""
    import torch
    torch_model, folder = saved
    ours = load_ours(folder, qwenimage)
    for case, shapes in CASES.items():
        vid, txt = torch_model.pos_embed([shapes] * 2, max_txt_seq_len=TEXT_LEN, device=torch.device("cpu"))
        freqs = torch.cat([txt, vid]).numpy()                      # [text; image], (L, head_dim / 2) complex
        cos, sin = ours.rope(shapes, TEXT_LEN)
        assert np.abs(np.array(cos)[:, ::2] - freqs.real).max() < 1e-5, case
        assert np.abs(np.array(sin)[:, ::2] - freqs.imag).max() < 1e-5, case


def test_bfloat16_loading_runs(saved):
    """bfloat16 weights and compute: off float32 by about what diffusers' own bfloat16 run is."""
    import copy
    import torch
    torch_model, folder = saved
    ours = load_ours(folder, qwenimage, dtype=mx.bfloat16)
    assert ours.img_in.weight.dtype == mx.bfloat16
    inputs, mask = make_inputs("edit-plus"), text_mask()
    out = mlx_forward(ours, inputs, "edit-plus", mask)
    ref = torch_forward(torch_model, inputs, "edit-plus", mask)
    torch_bf16 = torch_forward(copy.deepcopy(torch_model).to(torch.bfloat16), inputs, "edit-plus", mask,
                               dtype=torch.bfloat16)
    ours_err, theirs_err = max_rel_err(out, ref), max_rel_err(torch_bf16, ref)
    print(f"Qwen-Image transformer, bfloat16: max_rel_err {ours_err:.2e} (diffusers' bfloat16: {theirs_err:.2e})")
    assert ours_err <= 2 * theirs_err


def test_comfyui_file_is_diffusers_names_under_a_prefix(saved, tmp_path):
    """ComfyUI's qwen_image_*.safetensors: diffusers' names under `model.diffusion_model.` (diffusers' single-file
    loader maps QwenImageTransformer2DModel with the identity), read by a ComponentSpec with that prefix, no key map."""
    from safetensors.torch import save_file
    from diffusers.loaders.single_file_model import SINGLE_FILE_LOADABLE_CLASSES
    torch_model, folder = saved
    identity = SINGLE_FILE_LOADABLE_CLASSES["QwenImageTransformer2DModel"]["checkpoint_mapping_fn"]
    sd = {k: v.detach().clone().contiguous() for k, v in torch_model.state_dict().items()}
    assert identity(dict(sd)) == sd
    path = tmp_path / "qwen_image_tiny.safetensors"
    save_file({"model.diffusion_model." + k: v for k, v in sd.items()}, str(path))
    assert {k[len("model.diffusion_model."):] for k in load_safetensors(path)} == set(load_folder(folder))
    config = json.loads((folder / "config.json").read_text())
    spec = ComponentSpec("transformer", qwenimage, config, [path], prefix="model.diffusion_model.")
    inputs, mask = make_inputs("text-to-image", seed=1), text_mask()
    err = max_rel_err(mlx_forward(spec.build(), inputs, "text-to-image", mask),
                      torch_forward(torch_model, inputs, "text-to-image", mask))
    print(f"Qwen-Image ComfyUI-style file: max_rel_err {err:.2e}")
    assert err <= 1e-4


def test_config_defaults_and_refusals():
    """The defaults are Qwen/Qwen-Image's transformer; the variants' switches not implemented (Qwen-Image-Layered's)
    are refused."""
    from diffusers import QwenImageTransformer2DModel
    import inspect
    defaults = {k: p.default for k, p in inspect.signature(QwenImageTransformer2DModel.__init__).parameters.items()
                if k != "self"}
    args = qwenimage.ModelArgs()
    for key, value in defaults.items():
        assert getattr(args, key) == (tuple(value) if isinstance(value, (list, tuple)) else value), key
    for key in ("use_additional_t_cond", "use_layer3d_rope"):
        with pytest.raises(MlxdiffError, match=key):
            qwenimage.ModelArgs.from_dict({**CONFIG, key: True})
    with pytest.raises(MlxdiffError, match="axes_dims_rope"):
        qwenimage.ModelArgs.from_dict({**CONFIG, "axes_dims_rope": [6, 12, 12]})
