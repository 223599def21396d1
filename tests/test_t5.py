"""Parity of mlxdiff.models.t5 with transformers' T5EncoderModel (from a save_pretrained folder, in float32, bfloat16
and float16, and from SD3 single-file names against what diffusers' single-file converter builds)."""

import copy

import numpy as np
import pytest

import mlxdiff  # noqa: F401  (OpenBLAS preload before mlx)
import mlx.core as mx
from mlx.utils import tree_flatten

from helpers import load_ours, max_rel_err, randomize_, saved_model_fixture
from mlxdiff.errors import MlxdiffError
from mlxdiff.loading.spec import ComponentSpec
from mlxdiff.models import t5

# Every size differs (d_model, inner = heads * d_kv, d_kv, heads, d_ff, vocab, buckets, layers, tokens). The token
# counts exceed max_distance in "small_buckets", so the log-spaced buckets and their cap are exercised.
CONFIGS = {
    "small_buckets": dict(vocab_size=103, d_model=40, d_kv=6, d_ff=52, num_layers=3, num_heads=5,
                          relative_attention_num_buckets=14, relative_attention_max_distance=20,
                          feed_forward_proj="gated-gelu"),
    "v1_1_buckets": dict(vocab_size=89, d_model=36, d_kv=11, d_ff=44, num_layers=2, num_heads=3,
                         relative_attention_num_buckets=32, relative_attention_max_distance=128,
                         feed_forward_proj="gated-gelu"),
    # original T5 (relu, not gated): the other feed-forward
    "relu": dict(vocab_size=71, d_model=30, d_kv=7, d_ff=26, num_layers=2, num_heads=2,
                 relative_attention_num_buckets=8, relative_attention_max_distance=16, feed_forward_proj="relu"),
}
SEQ = {"small_buckets": 37, "v1_1_buckets": 23, "relu": 19}


def make_ids(name, seed=0):
    cfg = CONFIGS[name]
    return np.random.default_rng(seed).integers(0, cfg["vocab_size"], size=(2, SEQ[name])).astype(np.int64)


def torch_model(name, seed, scale=0.2):
    import torch
    from transformers import T5Config, T5EncoderModel
    torch.manual_seed(seed)
    return randomize_(T5EncoderModel(T5Config(**CONFIGS[name])), seed=seed, scale=scale).eval()


def torch_out(model, ids):
    import torch
    with torch.no_grad():
        return model(torch.from_numpy(ids)).last_hidden_state.float().numpy()


def ours_out(model, ids):
    return np.array(model(mx.array(ids)).astype(mx.float32))


saved = saved_model_fixture(torch_model, CONFIGS, "t5")


def test_folder_parity(saved):
    name, model, folder = saved
    ids = make_ids(name)
    ours = load_ours(folder, t5)
    out = ours_out(ours, ids)
    err = max_rel_err(out, torch_out(model, ids))
    print(f"{name}: max_rel_err {err:.2e}")
    assert out.shape == (2, SEQ[name], CONFIGS[name]["d_model"])
    assert err <= 1e-4
    # one embedding array only: encoder.embed_tokens is the same tensor as shared, not a second parameter
    assert [k for k in dict(tree_flatten(ours.parameters())) if "embed" in k
            or k.startswith("shared")] == ["shared.weight"]


@pytest.mark.parametrize("lengths", [(32, 128), (14, 20), (8, 16)], ids=str)
def test_relative_position_buckets_exact(lengths):
    """The bucket table equals transformers' for every (query, key) pair up to 512 tokens (float32 log edges)."""
    import torch
    from transformers.models.t5.modeling_t5 import T5Attention
    buckets, distance = lengths
    n = 512
    relative = torch.arange(n)[None, :] - torch.arange(n)[:, None]
    ref = T5Attention._relative_position_bucket(relative, bidirectional=True, num_buckets=buckets,
                                                max_distance=distance).numpy()
    assert np.array_equal(t5.relative_position_buckets(n, n, buckets, distance), ref)


def test_bfloat16_weights_and_compute(saved, tmp_path):
    """bf16 weights computed in bf16 (MLX CPU accumulates bf16 matmuls in bf16) stay finite, and are as close to
    float32 as transformers' own bf16 run. These random T5s are sensitive (no attention scaling): rounding the
    weights to bf16 alone moves transformers' float32 output by up to 6.2e-2. Measured against transformers float32
    with the unrounded weights, ours / transformers bf16: 5.7e-2 / 5.7e-2 (small_buckets), 6.5e-2 / 5.7e-2
    (v1_1_buckets), 1.4e-2 / 1.4e-2 (relu). Bounds: 1.5x transformers' bf16 error, and 1e-1."""
    import torch
    name, model, _ = saved
    folder = tmp_path / "bf16"
    model_bf16 = copy.deepcopy(model).to(torch.bfloat16)
    model_bf16.save_pretrained(str(folder))
    ids = make_ids(name)
    ref = torch_out(model, ids)
    ours = load_ours(folder, t5, mx.bfloat16)
    assert ours.shared.weight.dtype == mx.bfloat16  # stored dtype kept
    result = ours(mx.array(ids))
    assert result.dtype == mx.bfloat16
    err = max_rel_err(np.array(result.astype(mx.float32)), ref)
    torch_err = max_rel_err(torch_out(model_bf16, ids), ref)
    print(f"{name} bf16: max_rel_err {err:.2e} (transformers bf16: {torch_err:.2e})")
    assert err <= 1.5 * torch_err and err <= 1e-1


def test_float16_overflow_matches_transformers(tmp_path):
    """In float16, T5 XXL's activations overflow. transformers keeps `wo` in float32 and clamps float16 hidden
    states that reach inf to +-(65504 - 1000); we do the same. Two token rows of 6.5e4 make block 0's attention
    residual overflow (the clamp is taken), and a large wo makes every feed-forward output exceed float16 (finite
    only through the float32 wo). Both runs use the same float16 weights. Measured: 3.7e-3 (2.9e-3 to 3.8e-3 over
    four inputs); for scale, transformers' own float16 run of such a model is 5.5e-3 from its float32 run. Bound
    5e-3."""
    import torch
    from transformers import T5EncoderModel
    name = "v1_1_buckets"
    model = torch_model(name, seed=3)
    big_tokens = [7, 19]
    with torch.no_grad():
        signs = torch.sign(torch.randn(len(big_tokens), CONFIGS[name]["d_model"],
                                       generator=torch.Generator().manual_seed(1)))
        model.shared.weight[big_tokens] = 6.5e4 * signs
        model.encoder.block[0].layer[0].SelfAttention.o.weight.mul_(1e3)
        for block in model.encoder.block:
            wo = block.layer[1].DenseReluDense.wo.weight
            wo.mul_(6e4 / wo.abs().max())  # as large as float16 can store
    model.half().save_pretrained(str(tmp_path))
    reference = T5EncoderModel.from_pretrained(str(tmp_path), dtype=torch.float16).eval()
    assert reference.encoder.block[0].layer[1].DenseReluDense.wo.weight.dtype == torch.float32

    ids = make_ids(name, seed=5)
    ids[:, [3, 10]] = big_tokens
    with torch.no_grad():
        after_attn, _, _ = reference.encoder.block[0].layer[0](reference.shared(torch.from_numpy(ids)))
        clamped = after_attn.clamp(-64504, 64504)
        ff_out = reference.encoder.block[0].layer[1].DenseReluDense(
            reference.encoder.block[0].layer[1].layer_norm(clamped))
    assert torch.isinf(after_attn).any()          # the clamp is taken
    assert ff_out.abs().max() > 65504              # float16 wo would overflow

    ref = torch_out(reference, ids)
    ours_model = load_ours(tmp_path, t5, mx.float16)
    out = ours_out(ours_model, ids)
    assert np.isfinite(ref).all() and np.isfinite(out).all()
    err = max_rel_err(out, ref)
    print(f"float16 overflow: max_rel_err {err:.2e}")
    assert err <= 5e-3
    # without the guards the result is not finite: that is what they are for
    t5_clamp, t5_wo = t5.clamp_fp16, t5._wo_input
    try:
        t5.clamp_fp16 = lambda x: x
        t5._wo_input = lambda h: h
        assert not np.isfinite(ours_out(ours_model, ids)).all()
    finally:
        t5.clamp_fp16, t5._wo_input = t5_clamp, t5_wo


# -- SD3 single files ---------------------------------------------------------------------------------------

SINGLE = dict(vocab_size=131, d_model=56, d_kv=9, d_ff=46, num_layers=2, num_heads=6,
              relative_attention_num_buckets=18, relative_attention_max_distance=128, layer_norm_epsilon=1e-6,
              feed_forward_proj="gated-gelu")


@pytest.mark.parametrize("layout", ["incl_clips", "t5xxl_file", "embed_tokens_only"])
def test_single_file_matches_diffusers_converter(layout, tmp_path):
    """incl_clips: the text_encoders.t5xxl.transformer.* part of an SD3 file with shared.weight and no
    encoder.embed_tokens.weight, against diffusers' create_diffusers_t5_model_from_checkpoint (given the real
    config). t5xxl_file: t5xxl_fp16.safetensors names (no prefix) with both tied keys. embed_tokens_only: a file
    naming the embedding only encoder.embed_tokens.weight."""
    import torch
    from safetensors.torch import save_file
    from transformers import T5Config, T5EncoderModel
    from diffusers.loaders.single_file_utils import create_diffusers_t5_model_from_checkpoint
    from mlxdiff.formats.keymaps import strip_prefix
    from mlxdiff.formats.safetensors import load_safetensors

    torch.manual_seed(5)
    source = randomize_(T5EncoderModel(T5Config(**SINGLE)), seed=13)
    config_dir = tmp_path / "config"   # stands in for the hub repo diffusers would fetch the config from
    T5Config(**SINGLE).save_pretrained(str(config_dir))
    state = {k: v.contiguous() for k, v in source.state_dict().items() if k != "encoder.embed_tokens.weight"}
    assert "shared.weight" in state
    prefix = "text_encoders.t5xxl.transformer." if layout == "incl_clips" else ""
    if layout == "t5xxl_file":
        state["encoder.embed_tokens.weight"] = state["shared.weight"].clone()
    if layout == "embed_tokens_only":
        state["encoder.embed_tokens.weight"] = state.pop("shared.weight")
    state = {prefix + k: v for k, v in state.items()}
    if layout == "incl_clips":
        state["model.diffusion_model.stand_in"] = torch.zeros(3)
    file = tmp_path / "file.safetensors"
    save_file(state, str(file))

    config = t5.config_from_weights(strip_prefix(load_safetensors(file), prefix))
    assert {k: config[k] for k in SINGLE} == SINGLE
    ours = ComponentSpec("text_encoder_3", t5, config, [file], prefix).build()
    ids = np.random.default_rng(2).integers(0, SINGLE["vocab_size"], size=(2, 29)).astype(np.int64)
    if layout == "incl_clips":
        reference = create_diffusers_t5_model_from_checkpoint(T5EncoderModel, dict(state), config=str(config_dir),
                                                              local_files_only=True).eval()
        # diffusers 0.42 + transformers 5.24 leave encoder.embed_tokens on the meta device when the dict has only
        # shared.weight (the weights are never re-tied); tie them as from_pretrained would
        assert reference.encoder.embed_tokens.weight.device.type == "meta"
        reference.tie_weights()
    else:  # diffusers only reads the prefixed form; the reference is the source model itself
        reference = source.eval()
    err = max_rel_err(ours_out(ours, ids), torch_out(reference, ids))
    print(f"{layout}: max_rel_err {err:.2e}")
    assert err <= 1e-4


def test_config_from_weights_rejects_other_files():
    with pytest.raises(MlxdiffError, match="not a T5 encoder"):
        t5.config_from_weights({"text_model.embeddings.token_embedding.weight": mx.zeros((4, 4))})
