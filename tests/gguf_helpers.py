"""GGUF test material: valid random blocks for every supported type, small reference-style encoders for the
K-quants (gguf-py cannot quantize them), a writer, a walker that finds header fields to corrupt, and the text
encoder GGUFs as llama.cpp's convert_hf_to_gguf.py writes them (write_llama_cpp_gguf).

`python tests/gguf_helpers.py` prints the measurements quoted in mlxdiff/loading/gguf.py (choices for Q3_K, Q6_K
and Q2_K, and the error of 16-bit scales).
"""

import struct

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFWriter
from gguf import quants as gq

T = GGMLQuantizationType
# float16 fields (byte offsets in the block) that must hold sane finite values
F16_FIELDS = {T.Q4_0: (0,), T.Q4_1: (0, 2), T.Q5_0: (0,), T.Q5_1: (0, 2), T.Q8_0: (0,), T.Q2_K: (80, 82),
              T.Q3_K: (108,), T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,)}
QUANTIZABLE = (T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0)   # gguf-py can quantize these


def random_blocks(qtype, rows, row_len, rng, scale=0.01):
    """[rows, bytes] uint8: random bytes with random finite float16 scales (every code value occurs)."""
    block, nbytes = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(rows, row_len // block, nbytes), dtype=np.uint8)
    for off in F16_FIELDS[qtype]:
        d = (rng.standard_normal((rows, row_len // block)) * scale).astype(np.float16)
        raw[..., off:off + 2] = d.view(np.uint8).reshape(rows, row_len // block, 2)
    return raw.reshape(rows, -1)


def write_gguf(path, tensors, metadata=None, alignment=None):
    """tensors: {name: (qtype, array)}; arrays are float data for F32/F16 or raw uint8 [..., bytes] blocks."""
    w = GGUFWriter(str(path), "test")
    if alignment is not None:
        w.add_custom_alignment(alignment)
    for key, value in (metadata or {}).items():
        if isinstance(value, str):
            w.add_string(key, value)
        elif isinstance(value, list):
            w.add_array(key, value)
        else:
            w.add_uint32(key, value)
    for name, (qtype, arr) in tensors.items():
        if qtype in (T.F32, T.F16):
            w.add_tensor(name, arr)
        else:
            w.add_tensor(name, arr, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def write_q8_0_gguf(path, tensors, arch, quantizes) -> list:
    """A city96 / ComfyUI-GGUF style transformer file: `tensors` (torch, the file's names) as written, Q8_0 for the
    2-D ones whose input width is whole 32-wide blocks and `quantizes(name)` picks, the rest F32; under `arch`.
    Returns the quantized names."""
    writer, quantized = GGUFWriter(str(path), arch), []
    for name, value in tensors.items():
        value = value.float().numpy()
        if value.ndim == 2 and value.shape[1] % 32 == 0 and quantizes(name):
            writer.add_tensor(name, encode(value, GGMLQuantizationType.Q8_0), raw_dtype=GGMLQuantizationType.Q8_0)
            quantized.append(name)
        else:
            writer.add_tensor(name, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return quantized


def header_fields(data: bytes) -> dict:
    """Byte positions of the header fields of a VALID little-endian GGUF (for writing corrupt variants).

    Returns {"tensor_count": 8, "kv_count": 16, "kvs": [{key, key_len, type, value, [item_type, length]}],
    "tensors": [{name, name_len, n_dims, dims: [...], type, offset}], "data_start": int}.
    """
    pos = 24
    (n_tensors, n_kv) = struct.unpack_from("<QQ", data, 8)

    def skip_value(pos, vtype):
        sizes = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
        if vtype in sizes:
            return pos + sizes[vtype]
        if vtype == 8:
            return pos + 8 + struct.unpack_from("<Q", data, pos)[0]
        itype, n = struct.unpack_from("<IQ", data, pos)
        pos += 12
        for _ in range(n):
            pos = skip_value(pos, itype)
        return pos

    kvs = []
    for _ in range(n_kv):
        entry = {"key_len": pos}
        klen = struct.unpack_from("<Q", data, pos)[0]
        entry["key"] = data[pos + 8:pos + 8 + klen].decode()
        pos += 8 + klen
        entry["type"] = pos
        vtype = struct.unpack_from("<I", data, pos)[0]
        pos += 4
        entry["value"] = pos
        if vtype == 9:
            entry["item_type"], entry["length"] = pos, pos + 4
        pos = skip_value(pos, vtype)
        kvs.append(entry)
    tensors = []
    for _ in range(n_tensors):
        entry = {"name_len": pos}
        nlen = struct.unpack_from("<Q", data, pos)[0]
        entry["name"] = data[pos + 8:pos + 8 + nlen].decode()
        pos += 8 + nlen
        entry["n_dims"] = pos
        n_dims = struct.unpack_from("<I", data, pos)[0]
        pos += 4
        entry["dims"] = [pos + 8 * i for i in range(n_dims)]
        pos += 8 * n_dims
        entry["type"], entry["offset"] = pos, pos + 4
        pos += 12
        tensors.append(entry)
    return {"tensor_count": 8, "kv_count": 16, "kvs": kvs, "tensors": tensors, "header_end": pos}


def patched(data: bytes, pos: int, fmt: str, value) -> bytes:
    out = bytearray(data)
    struct.pack_into("<" + fmt, out, pos, value)
    return bytes(out)


# --------------------------------------------------------------------------------------------------------------
# Reference-style K-quant encoders (simplified llama.cpp: signed max-abs scales for symmetric types, min/max for
# the affine ones), only for measurements on realistic weights.


def _round(x):
    return np.floor(x + 0.5)


def _f16_bytes(x):
    return x.astype(np.float16).view(np.uint8).reshape(x.shape[0], 2)


def _signed_absmax(x, axis=-1):
    idx = np.abs(x).argmax(axis=axis)
    return np.take_along_axis(x, np.expand_dims(idx, axis), axis=axis).squeeze(axis)


def encode_q6_k(w):
    x = w.reshape(-1, 16, 16).astype(np.float32)
    nb = x.shape[0]
    sub = _signed_absmax(x) / -32                                    # per sub-block signed scale
    big = _signed_absmax(sub)
    d = np.where(big == 0, 0, big / -128).astype(np.float16).astype(np.float32)
    sc = np.clip(_round(np.divide(sub, d[:, None], out=np.zeros_like(sub), where=d[:, None] != 0)), -128, 127)
    step = d[:, None] * sc
    q = np.clip(_round(np.divide(x, step[..., None], out=np.zeros_like(x), where=step[..., None] != 0)), -32, 31)
    q = (q + 32).astype(np.uint8).reshape(nb, 2, 128)
    ql = (q[:, :, :64] & 15) | ((q[:, :, 64:] & 15) << 4)
    hi = (q >> 4).reshape(nb, 2, 4, 32)
    qh = hi[:, :, 0] | (hi[:, :, 1] << 2) | (hi[:, :, 2] << 4) | (hi[:, :, 3] << 6)
    return np.concatenate([ql.reshape(nb, 128), qh.reshape(nb, 64), sc.astype(np.int8).view(np.uint8),
                           _f16_bytes(d)], axis=1)


def encode_q3_k(w):
    x = w.reshape(-1, 16, 16).astype(np.float32)
    nb = x.shape[0]
    sub = _signed_absmax(x) / -4
    big = _signed_absmax(sub)
    d = np.where(big == 0, 0, big / -32).astype(np.float16).astype(np.float32)
    sc = np.clip(_round(np.divide(sub, d[:, None], out=np.zeros_like(sub), where=d[:, None] != 0)), -32, 31)
    step = d[:, None] * sc
    q = np.clip(_round(np.divide(x, step[..., None], out=np.zeros_like(x), where=step[..., None] != 0)), -4, 3)
    q = (q + 4).astype(np.uint8).reshape(nb, 256)
    low = (q & 3).reshape(nb, 2, 4, 32)
    qs = low[:, :, 0] | (low[:, :, 1] << 2) | (low[:, :, 2] << 4) | (low[:, :, 3] << 6)
    hb = (q >> 2).reshape(nb, 8, 32)
    hmask = np.zeros((nb, 32), np.uint8)
    for b in range(8):
        hmask |= hb[:, b] << b
    s6 = (sc + 32).astype(np.uint8)
    scales = np.zeros((nb, 12), np.uint8)
    scales[:, :8] = (s6[:, :8] & 15) | ((s6[:, 8:] & 15) << 4)
    for s in range(4):
        scales[:, 8:] |= ((s6[:, 4 * s:4 * s + 4] >> 4) & 3) << (2 * s)
    return np.concatenate([hmask, qs.reshape(nb, 64), scales, _f16_bytes(d)], axis=1)


def encode_q2_k(w):
    x = w.reshape(-1, 16, 16).astype(np.float32)
    nb = x.shape[0]
    lo, hi = np.minimum(x.min(-1), 0), x.max(-1)
    scale, mins = (hi - lo) / 3, -lo
    d = (scale.max(-1) / 15).astype(np.float16).astype(np.float32)
    dmin = (mins.max(-1) / 15).astype(np.float16).astype(np.float32)
    sc = np.clip(_round(np.divide(scale, d[:, None], out=np.zeros_like(scale), where=d[:, None] != 0)), 0, 15)
    mq = np.clip(_round(np.divide(mins, dmin[:, None], out=np.zeros_like(mins), where=dmin[:, None] != 0)), 0, 15)
    step, off = d[:, None] * sc, dmin[:, None] * mq
    q = np.clip(_round(np.divide(x + off[..., None], step[..., None], out=np.zeros_like(x),
                                 where=step[..., None] != 0)), 0, 3).astype(np.uint8).reshape(nb, 2, 4, 32)
    qs = q[:, :, 0] | (q[:, :, 1] << 2) | (q[:, :, 2] << 4) | (q[:, :, 3] << 6)
    scales = (sc.astype(np.uint8) | (mq.astype(np.uint8) << 4))
    return np.concatenate([scales, qs.reshape(nb, 64), _f16_bytes(d), _f16_bytes(dmin)], axis=1)


def encode_q4_k(w, high_bits=False):
    """Q4_K (or Q5_K with high_bits=True): min/max affine per 32, 6-bit scale and min codes."""
    levels = 31 if high_bits else 15
    x = w.reshape(-1, 8, 32).astype(np.float32)
    nb = x.shape[0]
    lo, hi = np.minimum(x.min(-1), 0), x.max(-1)
    scale, mins = (hi - lo) / levels, -lo
    d = (scale.max(-1) / 63).astype(np.float16).astype(np.float32)
    dmin = (mins.max(-1) / 63).astype(np.float16).astype(np.float32)
    sc = np.clip(_round(np.divide(scale, d[:, None], out=np.zeros_like(scale), where=d[:, None] != 0)), 0, 63)
    mq = np.clip(_round(np.divide(mins, dmin[:, None], out=np.zeros_like(mins), where=dmin[:, None] != 0)), 0, 63)
    step, off = d[:, None] * sc, dmin[:, None] * mq
    q = np.clip(_round(np.divide(x + off[..., None], step[..., None], out=np.zeros_like(x),
                                 where=step[..., None] != 0)), 0, levels).astype(np.uint8)
    sc, mq = sc.astype(np.uint8), mq.astype(np.uint8)
    scales = np.zeros((nb, 12), np.uint8)
    scales[:, 0:4] = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    scales[:, 4:8] = mq[:, :4] | ((mq[:, 4:] >> 4) << 6)
    scales[:, 8:12] = (sc[:, 4:] & 15) | ((mq[:, 4:] & 15) << 4)
    low = (q & 15).reshape(nb, 4, 2, 32)
    qs = (low[:, :, 0] | (low[:, :, 1] << 4)).reshape(nb, 128)
    parts = [_f16_bytes(d), _f16_bytes(dmin), scales]
    if high_bits:
        qh = np.zeros((nb, 32), np.uint8)
        for j in range(8):
            qh |= (q[:, j] >> 4) << j
        parts.append(qh)
    return np.concatenate(parts + [qs], axis=1)


ENCODERS = {T.Q2_K: encode_q2_k, T.Q3_K: encode_q3_k, T.Q4_K: encode_q4_k,
            T.Q5_K: lambda w: encode_q4_k(w, high_bits=True), T.Q6_K: encode_q6_k}


def encode(w, qtype):
    """float [rows, K] -> raw GGUF bytes [rows, row bytes]."""
    rows = w.shape[0]
    if qtype in ENCODERS:
        return ENCODERS[qtype](w).reshape(rows, -1)
    return gq.quantize(w.astype(np.float32), qtype)


def realistic_weights(rows, cols, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((rows, cols)) * np.exp(rng.normal(0, 0.5, (rows, 1))) * 0.02).astype(np.float32)


def measure(rows=512, cols=4096):
    """Print the numbers behind the type choices in mlxdiff/loading/gguf.py.

    own: rms(file's weights - original) / rms(original); +x: rms(ours - file's weights) / rms(original);
    worse: how much larger rms(ours - original) is than the file's own error. 16-bit scales: max |error| / max |w|
    of the stored form (scales and biases rounded to float16 / bfloat16, then evaluated in float32).
    """
    import tempfile
    from pathlib import Path

    import mlxdiff  # noqa: F401
    import mlx.core as mx
    from mlxdiff.formats.gguf import load_gguf

    w = realistic_weights(rows, cols).astype(np.float64)
    rms_w = float(np.sqrt((w ** 2).mean()))

    def rms(a, b):
        return float(np.sqrt(((np.asarray(a, np.float64) - b) ** 2).mean())) / rms_w

    def describe(deq, ref, own):
        return f"+{rms(deq, ref):.1e} (worse {100 * (rms(deq, w) / own - 1):.0f}%)"

    with tempfile.TemporaryDirectory() as tmp:
        for qtype in (T.Q3_K, T.Q6_K, T.Q2_K, T.Q4_K, T.Q5_K, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0):
            raw = encode(w, qtype)
            ref = gq.dequantize(raw, qtype).astype(np.float64)
            own = rms(ref, w)
            path = write_gguf(Path(tmp) / f"{qtype.name}.gguf", {"w.weight": (qtype, raw)})
            block, nbytes = GGML_QUANT_SIZES[qtype]
            ours = load_gguf(path, mx.float32)["w.weight"]
            line = (f"{qtype.name} ({8 * nbytes / block:.2f} bpw) own {own:.2e} | ours {ours.bits}b "
                    f"g{ours.group_size} ({ours.bits + 64 / ours.group_size:.2f} bpw) "
                    f"{describe(ours.dequantize(), ref, own)}")
            if qtype in (T.Q3_K, T.Q6_K, T.Q2_K):
                for bits, group in ((6, 32), (4, 32), (4, 64), (3, 32)):
                    rq = mx.dequantize(*mx.quantize(mx.array(ref.astype(np.float32)), group_size=group, bits=bits),
                                       group_size=group, bits=bits)
                    line += f" | {bits}b g{group} ({bits + 64 / group:.2f}) {describe(rq, ref, own)}"
            errs = []
            for dt in (mx.float16, mx.bfloat16):
                q16 = load_gguf(path, dt)["w.weight"]
                stored = mx.dequantize(q16.weight, q16.scales.astype(mx.float32), q16.biases.astype(mx.float32),
                                       group_size=q16.group_size, bits=q16.bits)
                errs.append(float(np.abs(np.array(stored, np.float64) - np.array(ours.dequantize(), np.float64)).max()
                                  / np.abs(ref).max()))
            print(line + f" | scales f16 {errs[0]:.1e}, bf16 {errs[1]:.1e}")


def language_model(model):
    """The decoder (embed_tokens, layers, norm) of a Mistral3 or Qwen3 transformers model."""
    return model.model.language_model if hasattr(model.model, "language_model") else model.model


# -- llama.cpp's converter (convert_hf_to_gguf.py), as it writes Mistral (LlamaModel) and Qwen3 (Qwen2Model) ------

def llama_permute(weights, n_head, n_head_kv):
    """convert_hf_to_gguf.py LlamaModel.permute."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))


GGUF_NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
              "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
              "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate",
              "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


def write_llama_cpp_gguf(model, path, arch, qtype=None):
    """A GGUF as llama.cpp's converter writes one: its hyperparameters as metadata, its tensor names, the q/k
    permutation for llama-arch models, 2-D weights in `qtype` (None: F32) and 1-D ones in F32."""
    cfg = getattr(model.config, "text_config", model.config)
    heads, kv = cfg.num_attention_heads, cfg.num_key_value_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    theta = (getattr(cfg, "rope_parameters", None) or {}).get("rope_theta") or cfg.rope_theta
    w = GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_rope_freq_base(float(theta))
    w.add_layer_norm_rms_eps(float(cfg.rms_norm_eps))
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    sd = {k: v.detach().float().numpy() for k, v in language_model(model).state_dict().items()}
    lm_head = model.lm_head.weight.detach().float().numpy()
    for name, data in [*sd.items(), ("lm_head.weight", lm_head)]:
        if name == "embed_tokens.weight":
            gname = "token_embd.weight"
        elif name == "norm.weight":
            gname = "output_norm.weight"
        elif name == "lm_head.weight":
            gname = "output.weight"
        else:
            _, n, rest = name.split(".", 2)
            layer, suffix = rest.rsplit(".", 1)
            gname = f"blk.{n}.{GGUF_NAMES[layer]}.{suffix}"
            if arch == "llama" and layer == "self_attn.q_proj":
                data = llama_permute(data, heads, heads)
            if arch == "llama" and layer == "self_attn.k_proj":
                data = llama_permute(data, heads, kv)
        data = np.ascontiguousarray(data)
        if qtype is not None and data.ndim == 2:
            w.add_tensor(gname, gq.quantize(data, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(gname, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


T5_GGUF = {"layer.0.SelfAttention.q": "attn_q", "layer.0.SelfAttention.k": "attn_k",
           "layer.0.SelfAttention.v": "attn_v", "layer.0.SelfAttention.o": "attn_o",
           "layer.0.SelfAttention.relative_attention_bias": "attn_rel_b",
           "layer.0.layer_norm": "attn_norm", "layer.1.DenseReluDense.wi_0": "ffn_gate",
           "layer.1.DenseReluDense.wi_1": "ffn_up", "layer.1.DenseReluDense.wo": "ffn_down",
           "layer.1.layer_norm": "ffn_norm"}


def write_t5_encoder_gguf(model, path, qtype=None):
    """A T5 encoder GGUF in llama.cpp's names (convert_hf_to_gguf.py T5EncoderModel, as city96's files are): F32, or
    with its 2-D weights (token_embd included, not the small relative attention bias) in `qtype`, as city96's
    t5-v1_1-xxl-encoder-Q8_0 / Q4_K_M files are; returns the path and {state-dict name: float32 as the file
    decodes it (gguf-py's dequantize)}."""
    cfg = model.config
    w = GGUFWriter(str(path), "t5encoder")
    w.add_context_length(512)
    w.add_embedding_length(cfg.d_model)
    w.add_feed_forward_length(cfg.d_ff)
    w.add_block_count(cfg.num_layers)
    w.add_head_count(cfg.num_heads)
    w.add_key_length(cfg.d_kv)
    w.add_value_length(cfg.d_kv)
    w.add_layer_norm_rms_eps(cfg.layer_norm_epsilon)
    w.add_relative_attn_buckets_count(cfg.relative_attention_num_buckets)
    decoded = {}
    for name, v in model.state_dict().items():
        if name == "encoder.embed_tokens.weight":
            continue   # tied to shared
        if name == "shared.weight":
            gname = "token_embd.weight"
        elif name == "encoder.final_layer_norm.weight":
            gname = "enc.output_norm.weight"
        else:
            _, _, n, rest = name.split(".", 3)
            gname = f"enc.blk.{n}.{T5_GGUF[rest.rsplit('.', 1)[0]]}.weight"
        data = np.ascontiguousarray(v.detach().float().numpy())
        if qtype is not None and data.ndim == 2 and "attn_rel_b" not in gname:
            blocks = encode(data, qtype)
            w.add_tensor(gname, blocks, raw_dtype=qtype)
            decoded[name] = gq.dequantize(blocks, qtype).reshape(data.shape)
        else:
            w.add_tensor(gname, data)
            decoded[name] = data
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path, decoded


# -- city96's type mix (ComfyUI-GGUF tools/convert.py + lcpp.patch / lcpp_sd3.patch; tests/test_gguf_models.py) --

FLUX2_KEEP = ("img_in.", "txt_in.", "time_in.", "guidance_in.", "vector_in.", "final_layer.",
              "single_stream_modulation.", "double_stream_modulation_")
SD3_KEEP = ("final_layer.", "time_text_embed.", "context_embedder.", "t_embedder.", "y_embedder.", "x_embedder.",
            "proj_out.weight", "pos_embed")
MIX = {"flux2": (FLUX2_KEEP, T.BF16), "sd3": (SD3_KEEP, T.F16)}


def city96_type(name, shape, family):
    keep, keep_type = MIX[family]
    if len(shape) == 1 or int(np.prod(shape)) <= 1024:
        return T.F32
    if len(shape) != 2 or any(k in name for k in keep):
        return keep_type
    if shape[1] % 256:
        return T.F16   # K-quant fallback
    return T.Q5_K if "attn.qkv.weight" in name else T.Q4_K


def _bf16_bytes(w):
    """float32 -> bfloat16 (round to nearest even, as torch) as raw bytes [rows, 2 * cols]."""
    import torch
    bits = torch.from_numpy(np.ascontiguousarray(w, np.float32)).to(torch.bfloat16).view(torch.int16).numpy()
    return bits.view(np.uint8).reshape(w.shape[0], -1)


def write_city96_gguf(path, tensors: dict, family: str, arch: str, random=False, seed=0, block_scale=1e-3) -> dict:
    """{name: float array | object with .shape} -> a GGUF in city96's mix; returns {name: type}. With random=True
    the values are ignored (shapes only) and quantized tensors get random valid blocks whose float16 scales are
    N(0, block_scale) (for memory and speed only; bench/gguf_cpu.py writes its file with this too)."""
    rng = np.random.default_rng(seed)
    writer = GGUFWriter(str(path), arch)
    types = {}
    for name, value in tensors.items():
        shape = tuple(value.shape)
        qtype = types[name] = city96_type(name, shape, family)
        if random:
            if qtype in (T.F32, T.F16, T.BF16):
                value = (1 if qtype == T.F32 else 0.02) * rng.standard_normal(shape).astype(np.float32)
            else:
                blocks = random_blocks(qtype, shape[0], shape[1], rng, scale=block_scale)
                writer.add_tensor(name, blocks, raw_dtype=qtype)
                continue
        value = np.asarray(value, np.float32)
        if qtype == T.F32:
            writer.add_tensor(name, value)
        elif qtype == T.F16:
            writer.add_tensor(name, value.astype(np.float16))
        elif qtype == T.BF16:
            writer.add_tensor(name, _bf16_bytes(value.reshape(shape[0], -1)), raw_dtype=T.BF16)
        else:
            writer.add_tensor(name, encode(value, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return types


def dequantized(path) -> dict:
    """{name: float32 array} of every tensor, dequantized by gguf-py (the reference decoder)."""
    out = {}
    for t in GGUFReader(str(path)).tensors:
        shape = tuple(int(d) for d in reversed(t.shape))
        out[t.name] = np.ascontiguousarray(gq.dequantize(t.data, t.tensor_type).reshape(shape), np.float32)
    return out


def torch_state(model) -> dict:
    return {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}


# weight noise: about 1/sqrt(fan-in), so that activations stay O(1) through the blocks (the float32 reference then
# sits within 1e-6 of float64; checked in the tests)
SCALE = 0.05


if __name__ == "__main__":
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    measure()
