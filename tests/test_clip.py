"""Parity of mlxdiff.models.clip with transformers' CLIPTextModelWithProjection (from a save_pretrained folder and
from SD3 single-file names, against what diffusers' single-file converter builds)."""

import numpy as np
import pytest

import mlxdiff  # noqa: F401  (OpenBLAS preload before mlx)
import mlx.core as mx

from helpers import load_ours, max_rel_err, randomize_, saved_model_fixture
from mlxdiff.errors import MlxdiffError
from mlxdiff.loading.spec import ComponentSpec
from mlxdiff.models import clip

# Every size differs from the others (hidden, heads, head dim, ffn, projection, vocab, positions, layers, tokens).
CONFIGS = {
    # CLIP-L-like: quick_gelu, legacy eos_token_id 2 -> pooled at argmax(input_ids)
    "L_legacy": dict(vocab_size=97, hidden_size=40, intermediate_size=52, projection_dim=36, num_hidden_layers=3,
                     num_attention_heads=5, max_position_embeddings=23, hidden_act="quick_gelu", layer_norm_eps=1e-5,
                     bos_token_id=0, eos_token_id=2, pad_token_id=1),
    # CLIP-G-like: exact gelu, modern eos_token_id -> pooled at the first eos
    "G_modern": dict(vocab_size=101, hidden_size=48, intermediate_size=60, projection_dim=44, num_hidden_layers=2,
                     num_attention_heads=4, max_position_embeddings=19, hidden_act="gelu", layer_norm_eps=1e-5,
                     bos_token_id=98, eos_token_id=95, pad_token_id=0),
}
SEQ = {"L_legacy": 13, "G_modern": 17}


def make_ids(name, seed=0):
    """Two rows whose two pooling rules disagree: the largest id (100 / 96) appears twice, and not where the first
    eos is, so argmax pooling and first-eos pooling pick different positions."""
    cfg, n = CONFIGS[name], SEQ[name]
    rng = np.random.default_rng(seed)
    ids = rng.integers(3, 90, size=(2, n))
    top = cfg["vocab_size"] - 1
    ids[0, [4, 9]] = top
    ids[1, [2, 11]] = top
    if cfg["eos_token_id"] != 2:
        ids[0, [7, 10]] = cfg["eos_token_id"]
        ids[1, [5, 12]] = cfg["eos_token_id"]
    return ids.astype(np.int64)


def torch_model(name, seed):
    import torch
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection
    torch.manual_seed(seed)
    model = CLIPTextModelWithProjection(CLIPTextConfig(**CONFIGS[name]))
    return randomize_(model, seed=seed).eval()


def torch_outputs(model, ids):
    import torch
    with torch.no_grad():
        out = model(torch.from_numpy(ids), output_hidden_states=True)
    return [h.numpy() for h in out.hidden_states], out.last_hidden_state.numpy(), out.text_embeds.numpy()


def ours_outputs(model, ids):
    out = model(mx.array(ids))
    f32 = lambda a: np.array(a.astype(mx.float32))
    return [f32(h) for h in out.hidden_states], f32(out.last_hidden_state), f32(out.text_embeds)


saved = saved_model_fixture(torch_model, CONFIGS, "clip")


def test_folder_parity(saved):
    name, model, folder = saved
    ids = make_ids(name)
    ref_hidden, ref_last, ref_pooled = torch_outputs(model, ids)
    hidden, last, pooled = ours_outputs(load_ours(folder, clip), ids)
    assert len(hidden) == len(ref_hidden) == CONFIGS[name]["num_hidden_layers"] + 1
    errors = [max_rel_err(o, r) for o, r in zip(hidden, ref_hidden)]
    errors += [max_rel_err(last, ref_last), max_rel_err(pooled, ref_pooled)]
    print(f"{name}: hidden states / last / pooled max_rel_err {[f'{e:.1e}' for e in errors]}")
    assert max(errors) <= 1e-4
    # the pooling rule matters for these ids: pooling at the other rule's position gives a different vector
    other = clip.Model(clip.ModelArgs.from_dict({**CONFIGS[name], "eos_token_id": 95 if name == "L_legacy" else 2}))
    assert not np.array_equal(np.array(other.eos_index(mx.array(ids))),
                              np.array(load_ours(folder, clip).eos_index(mx.array(ids))))


def test_bfloat16_weights_and_compute(saved, tmp_path):
    """bf16 weights computed in bf16 (MLX CPU accumulates bf16 matmuls in bf16) stay finite and near float32.
    Measured against transformers in float32 with the unrounded weights, over every output: 8.6e-3 (L_legacy) and
    8.3e-3 (G_modern), about one bf16 ulp (2^-7); bound 2e-2."""
    import copy
    import torch
    name, model, _ = saved
    folder = tmp_path / "bf16"
    copy.deepcopy(model).to(torch.bfloat16).save_pretrained(str(folder))
    ids = make_ids(name)
    ref_hidden, ref_last, ref_pooled = torch_outputs(model, ids)
    ours = load_ours(folder, clip, mx.bfloat16)
    assert ours.text_model.encoder.layers[0].mlp.fc1.weight.dtype == mx.bfloat16  # stored dtype kept
    out = ours(mx.array(ids))
    assert out.last_hidden_state.dtype == mx.bfloat16
    hidden, last, pooled = ours_outputs(ours, ids)
    errors = [max_rel_err(o, r) for o, r in zip(hidden + [last, pooled], ref_hidden + [ref_last, ref_pooled])]
    print(f"{name} bf16: max_rel_err {max(errors):.2e}")
    assert max(errors) <= 2e-2


def test_too_many_tokens_is_a_clear_error(saved):
    name, _, folder = saved
    ids = np.zeros((1, CONFIGS[name]["max_position_embeddings"] + 1), np.int64)
    with pytest.raises(MlxdiffError, match="positions"):
        load_ours(folder, clip)(mx.array(ids))


# -- SD3 single files: clip_l without a projection, clip_g with one ------------------------------------------

SINGLE = {
    # head size 64 as in the real models, since config_from_weights infers heads = hidden / 64; width 768 makes
    # it CLIP-L (quick_gelu). One layer and a small vocab keep it fast.
    "clip_l": dict(vocab_size=211, hidden_size=768, intermediate_size=200, projection_dim=768, num_hidden_layers=1,
                   num_attention_heads=12, max_position_embeddings=77, hidden_act="quick_gelu", layer_norm_eps=1e-5,
                   bos_token_id=0, eos_token_id=2, pad_token_id=1),
    "clip_g": dict(vocab_size=223, hidden_size=192, intermediate_size=136, projection_dim=120, num_hidden_layers=2,
                   num_attention_heads=3, max_position_embeddings=77, hidden_act="gelu", layer_norm_eps=1e-5,
                   bos_token_id=0, eos_token_id=2, pad_token_id=1),
}


@pytest.mark.parametrize("short", list(SINGLE))
def test_sd3_single_file_matches_diffusers_converter(short, tmp_path):
    """An "incl_clips" SD3 file's text_encoders.clip_{l,g}.transformer.* part (clip_l: no text_projection, plus the
    position_ids buffer old files carry), loaded our way (inferred config, identity projection for clip_l) vs the
    model diffusers' create_diffusers_clip_model_from_ldm builds from the same dict (given the real config)."""
    import torch
    from safetensors.torch import save_file
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection
    from diffusers.loaders.single_file_utils import create_diffusers_clip_model_from_ldm

    cfg = SINGLE[short]
    torch.manual_seed(7)
    source = randomize_(CLIPTextModelWithProjection(CLIPTextConfig(**cfg)), seed=11, scale=0.05)
    config_dir = tmp_path / "config"   # stands in for the hub repo diffusers would fetch the config from
    CLIPTextConfig(**cfg).save_pretrained(str(config_dir))
    prefix = f"text_encoders.{short}.transformer."
    state = {prefix + k: v.contiguous() for k, v in source.state_dict().items()
             if not (short == "clip_l" and k == "text_projection.weight")}
    if short == "clip_l":
        state[prefix + "text_model.embeddings.position_ids"] = torch.arange(77)[None]
    state["model.diffusion_model.stand_in"] = torch.zeros(3)  # the rest of an SD3 file
    file = tmp_path / "sd3_incl_clips.safetensors"
    save_file(state, str(file))

    reference = create_diffusers_clip_model_from_ldm(CLIPTextModelWithProjection, dict(state),
                                                     config=str(config_dir), local_files_only=True).eval()
    if short == "clip_l":
        assert torch.equal(reference.text_projection.weight, torch.eye(768))

    from mlxdiff.formats.keymaps import strip_prefix
    from mlxdiff.formats.safetensors import load_safetensors
    config = clip.config_from_weights(strip_prefix(load_safetensors(file), prefix))
    assert config["hidden_act"] == cfg["hidden_act"] and config["num_attention_heads"] == cfg["num_attention_heads"]
    spec = ComponentSpec("text_encoder", clip, config, [file], prefix)
    if short == "clip_l":
        spec.extra = clip.sd3_clip_l_extras(config)
    ours = spec.build()

    ids = np.full((2, 77), 1, np.int64)
    ids[:, 0] = 0
    ids[0, 1:9] = np.arange(20, 28)
    ids[0, 9] = cfg["vocab_size"] - 1      # the largest id: legacy argmax pooling lands here
    ids[1, 1:30] = np.arange(40, 69)
    ids[1, 30:] = cfg["vocab_size"] - 1
    ref_hidden, ref_last, ref_pooled = torch_outputs(reference, ids)
    hidden, last, pooled = ours_outputs(ours, ids)
    errors = [max_rel_err(o, r) for o, r in zip(hidden + [last, pooled], ref_hidden + [ref_last, ref_pooled])]
    print(f"{short} single file: max_rel_err {max(errors):.2e}")
    assert max(errors) <= 1e-4


def test_config_from_weights_rejects_other_files():
    with pytest.raises(MlxdiffError, match="not a CLIP text encoder"):
        clip.config_from_weights({"shared.weight": mx.zeros((4, 4))})
