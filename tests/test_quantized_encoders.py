"""Text encoders kept at their file's size (issue 14): a quantized token embedding decodes only the looked-up rows
(GGUF blocks: formats/gguf.RawEmbedding; float8: formats/fp8.Fp8Embedding), an LLM encoder file deeper than its
deepest tap reads only the layers it uses, and city96's quantized T5 encoder GGUFs match their own decoded weights.

Resident bytes are measured as MLX's active memory after the model is built and materialized (what loading left),
against the bytes, as stored, of the tensors the encoder reads.
"""

import numpy as np
import pytest

from mlxdiff import backend  # noqa: F401  (before mlx)
import mlx.core as mx

from mlxdiff.formats import tensor_nbytes
from mlxdiff.formats.fp8 import Fp8Embedding, Fp8Linear
from mlxdiff.formats.gguf import RawEmbedding, RawLinear
from mlxdiff.loading.component_files import text_encoder_file
from mlxdiff.loading.sources import text_encoder_from_file
from mlxdiff.models import text_llm
from helpers import max_rel_err, randomize_

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")
from safetensors.torch import save_file  # noqa: E402
from gguf_helpers import language_model, write_llama_cpp_gguf, write_t5_encoder_gguf  # noqa: E402
from quantized_helpers import resident_after_build  # noqa: E402

T = gguf.GGMLQuantizationType


# -- an embedding kept quantized decodes exactly the looked-up rows ------------------------------------------------

EMBEDDED = (T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K)


@pytest.mark.parametrize("qtype", EMBEDDED, ids=lambda t: t.name)
def test_raw_embedding_rows_are_gguf_py(tmp_path, qtype):
    """A GGUF embedding kept as the file's blocks (RawEmbedding): it holds the file's bytes, and the rows it looks up
    equal gguf-py's dequantize of those rows bit for bit."""
    import mlx.nn as nn
    from mlxdiff.formats.gguf import load_gguf, use_raw_layers
    from mlxdiff.formats.quantized import flatten_quantized
    from gguf_helpers import random_blocks, write_gguf
    rng = np.random.default_rng(int(qtype))
    raw = random_blocks(qtype, 50, 512, rng)
    path = write_gguf(tmp_path / "e.gguf", {"table.weight": (qtype, raw)})

    class One(nn.Module):
        def __init__(self):
            super().__init__()
            self.table = nn.Embedding(50, 512)

    model = One()
    flat, layers = flatten_quantized(load_gguf(path, mx.float32, layout="raw"))
    use_raw_layers(model, layers, mx.float32)
    model.load_weights(list(flat.items()), strict=True)
    assert isinstance(model.table, RawEmbedding) and model.table.weight.nbytes == raw.nbytes
    ids = np.array([[3, 49, 0, 3], [17, 8, 8, 1]])
    want = gguf.quants.dequantize(raw, qtype).astype(np.float32)[ids]
    got = np.array(model.table(mx.array(ids)))
    assert got.dtype == np.float32 and np.array_equal(got, want)


def test_fp8_embedding_rows_are_the_decoded_rows():
    """A float8 embedding (Fp8Embedding) keeps its codes and per-row scales and decodes the looked-up rows as
    ComfyUI does (float32(code) x scale)."""
    import mlx.nn as nn
    from mlxdiff.formats.fp8 import use_fp8_layers
    from mlxdiff.formats.quantized import Float8Weight, flatten_quantized
    values = torch.randn(40, 24) * 3
    codes = values.to(torch.float8_e4m3fn)
    scale = torch.rand(40) + 0.5
    want = (codes.float() * scale[:, None]).numpy()

    class One(nn.Module):
        def __init__(self):
            super().__init__()
            self.table = nn.Embedding(40, 24)

    model = One()
    weight = Float8Weight(mx.array(codes.view(torch.uint8).numpy()), mx.array(scale.numpy()))
    flat, layers = flatten_quantized({"table.weight": weight})
    use_fp8_layers(model, layers, flat, mx.float32)
    model.load_weights(list(flat.items()), strict=True)
    assert isinstance(model.table, Fp8Embedding) and model.table.weight.dtype == mx.uint8
    ids = np.array([[0, 39, 5], [5, 5, 12]])
    assert np.array_equal(np.array(model.table(mx.array(ids))), want[ids])


# -- city96's T5 encoder GGUFs, quantized --------------------------------------------------------------------------

T5_CONFIG = dict(vocab_size=3000, d_model=256, d_kv=32, d_ff=512, num_layers=2, num_heads=8,
                 relative_attention_num_buckets=32, relative_attention_max_distance=128,
                 feed_forward_proj="gated-gelu", layer_norm_epsilon=1e-6)


@pytest.mark.parametrize("qtype", [T.Q8_0, T.Q4_K])
def test_t5_encoder_gguf_quantized(tmp_path, qtype):
    """`t5-v1_1-xxl-encoder-Q8_0.gguf` / `-Q4_K_M.gguf`'s layout (llama.cpp names, 2-D weights and token_embd
    quantized, norms and the relative attention bias F32) at a tiny config: read as SD3.5's t5xxl file, it stays
    quantized (the embedding too, only looked-up rows decoded), costs at most 1.1x its tensors' bytes, and matches
    transformers run on the weights gguf-py's dequantize gives."""
    model = randomize_(transformers.T5EncoderModel(transformers.T5Config(**T5_CONFIG)), seed=4, scale=0.2).eval()
    path, decoded = write_t5_encoder_gguf(model, tmp_path / f"t5-v1_1-xxl-encoder-{qtype.name}.gguf", qtype)
    decoded["encoder.embed_tokens.weight"] = decoded["shared.weight"]
    model.load_state_dict({k: torch.from_numpy(np.asarray(v)) for k, v in decoded.items()})
    file_bytes = sum(tensor_nbytes(path).values())

    spec = text_encoder_file("t5xxl", path)
    ours, active, resident = resident_after_build(spec)
    assert isinstance(ours.shared, RawEmbedding) and ours.shared.type_name == qtype.name
    assert sum(isinstance(m, RawLinear) for _, m in ours.named_modules()) == 7 * T5_CONFIG["num_layers"]
    print(f"T5 {qtype.name}: file tensors {file_bytes} B, parameters {resident} B, MLX active +{active} B")
    assert resident <= 1.1 * file_bytes and active <= 1.1 * file_bytes

    ids = np.random.default_rng(1).integers(0, T5_CONFIG["vocab_size"], size=(2, 29)).astype(np.int64)
    with torch.no_grad():
        ref = model(torch.from_numpy(ids)).last_hidden_state.double().numpy()
    err = max_rel_err(np.array(ours(mx.array(ids)).astype(mx.float32), np.float64), ref)
    print(f"T5 {qtype.name}: max rel err {err:.2e}")
    assert err <= 1e-4


# -- LLM encoders: a quantized embedding and the layers past the deepest tap stay unread --------------------------

QWEN3 = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=10, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, vocab_size=6000, max_position_embeddings=128, rope_theta=1e6,
             rms_norm_eps=1e-6, tie_word_embeddings=False)
TAPS = (1, 2, 3)   # reads the embedding and layers 0..2 of 10


@pytest.fixture(scope="module")
def qwen3():
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**QWEN3)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.2 + (1.0 if p.ndim == 1 else 0.0))
    return model


def comfy_fp8_file(model, path):
    """ComfyUI's scaled-fp8 text encoder layout (`qwen_3_4b_fp8_scaled.safetensors`): top-level `scaled_fp8`
    marker, every 2-D weight float8 e4m3fn with a per-tensor `scale_weight` (the embedding included), norms bf16;
    returns {state-dict name: float32 as ComfyUI decodes it}."""
    tensors, decoded = {"scaled_fp8": torch.empty(0, dtype=torch.float8_e4m3fn)}, {}
    for name, value in language_model(model).state_dict().items():
        value, key = value.detach().float().contiguous(), "model." + name
        if value.ndim == 2:
            scale = value.abs().amax() / 448.0
            tensors[key] = (value / scale).to(torch.float8_e4m3fn)
            tensors[key[:-len(".weight")] + ".scale_weight"] = scale.reshape(()).float()
            decoded[name] = tensors[key].float() * scale
        else:
            tensors[key] = value.to(torch.bfloat16)
            decoded[name] = tensors[key].float()
    save_file(tensors, str(path))
    return decoded


def reference(model, ids, taps=TAPS):
    with torch.no_grad():
        out = model(input_ids=torch.from_numpy(ids).long(), output_hidden_states=True)
    return torch.cat([out.hidden_states[k] for k in taps], dim=-1).double().numpy()


def read_bytes(path, spec):
    """(bytes of the tensors the encoder reads, bytes of the layers past the deepest tap), as stored."""
    import re
    args = text_llm.ModelArgs.from_dict(spec.config)
    stored = tensor_nbytes(path)
    past = sum(n for name, n in stored.items()
               if (m := re.match(r"(?:model\.layers|blk)\.(\d+)\.", name)) and int(m.group(1)) >= max(TAPS))
    assert past > 0.5 * sum(n for name, n in stored.items() if re.match(r"(?:model\.layers|blk)\.", name))
    return sum(n for name, n in stored.items() if text_llm.reads_stored(name, args)), past


def test_fp8_encoder_embedding_and_unused_layers(qwen3, tmp_path):
    """An fp8 Qwen3 file: the embedding stays float8 (Fp8Embedding; decoded whole in float32 it would be 4x its
    bytes, the largest tensor of the file), the tapped layers' linears Fp8Linear, the 7 layers past the deepest tap
    are never read; resident at most 1.1x the bytes of what it reads, and the taps match transformers on the decoded
    weights."""
    path = tmp_path / "qwen_3_fp8_scaled.safetensors"
    decoded = comfy_fp8_file(qwen3, path)
    reference_model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**QWEN3)).eval()
    language_model(reference_model).load_state_dict(decoded)
    spec = text_encoder_from_file(path, TAPS, base_config={**QWEN3, "model_type": "qwen3"})
    read, past = read_bytes(path, spec)
    ours, active, resident = resident_after_build(spec)
    assert isinstance(ours.embed_tokens, Fp8Embedding) and ours.embed_tokens.weight.dtype == mx.uint8
    assert len(ours.layers) == max(TAPS)
    assert all(isinstance(layer.self_attn.q_proj, Fp8Linear) for layer in ours.layers)
    print(f"fp8 Qwen3: read {read} B, past the taps {past} B, parameters {resident} B, MLX active +{active} B")
    assert past > 0.1 * read and resident <= 1.1 * read and active <= 1.1 * read
    ids = np.random.default_rng(3).integers(0, QWEN3["vocab_size"], size=(2, 17))
    err = max_rel_err(np.array(ours(ids), np.float64), reference(reference_model, ids))
    print(f"fp8 Qwen3: max rel err {err:.2e}")
    assert err <= 1e-4


@pytest.mark.parametrize("kind", ["gguf-Q8_0", "safetensors-bf16"])
def test_encoder_reads_only_the_tapped_layers(qwen3, tmp_path, kind):
    """A GGUF (Q8_0, embedding kept as blocks) or bf16 safetensors Qwen3 file of 10 layers tapped at (1, 2, 3):
    only the embedding and layers 0..2 become resident (at most 1.1x their stored bytes; the 7 layers past the taps,
    more than that, never are)."""
    if kind == "gguf-Q8_0":
        path = write_llama_cpp_gguf(qwen3, tmp_path / "Qwen3-tiny-Q8_0.gguf", "qwen3", T.Q8_0)
        base = None   # the GGUF's metadata gives rope theta and eps
    else:
        path = tmp_path / "qwen_3_tiny.safetensors"
        save_file({k: v.detach().to(torch.bfloat16).contiguous() for k, v in qwen3.state_dict().items()}, str(path))
        base = {**QWEN3, "model_type": "qwen3"}
    spec = text_encoder_from_file(path, TAPS, base_config=base)
    read, past = read_bytes(path, spec)
    ours, active, resident = resident_after_build(spec)
    if kind == "gguf-Q8_0":
        assert isinstance(ours.embed_tokens, RawEmbedding)
    print(f"{kind}: read {read} B, past the taps {past} B, parameters {resident} B, MLX active +{active} B")
    assert len(ours.layers) == max(TAPS)
    # the layers past the taps are more than the 10% allowance: resident, they would break the bound
    assert past > 0.1 * read and resident <= 1.1 * read and active <= 1.1 * read
    estimate = spec.loaded_nbytes(compute_dtype=mx.float32)
    assert abs(estimate - resident) <= 0.1 * resident
