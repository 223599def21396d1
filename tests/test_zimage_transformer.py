"""Parity of mlxdiff.models.zimage with diffusers' ZImageTransformer2DModel (a batch of two captions of different
padded lengths, a non-square latent), from a diffusers folder, with bfloat16 weights, with compiled blocks paced as
the pipelines pace them, and from a file in the original naming (z_image_turbo_bf16.safetensors' names, with and
without ComfyUI's `model.diffusion_model.`)."""

import json

import numpy as np
import pytest

import mlxdiff  # noqa: F401  (OpenBLAS preload before mlx)
import mlx.core as mx

from helpers import load_ours, max_rel_err, randomize_
from mlxdiff.errors import MlxdiffError
from mlxdiff.formats.safetensors import load_folder, load_safetensors
from mlxdiff.loading import sources
from mlxdiff.models import chroma, flux1, flux2, zimage
from zimage_helpers import to_original

# every dimension differs from the others: heads 3, head dim 96 (RoPE axes 16, 32, 48), dim 288, SwiGLU 768, the
# modulation input 256 (min(dim, 256)), the timestep MLP's 1024, caption features 40, 6 latent channels (24 patch
# inputs), 3 main blocks and 2 of each refiner; captions of 5 and 37 tokens (padded to 32 and 64, so the rows' RoPE
# and masks differ) in a batch padded to 41; 10 x 14 latents (5 x 7 = 35 image tokens, padded to 64)
CONFIG = dict(all_patch_size=(2,), all_f_patch_size=(1,), in_channels=6, dim=288, n_layers=3, n_refiner_layers=2,
              n_heads=3, n_kv_heads=3, cap_feat_dim=40, axes_dims=(16, 32, 48), axes_lens=(80, 24, 40))
LATENT, TEXT_LEN, PROMPT_LEN = (10, 14), 41, (5, 37)


def make_torch_model(seed=5):
    import torch
    from diffusers import ZImageTransformer2DModel
    torch.manual_seed(seed)
    return randomize_(ZImageTransformer2DModel(**CONFIG), seed=seed).eval()


def make_inputs(seed=0):
    """Latents, the timestep as ZImagePipeline passes it ((1000 - t) / 1000), and a right-padded caption batch with
    its mask (the tokenizer's attention mask)."""
    rng = np.random.default_rng(seed)
    mask = np.stack([(np.arange(TEXT_LEN) < n).astype(np.float32) for n in PROMPT_LEN])
    return dict(hidden_states=rng.standard_normal((2, CONFIG["in_channels"], *LATENT)).astype(np.float32),
                timestep=np.array([0.0269, 0.7875], dtype=np.float32),
                encoder_hidden_states=rng.standard_normal((2, TEXT_LEN, CONFIG["cap_feat_dim"])).astype(np.float32),
                text_mask=mask)


def torch_forward(model, inputs):
    """diffusers' forward as ZImagePipeline calls it: a list of (C, 1, H, W) latents, a list of each row's valid
    caption tokens; the output list stacked, its frame axis squeezed."""
    import torch
    x = [torch.from_numpy(v)[:, None] for v in inputs["hidden_states"]]
    caps = [torch.from_numpy(e[m > 0]) for e, m in zip(inputs["encoder_hidden_states"], inputs["text_mask"])]
    with torch.no_grad():
        out = model(x, torch.from_numpy(inputs["timestep"]), caps, return_dict=False)[0]
    return torch.stack([o.float() for o in out]).squeeze(2).numpy()


def mlx_forward(model, inputs, **kwargs):
    return np.array(model(**{k: mx.array(v) for k, v in inputs.items()}, **kwargs).astype(mx.float32))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    model = make_torch_model()
    folder = tmp_path_factory.mktemp("zimage")
    model.save_pretrained(str(folder))
    return model, folder


@pytest.fixture(scope="module")
def reference(saved):
    """diffusers' output for make_inputs(seed) (computed once per seed)."""
    torch_model, _ = saved
    outputs = {}

    def ref(seed):
        if seed not in outputs:
            outputs[seed] = torch_forward(torch_model, make_inputs(seed))
        return outputs[seed]
    return ref


def test_folder_parity(saved, reference):
    torch_model, folder = saved
    ours = load_ours(folder, zimage)
    inputs = make_inputs()
    ref = reference(0)
    out = mlx_forward(ours, inputs)
    assert out.shape == (2, CONFIG["in_channels"], *LATENT)
    err = max_rel_err(out, ref)
    print(f"Z-Image transformer: max_rel_err {err:.2e}")
    assert err <= 1e-4
    # the timestep, the captions and each row's caption length change the output, so the comparison sees them
    moved = {"timestep": dict(inputs, timestep=inputs["timestep"][::-1].copy()),
             "captions": dict(inputs, encoder_hidden_states=inputs["encoder_hidden_states"][::-1].copy(),
                              text_mask=inputs["text_mask"][::-1].copy()),
             "caption length": dict(inputs, text_mask=(np.arange(TEXT_LEN) < 33)[None].repeat(2, 0).astype(
                 np.float32))}
    for what, changed in moved.items():
        ref_changed = torch_forward(torch_model, changed)
        assert max_rel_err(ref_changed, ref) > 1e-3, what
        assert max_rel_err(mlx_forward(ours, changed), ref_changed) <= 1e-4, what


def test_a_row_alone_and_without_a_mask_is_the_same_row(saved):
    """A row's output does not depend on the batch's padding: row 1 alone (its valid tokens, no mask) is row 1."""
    _, folder = saved
    ours = load_ours(folder, zimage)
    inputs = make_inputs()
    alone = dict(hidden_states=inputs["hidden_states"][1:], timestep=inputs["timestep"][1:],
                 encoder_hidden_states=inputs["encoder_hidden_states"][1:, :PROMPT_LEN[1]])
    assert max_rel_err(mlx_forward(ours, alone), mlx_forward(ours, inputs)[1:]) <= 1e-5


def test_compiled_blocks_paced_match_diffusers(saved, reference):
    """Each block compiled whole (models/fused.compiled_block), its outputs paced after every block as the pipelines
    pace them (pipelines/base.evaluate_each_block): the same numbers as diffusers."""
    from mlxdiff.pipelines.base import evaluate_each_block
    from mlxdiff.policy import RunPolicy, installed
    _, folder = saved
    inputs = make_inputs()
    ref = reference(0)
    model = load_ours(folder, zimage)
    calls = []
    with installed(RunPolicy(compile_blocks=True)):
        out = mlx_forward(model, inputs, after_block=lambda *o: (calls.append(1), evaluate_each_block(*o)))
    assert len(calls) == 2 * CONFIG["n_refiner_layers"] + CONFIG["n_layers"]
    assert max_rel_err(out, ref) <= 1e-4


def test_bf16_weights(saved, tmp_path):
    """bf16 weights are kept as stored and computed in float32 (the reference: diffusers with the same rounded
    weights in float32); under bfloat16 compute the model runs and stays near it."""
    import copy
    import torch
    from mlx.utils import tree_flatten
    bf16_model = copy.deepcopy(saved[0]).to(torch.bfloat16)
    bf16_model.save_pretrained(str(tmp_path))
    ours = load_ours(tmp_path, zimage)
    assert {v.dtype for _, v in tree_flatten(ours.parameters())} == {mx.bfloat16}
    inputs = make_inputs(seed=2)
    ref = torch_forward(bf16_model.float(), inputs)
    err = max_rel_err(mlx_forward(ours, inputs), ref)
    print(f"Z-Image bf16 weights, float32 compute: max_rel_err {err:.2e}")
    assert err <= 1e-4
    out = load_ours(tmp_path, zimage, mx.bfloat16)(**{k: mx.array(v) for k, v in inputs.items()})
    assert out.dtype == mx.bfloat16
    assert max_rel_err(np.array(out.astype(mx.float32)), ref) < 0.1


def test_bad_inputs_are_one_line(saved):
    _, folder = saved
    ours = load_ours(folder, zimage)
    inputs = make_inputs()
    for change, match in ((dict(text_mask=np.zeros((2, TEXT_LEN), np.float32)), "no caption token"),
                          (dict(hidden_states=inputs["hidden_states"][..., :-1]), "multiple of the patch"),
                          (dict(text_mask=inputs["text_mask"][:, :-1]), "text_mask has shape")):
        with pytest.raises(MlxdiffError, match=match):
            mlx_forward(ours, dict(inputs, **change))
    with pytest.raises(MlxdiffError, match="axes_lens"):    # diffusers' RoPE tables end there too
        mlx_forward(ours, dict(inputs, hidden_states=np.zeros((2, 6, 50, 14), np.float32)))


# -- original names --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def original_files(saved, tmp_path_factory):
    import torch
    from safetensors.torch import save_file
    torch_model, _ = saved
    sd = {k: v.detach().clone().contiguous() for k, v in torch_model.state_dict().items()}
    original = to_original(sd)
    assert sum(v.numel() for v in original.values()) == sum(v.numel() for v in sd.values())   # nothing dropped
    root = tmp_path_factory.mktemp("zimage_files")
    plain, prefixed = root / "z_image_turbo_bf16.safetensors", root / "z_image_comfy.safetensors"
    save_file(original, str(plain))
    tensors = {"model.diffusion_model." + k: v for k, v in original.items()}
    tensors["model.diffusion_model.norm_final.weight"] = torch.ones(CONFIG["dim"])   # dropped, as diffusers does
    tensors["text_encoders.qwen3_4b.transformer.model.norm.weight"] = torch.zeros(3)  # another component's
    save_file(tensors, str(prefixed))
    return original, plain, prefixed


def test_original_names_are_diffusers_own(saved, original_files):
    import torch
    from diffusers.loaders.single_file_utils import convert_z_image_transformer_checkpoint_to_diffusers
    torch_model, _ = saved
    original, _, _ = original_files
    got = convert_z_image_transformer_checkpoint_to_diffusers(dict(original))
    expected = torch_model.state_dict()
    assert expected.keys() == got.keys()
    for k in expected:
        assert torch.equal(expected[k], got[k]), k


@pytest.mark.parametrize("which", [1, 2])
def test_original_naming_parity(saved, original_files, reference, which):
    _, folder = saved
    path = original_files[which]
    weights = load_safetensors(path)
    config = zimage.config_from_original(weights)
    saved_config = json.loads((folder / "config.json").read_text())
    assert config.keys() == {k for k in saved_config if not k.startswith("_")}
    for key, value in config.items():
        if key not in zimage.FROM_BASE_CONFIG:
            assert saved_config[key] == (list(value) if isinstance(value, tuple) else value), key
    mapped, folder_weights = zimage.original_to_diffusers(weights), load_folder(folder)
    assert mapped.keys() == folder_weights.keys()
    assert all(mx.array_equal(mapped[k], folder_weights[k]).item() for k in mapped)
    # the pipeline's path: the config from the shapes, the RoPE split from the folder's config
    spec = sources.transformer_from_file(path, zimage, base_config=saved_config)
    assert spec.args.axes_dims == CONFIG["axes_dims"]
    inputs = make_inputs(seed=1)
    err = max_rel_err(mlx_forward(spec.build(), inputs), reference(1))
    print(f"Z-Image original names ({path.name}): max_rel_err {err:.2e}")
    assert err <= 1e-4


def test_zimage_files_are_told_apart(saved, original_files):
    _, folder = saved
    original, _, _ = original_files
    names = list(original)
    assert zimage.is_original(names)
    assert not any(m.is_original(names) for m in (flux1, flux2, chroma))
    assert not zimage.is_original(list(load_folder(folder)))           # diffusers' names
    lumina2 = ["cap_embedder.0.weight", "x_embedder.weight", "layers.0.adaLN_modulation.1.weight",
               "layers.0.attention.qkv.weight"]
    assert not zimage.is_original(lumina2)
    with pytest.raises(MlxdiffError, match="not a Z-Image"):
        zimage.config_from_original({"double_blocks.0.img_mod.lin.weight": mx.zeros((2, 2))})
    assert vars(zimage.ModelArgs.from_dict({**zimage.config_from_original(original)})) == vars(
        zimage.ModelArgs(**{k: v for k, v in CONFIG.items() if k not in ("axes_dims", "axes_lens")},
                         axes_dims=(24, 36, 36)))
