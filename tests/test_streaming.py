"""Below the weights (loading/streaming.py): a component that does not fit its budget runs with blocks streamed from
its file, and gives exactly the numbers of a resident run.

- a small FLUX.2 transformer as a Q4_K_M GGUF (raw blocks in float32, affine in bfloat16), as a diffusers bf16
  folder, as BFL's original safetensors file and as ComfyUI's scaled-fp8 file, SD3.5's MMDiT, a mid-size T5, the
  Mistral3 (also converted to 4 bits) and Qwen3 encoders: streamed outputs identical to resident ones, with LoRAs
  on streamed layers too;
- the plan follows the budget (resident blocks while they fit) and is said; a budget too small even for streaming
  and a streamed re-quantization are refused in one line, naming what works;
- the CLI end to end under --memory-limit at about a third of a mid-size transformer's weights: the same image as the
  resident run, and the process (sampled from outside) holds at most the limit plus the embedded default's own
  overhead (interpreter, imports, tokenizers) and a load's host buffers.
"""

import dataclasses

import numpy as np
import PIL.Image
import pytest

import mlxdiff  # noqa: F401  (OpenBLAS preload before mlx)
import mlx.core as mx

from mlxdiff import default_model, memory
from mlxdiff.errors import MlxdiffError
from mlxdiff.loading import sources, streaming
from mlxdiff.loading.component import load_component
from mlxdiff.loading.streaming import StreamedBlock
from mlxdiff.models import flux2
from mlxdiff.policy import RunPolicy, installed
from fp8_helpers import comfy_file
from gguf_helpers import write_city96_gguf
from memory_helpers import default_with_transformer, load_buffers, sampled_generate, streamed_count

MiB = 2 ** 20
# many small blocks: D = 512 (4 x 128), 8 double + 24 single blocks, 0.14 B parameters (0.27 GB in bf16); the
# text width is the embedded default's encoder's, so the CLI runs it with that encoder and VAE; its weights outweigh
# the process's overhead, which the CLI test's memory bound needs
MANY = dict(patch_size=1, in_channels=32, out_channels=None, num_layers=8, num_single_layers=24,
            attention_head_dim=128, num_attention_heads=4, joint_attention_dim=192, timestep_guidance_channels=64,
            mlp_ratio=3.0, axes_dims_rope=(32, 32, 32, 32), rope_theta=2000, eps=1e-6, guidance_embeds=False)
# the in-process tests' transformer, a fifth of MANY's weights (bf16 compute is slow on CPUs without bf16 units):
# D = 256 (2 x 128, K-quant rows still whole), 4 double + 24 single blocks, so that the non-repeated weights and two
# blocks in flight stay well under 30% of the weights in the Q4_K_M file too (the 60% budget's half left for them)
SMALL = dict(MANY, num_layers=4, num_single_layers=24, num_attention_heads=2)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """{"folder": a pipeline folder (the embedded default with the SMALL transformer in bf16), "gguf": the same
    shapes as a Q4_K_M GGUF, "bfl": the folder's transformer as BFL's original safetensors file, "fp8": as
    ComfyUI's scaled-fp8 file}."""
    import torch
    from diffusers import Flux2Transformer2DModel
    from safetensors.torch import save_file
    from twins import flux2_to_bfl
    root = tmp_path_factory.mktemp("streaming")
    folder = root / "small"
    model = default_with_transformer(folder, SMALL, scale=0.5)
    bfl = root / "small-bfl.safetensors"
    original = flux2_to_bfl(model.state_dict(), SMALL)
    save_file({k: v.contiguous() for k, v in original.items()}, str(bfl))
    _, fp8 = comfy_file({k: v.float().contiguous() for k, v in original.items()}, root / "small-fp8.safetensors",
                        "scaled_fp8")
    with torch.device("meta"):
        shapes = flux2_to_bfl(Flux2Transformer2DModel(**SMALL).state_dict(), SMALL)
    gguf = root / "small-Q4_K_M.gguf"
    write_city96_gguf(gguf, shapes, "flux2", "flux", random=True)
    return {"folder": folder, "gguf": gguf, "bfl": bfl, "fp8": fp8}


@pytest.fixture(scope="module")
def many_folder(tmp_path_factory):
    """The embedded default with the MANY transformer in bf16 (the CLI test's)."""
    folder = tmp_path_factory.mktemp("streaming_cli") / "many"
    default_with_transformer(folder, MANY, scale=0.5)
    return folder


def flux2_inputs(seed=0):
    rng = np.random.default_rng(seed)
    return dict(hidden_states=rng.standard_normal((1, 24, 32)).astype(np.float32),
                encoder_hidden_states=rng.standard_normal((1, 7, 192)).astype(np.float32),
                timestep=np.array([0.4], np.float32),
                img_ids=rng.integers(0, 4, (24, 4)).astype(np.int32), txt_ids=np.zeros((7, 4), np.int32))


def forward(loaded, policy, inputs):
    with installed(memory.decide(policy, loaded.model)):
        return np.array(loaded.model(**{k: mx.array(v) for k, v in inputs.items()}).astype(mx.float32))


def transformer_spec(files, form):
    if form == "gguf":
        return sources.transformer_from_file(files["gguf"], flux2)
    if form in ("bfl", "fp8"):
        return sources.transformer_from_file(files[form], flux2)
    return mlxdiff.load(str(files["folder"])).components["transformer"]


@pytest.mark.parametrize("form, dtype", [("gguf", "float32"), ("gguf", "bfloat16"), ("folder", "bfloat16"),
                                         ("bfl", "float32"), ("fp8", "bfloat16")])
def test_streamed_transformer_is_exact(files, form, dtype):
    """Under a budget of 60% of its weights the transformer streams most of its blocks (and says so), and its
    output is the resident one, bit for bit; a larger budget keeps more blocks resident."""
    spec = transformer_spec(files, form)
    compute = getattr(mx, dtype)
    need = spec.loaded_nbytes(compute_dtype=compute)
    inputs = flux2_inputs()
    resident = load_component(spec, RunPolicy(compute_dtype=compute))
    assert streamed_count(resident.model) == 0
    expected = forward(resident, RunPolicy(), inputs)
    del resident
    counts = []
    for share in (0.6, 0.85):
        policy = RunPolicy(memory_limit=int(share * need))
        loaded = load_component(spec, dataclasses.replace(policy, compute_dtype=compute))
        counts.append(streamed_count(loaded.model))
        assert any("blocks streamed from the file" in n for n in loaded.notes), loaded.notes
        assert loaded.nbytes <= 0.5 * share * need, (loaded.nbytes, need)   # the reserve is half the budget
        got = forward(loaded, policy, inputs)
        assert np.array_equal(got, expected), np.abs(got - expected).max()
        assert loaded.model.block_stream.bytes_read > 0
        del loaded
    assert counts[0] > counts[1] > 0, counts


def test_streamed_t5_is_exact(tmp_path):
    """A mid-size T5 encoder (transformers' layout), streamed under 60% of its weights: the same hidden states;
    block 0, whose relative attention bias the model reads before the loop, stays resident."""
    import torch
    from transformers import T5Config, T5EncoderModel
    torch.manual_seed(1)
    config = T5Config(vocab_size=320, d_model=256, d_kv=32, d_ff=704, num_layers=12, num_heads=8,
                      relative_attention_num_buckets=32, feed_forward_proj="gated-gelu")
    T5EncoderModel(config).save_pretrained(str(tmp_path / "t5"))
    spec = sources.folder_component(tmp_path, "t5", "T5EncoderModel")
    ids = np.random.default_rng(2).integers(0, 320, (1, 19))
    resident = load_component(spec, RunPolicy())
    expected = np.array(resident.model(ids))
    need = spec.loaded_nbytes(compute_dtype=mx.float32)
    loaded = load_component(spec, RunPolicy(memory_limit=int(0.6 * need)))
    blocks = loaded.model.encoder.block
    assert not isinstance(blocks[0], StreamedBlock) and sum(isinstance(b, StreamedBlock) for b in blocks) >= 6
    assert np.array_equal(np.array(loaded.model(ids)), expected)


@pytest.mark.parametrize("kind", ["dev", "klein_base", "dev 4-bit"])
def test_streamed_llm_encoders_are_exact(tmp_path, monkeypatch, kind):
    """FLUX.2's Mistral3 (dev) and Qwen3 (klein) encoders, layer by layer, and the Mistral3 one converted once to 4
    bits (mlxdiff.convert): the same tapped hidden states. These twins are so small that their embeddings outweigh
    the layers, so the activations' reserve is set aside here (RESERVE_SHARE 0) to leave room for streaming at 95%
    of the weights."""
    from mlxdiff.convert import convert
    from twins import TAPS, build_pipeline
    monkeypatch.setattr(streaming, "RESERVE_SHARE", 0.0)
    _, folder, _ = build_pipeline(kind.split()[0], tmp_path)
    if kind.endswith("4-bit"):
        folder = convert(str(folder), tmp_path / "converted", quantize={"text_encoder": 4}, progress=lambda *_: None)
    spec = mlxdiff.load(str(folder)).components["text_encoder"].with_config(taps=list(TAPS))
    ids = mx.array(np.random.default_rng(0).integers(0, 300, (1, 9)))
    expected = np.array(load_component(spec, RunPolicy()).model(ids))
    need = spec.loaded_nbytes(compute_dtype=mx.float32)
    loaded = load_component(spec, RunPolicy(memory_limit=int(0.95 * need)))
    assert sum(isinstance(layer, StreamedBlock) for layer in loaded.model.layers) >= 2
    assert np.array_equal(np.array(loaded.model(ids)), expected)


def test_streamed_layers_take_loras(files, tmp_path):
    """A LoRA on the transformer stays resident and applies to streamed layers as to resident ones."""
    from lora_helpers import linear_shapes, peft_config, peft_file, peft_tensors, targeted, twin
    shapes = linear_shapes(twin(SMALL))
    layers = targeted(shapes, ["to_q", "to_v", "ff.linear_in", "to_qkv_mlp_proj"])
    lora = peft_file(tmp_path / "l.safetensors", peft_tensors(shapes, layers, seed=3),
                     peft_config(["to_q", "to_v", "ff.linear_in", "to_qkv_mlp_proj"]))
    spec = dataclasses.replace(transformer_spec(files, "folder"), loras=((lora, 0.8),))
    inputs = flux2_inputs(1)
    expected = forward(load_component(spec, RunPolicy()), RunPolicy(), inputs)
    need = spec.loaded_nbytes(compute_dtype=mx.float32)
    policy = RunPolicy(memory_limit=int(0.4 * need))
    loaded = load_component(spec, policy)
    assert streamed_count(loaded.model) > 0
    assert np.array_equal(forward(loaded, policy, inputs), expected)


def test_refusals_are_one_line(files):
    spec = transformer_spec(files, "gguf")
    need = spec.loaded_nbytes(compute_dtype=mx.float32)
    with pytest.raises(MlxdiffError) as err:
        load_component(spec, RunPolicy(memory_limit=int(0.05 * need)))
    message = str(err.value)
    assert "\n" not in message and "cannot hold even its streamed form" in message
    assert "the smallest limit that works is about" in message and "smaller quantization type" in message
    folder = transformer_spec(files, "folder")
    quantized = dataclasses.replace(folder, quantize={"bits": 4, "group_size": 64})
    with pytest.raises(MlxdiffError, match=r"quantized again at every step.*python -m mlxdiff.convert .* "
                                           r"--quantize transformer=4"):
        load_component(quantized, RunPolicy(memory_limit=int(0.01 * need)))


def test_file_groups():
    assert streaming.file_group("double_blocks.3.img_attn.qkv.weight") == "double_blocks.3"
    assert streaming.file_group("model.diffusion_model.single_blocks.12.linear1.weight") == \
        "model.diffusion_model.single_blocks.12"
    assert streaming.file_group("blk.7.attn_q.weight") == "blk.7"
    assert streaming.file_group("encoder.block.2.layer.0.SelfAttention.q.weight") == "encoder.block.2"
    assert streaming.file_group("img_in.weight") is None and streaming.file_group("norm.weight") is None


def _cli(tmp_path, name, *args):
    """(what the CLI printed, its largest MLX peak, the outside sampler's peak) for one step (a run streams every
    block at each step: one shows the plan, the image and the peaks as well as two)."""
    stdout, peaks, outside = sampled_generate(tmp_path, name, *args, steps=1)
    return stdout, max(peaks["mlx"].values()), outside


def test_cli_streams_under_a_third_of_the_weights(many_folder, tmp_path):
    """`--memory-limit` at a third of the transformer's bf16 weights: the image is the resident run's, the plan and
    what was read are in the report, and the process holds at most the limit plus the embedded default's overhead
    (its outside peak less its MLX peak) and a load's host buffers (memory_helpers.load_buffers: the largest
    tensor in float32 and the heap glibc retains)."""
    folder = many_folder
    need = mlxdiff.load(str(folder)).components["transformer"].loaded_nbytes(compute_dtype=mx.float32)
    limit = need / 3 / 2 ** 30
    _, tiny_mlx, tiny_outside = _cli(tmp_path, "default")
    overhead = tiny_outside - tiny_mlx
    _, _, resident_outside = _cli(tmp_path, "resident", "--model", str(folder))
    stdout, mlx_peak, outside = _cli(tmp_path, "streamed", "--model", str(folder), "--memory-limit", f"{limit:.4f}")
    print(f"\ntransformer {need / MiB:.0f} MiB, limit {limit * 1024:.0f} MiB: outside peak {outside / MiB:.0f} MiB "
          f"(resident run {resident_outside / MiB:.0f}), MLX peak {mlx_peak / MiB:.0f} MiB, embedded default's "
          f"overhead {overhead / MiB:.0f} MiB; beyond the limit {(outside - limit * 2 ** 30) / MiB:.0f} MiB")
    assert "blocks streamed from the file" in stdout and "of streamed blocks per forward" in stdout
    assert np.array_equal(np.array(PIL.Image.open(tmp_path / "streamed.png")),
                          np.array(PIL.Image.open(tmp_path / "resident.png")))
    assert mlx_peak <= limit * 2 ** 30
    buffers = load_buffers(MANY)
    assert outside <= limit * 2 ** 30 + 1.15 * overhead + buffers, (outside, limit, overhead, buffers)


def test_streamed_encoder_with_padded_prompts(tmp_path, monkeypatch):
    """The Mistral3 encoder streamed, on a batch of two prompts with left padding: rows that see no key go through
    models/fused.through (text_llm reads the layer's parts there); the resident encoder's states, exactly."""
    from twins import TAPS, build_pipeline
    monkeypatch.setattr(streaming, "RESERVE_SHARE", 0.0)
    _, folder, _ = build_pipeline("dev", tmp_path)
    spec = mlxdiff.load(str(folder)).components["text_encoder"].with_config(taps=list(TAPS))
    ids = mx.array(np.random.default_rng(4).integers(3, 300, (2, 11)))
    mask = mx.array(np.array([[0] * 6 + [1] * 5, [1] * 11]))
    expected = np.array(load_component(spec, RunPolicy()).model(ids, mask))
    loaded = load_component(spec, RunPolicy(memory_limit=int(0.95 * spec.loaded_nbytes(
        compute_dtype=mx.float32))))
    assert sum(isinstance(layer, StreamedBlock) for layer in loaded.model.layers) >= 2
    assert np.array_equal(np.array(loaded.model(ids, mask)), expected)


def test_streamed_mmdit_is_exact(sd3_tiny, monkeypatch):
    """SD3.5's MMDiT (the tiny twin: dual attention in block 0, qk RMSNorm, a context-free last block) streamed block
    by block: the resident output. The twin's embedders outweigh its blocks, so the activations' reserve is set
    aside here (RESERVE_SHARE 0)."""
    monkeypatch.setattr(streaming, "RESERVE_SHARE", 0.0)
    folder, _ = sd3_tiny
    spec = mlxdiff.load(str(folder)).components["transformer"]
    rng = np.random.default_rng(5)
    args = [mx.array(rng.standard_normal(s).astype(np.float32)) for s in ((1, 16, 16, 16), (1, 9, 96), (1, 64))]
    t = mx.array([0.3])
    expected = np.array(load_component(spec, RunPolicy()).model(*args, t))
    need = spec.loaded_nbytes(compute_dtype=mx.float32)
    loaded = load_component(spec, RunPolicy(memory_limit=int(0.95 * need)))
    assert sum(isinstance(b, StreamedBlock) for b in loaded.model.transformer_blocks) >= 1
    assert np.array_equal(np.array(loaded.model(*args, t)), expected)
