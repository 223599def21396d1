"""FLUX.2 text encoders (mlxdiff.models.text_llm) against transformers and diffusers' own prompt helpers.

Tiny Mistral3ForConditionalGeneration (text + Pixtral vision tower) and Qwen3ForCausalLM models are randomized,
saved with save_pretrained and loaded through our loader; every dimension differs from the others. diffusers'
`Flux2Pipeline._get_mistral_3_small_prompt_embeds` / `Flux2KleinPipeline._get_qwen3_prompt_embeds` run the torch
model with a stand-in tokenizer (byte-level BPE + the family's special tokens + a chat template in the family's format),
and a forward pre-hook records the input_ids / attention_mask they pass, so our tokenization is checked against theirs.
"""

import json
import os
import shutil
import struct

import numpy as np
import pytest

from mlxdiff import backend  # noqa: F401  (before mlx)
import mlx.core as mx
import mlx.nn as nn

from mlxdiff.errors import MlxdiffError
from mlxdiff.loading.quantize import materialize
from mlxdiff import tokenizers
from mlxdiff.loading.sources import text_encoder_spec
from helpers import max_rel_err
from twins import MISTRAL_TEMPLATE, QWEN3_TEMPLATE, build_tokenizer, save_mistral3, save_qwen3

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

PROMPTS = ["a red fox [IMG]in the snow",
           "a watercolor painting of a lighthouse by the sea at dawn with a cat on a wooden table " * 3]

# (text_config, vision_config, taps, max_sequence_length); B: a sliding window shorter than the sequence, and a tap on
# the last layer (transformers' last hidden state is the final-normed one)
MISTRAL_CASES = {
    "A": (dict(hidden_size=48, intermediate_size=80, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
               head_dim=20, vocab_size=333, rope_theta=1e6, sliding_window=None),
          dict(hidden_size=32, intermediate_size=40, num_hidden_layers=1, num_attention_heads=2, head_dim=16,
               image_size=28, patch_size=14), (1, 3, 4), 150),
    "B": (dict(hidden_size=56, intermediate_size=72, num_hidden_layers=5, num_attention_heads=2, num_key_value_heads=1,
               head_dim=24, vocab_size=347, rope_theta=1e9, sliding_window=9, rms_norm_eps=1e-6),
          dict(hidden_size=24, intermediate_size=36, num_hidden_layers=2, num_attention_heads=3, head_dim=8,
               image_size=42, patch_size=14), (2, 4, 5), 168),
}
QWEN3_CASES = {
    "A": (dict(hidden_size=40, intermediate_size=72, num_hidden_layers=5, num_attention_heads=4, num_key_value_heads=2,
               head_dim=12, vocab_size=321, rope_theta=1e6), (1, 3, 4), 60),
    "B": (dict(hidden_size=36, intermediate_size=52, num_hidden_layers=6, num_attention_heads=3, num_key_value_heads=1,
               head_dim=16, vocab_size=339, rope_theta=1e4, use_sliding_window=True, sliding_window=10,
               max_window_layers=3, rms_norm_eps=1e-5), (2, 5, 6), 72),
}


@pytest.fixture(scope="module")
def mistral_tokenizer(tmp_path_factory):
    # LlamaTokenizer (Mistral's class in transformers) pads on the left
    folder = build_tokenizer(tmp_path_factory.mktemp("mistral_tok"),
                             ["<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]",
                              "<pad>", "[IMG]"], MISTRAL_TEMPLATE, "left", "<pad>", "<s>", "</s>", add_bos=True)
    return tokenizers.load_chat_tokenizer(folder)


@pytest.fixture(scope="module")
def qwen3_tokenizer(tmp_path_factory):
    # Qwen2Tokenizer pads on the right with <|endoftext|>
    folder = build_tokenizer(tmp_path_factory.mktemp("qwen3_tok"),
                             ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"],
                             QWEN3_TEMPLATE, "right", "<|endoftext|>", eos="<|im_end|>")
    return tokenizers.load_chat_tokenizer(folder)


@pytest.fixture(scope="module", params=sorted(MISTRAL_CASES))
def mistral_case(request, tmp_path_factory):
    text, vision, taps, length = MISTRAL_CASES[request.param]
    folder = tmp_path_factory.mktemp(f"mistral3_{request.param}")
    return save_mistral3(folder, text, vision, seed=ord(request.param)), folder, taps, length


@pytest.fixture(scope="module", params=sorted(QWEN3_CASES))
def qwen3_case(request, tmp_path_factory):
    text, taps, length = QWEN3_CASES[request.param]
    folder = tmp_path_factory.mktemp(f"qwen3_{request.param}")
    return save_qwen3(folder, text, seed=10 + ord(request.param)), folder, taps, length


def run_diffusers_helper(helper, torch_model, **kwargs):
    """diffusers' prompt_embeds, and the input_ids / attention_mask it fed the text encoder."""
    fed = {}
    hook = torch_model.register_forward_pre_hook(lambda module, args, kw: fed.update(kw), with_kwargs=True)
    try:
        with torch.no_grad():
            embeds = helper(text_encoder=torch_model, dtype=torch.float32, device=torch.device("cpu"), **kwargs)
    finally:
        hook.remove()
    return embeds.numpy(), fed["input_ids"].numpy(), fed["attention_mask"].numpy()


def test_system_message_is_diffusers():
    from diffusers.pipelines.flux2.system_messages import SYSTEM_MESSAGE
    assert tokenizers.SYSTEM_MESSAGE == SYSTEM_MESSAGE


def test_dev_matches_diffusers(mistral_case, mistral_tokenizer):
    from diffusers import Flux2Pipeline
    torch_model, folder, taps, length = mistral_case
    ref, ref_ids, ref_mask = run_diffusers_helper(
        Flux2Pipeline._get_mistral_3_small_prompt_embeds, torch_model, tokenizer=mistral_tokenizer,
        prompt=PROMPTS, max_sequence_length=length, hidden_states_layers=taps)

    ids, mask = tokenizers.tokenize_dev(mistral_tokenizer, PROMPTS, length)
    np.testing.assert_array_equal(ids, ref_ids)
    np.testing.assert_array_equal(mask, ref_mask)
    assert mask[0, 0] == 0 and mask[0, -1] == 1 and mask[1].all()   # left-padded short prompt, truncated long one
    assert ids[0, -1] == mistral_tokenizer.convert_tokens_to_ids("[/INST]")
    assert mistral_tokenizer.convert_tokens_to_ids("[IMG]") not in ids[0]
    bos = mistral_tokenizer.bos_token_id
    assert ids[1, 0] == bos and (ids == bos).sum(axis=1).tolist() == [1, 1]   # the template's BOS, not a second one

    encoder = text_encoder_spec(folder, taps).build()
    assert len(encoder.layers) == max(taps)
    ours = encoder(ids, mask)
    assert ours.shape == (2, length, 3 * torch_model.config.text_config.hidden_size)
    err = max_rel_err(np.array(ours), ref)
    print(f"dev {taps}: max_rel_err {err:.2e}")
    assert err <= 1e-4


def test_klein_matches_diffusers(qwen3_case, qwen3_tokenizer):
    from diffusers import Flux2KleinPipeline
    torch_model, folder, taps, length = qwen3_case
    ref, ref_ids, ref_mask = run_diffusers_helper(
        Flux2KleinPipeline._get_qwen3_prompt_embeds, torch_model, tokenizer=qwen3_tokenizer,
        prompt=PROMPTS, max_sequence_length=length, hidden_states_layers=taps)

    ids, mask = tokenizers.tokenize_klein(qwen3_tokenizer, PROMPTS, length)
    np.testing.assert_array_equal(ids, ref_ids)
    np.testing.assert_array_equal(mask, ref_mask)
    assert mask[0, 0] == 1 and mask[0, -1] == 0 and mask[1].all()   # right-padded short prompt, truncated long one
    think = qwen3_tokenizer.convert_tokens_to_ids("</think>")
    assert think in ids[0]                                          # enable_thinking=False's empty think block

    encoder = text_encoder_spec(folder, taps).build()
    ours = encoder(ids, mask)
    assert ours.shape == (2, length, 3 * torch_model.config.hidden_size)
    err = max_rel_err(np.array(ours), ref)
    print(f"klein {taps}: max_rel_err {err:.2e}")
    assert err <= 1e-4


def test_layers_below_the_deepest_tap_are_all_that_is_read(tmp_path):
    """Put what the taps need in shard 1 and the rest (deeper layers, final norm, lm_head) in shard 2, build the
    encoder, then cut shard 2's data off the file: evaluating any of its tensors now fails (checked), yet the encoder
    materializes and matches transformers."""
    from safetensors.numpy import load_file, save_file
    text, taps = QWEN3_CASES["A"][0], (1, 2, 3)
    torch_model = save_qwen3(tmp_path / "hf", text, seed=5)
    tensors = load_file(tmp_path / "hf" / "model.safetensors")
    needed = {k for k in tensors if k.startswith("model.embed_tokens.")
              or (k.startswith("model.layers.") and int(k.split(".")[2]) < max(taps))}
    assert len(needed) < len(tensors) and any(k.startswith("model.layers.4.") for k in tensors)
    split = tmp_path / "split"
    split.mkdir()
    shards = {"model-00001-of-00002.safetensors": sorted(needed),
              "model-00002-of-00002.safetensors": sorted(set(tensors) - needed)}
    for name, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, split / name)
    (split / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {k: name for name, keys in shards.items() for k in keys}}))
    shutil.copy(tmp_path / "hf" / "config.json", split / "config.json")
    deep = split / "model-00002-of-00002.safetensors"
    shard1 = split / "model-00001-of-00002.safetensors"
    with open(shard1, "rb") as f:
        shard1_data = os.path.getsize(shard1) - 8 - struct.unpack("<Q", f.read(8))[0]
    assert text_encoder_spec(split, taps).nbytes() == shard1_data

    encoder = text_encoder_spec(split, taps).build()
    witness = mx.load(str(deep))["model.layers.4.mlp.up_proj.weight"]   # mapped now, read on evaluation
    with open(deep, "rb") as f:
        header = struct.unpack("<Q", f.read(8))[0]
    os.truncate(deep, 8 + header)
    with pytest.raises((RuntimeError, ValueError)):
        mx.eval(witness)

    materialize(encoder)
    ids = np.random.default_rng(0).integers(0, text["vocab_size"], (2, 9))
    mask = np.ones((2, 9), np.int64)
    mask[1, 6:] = 0
    with torch.no_grad():
        out = torch_model(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask), output_hidden_states=True)
    ref = torch.cat([out.hidden_states[k] for k in taps], dim=-1).numpy()
    assert max_rel_err(np.array(encoder(ids, mask)), ref) <= 1e-4


def test_bf16_weights_stay_bf16_and_compute_in_float32(tmp_path):
    """A bf16 checkpoint: weights are kept in bf16, the arithmetic runs in float32, and the result matches
    transformers loading the same folder in float32."""
    text, taps = QWEN3_CASES["A"][0], (2, 3)
    save_qwen3(tmp_path, text, seed=3).to(torch.bfloat16).save_pretrained(tmp_path)
    encoder = text_encoder_spec(tmp_path, taps).build()
    assert encoder.embed_tokens.weight.dtype == mx.bfloat16
    assert encoder.layers[1].mlp.up_proj.weight.dtype == mx.bfloat16
    ids = np.random.default_rng(3).integers(0, text["vocab_size"], (1, 8))
    ours = encoder(ids)
    assert ours.dtype == mx.float32
    reference = transformers.Qwen3ForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    with torch.no_grad():
        out = reference(input_ids=torch.tensor(ids), output_hidden_states=True)
    ref = torch.cat([out.hidden_states[k] for k in taps], dim=-1).numpy()
    assert max_rel_err(np.array(ours), ref) <= 1e-4


@pytest.mark.parametrize("family", ["mistral3", "qwen3"])
def test_mlx_lm_4bit_folder(tmp_path, family):
    """mlx-lm's load_model + quantize_model (4-bit, group 32) + save_model/save_config, loaded back through ours:
    quantized where mlx-lm quantized, equal to mlx-lm's own forward of that folder, and close to the float model."""
    from mlx_lm.utils import load_model, quantize_model, save_config, save_model
    text = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=5, num_attention_heads=4,
                num_key_value_heads=2, head_dim=32, vocab_size=200, rope_theta=1e6)
    hf = tmp_path / "hf"
    if family == "mistral3":
        torch_model = save_mistral3(hf, dict(text, sliding_window=None), MISTRAL_CASES["A"][1], seed=7, scale=0.02)
        # mlx-lm's llama.ModelArgs reads rope_theta only at the top of text_config (older transformers wrote it
        # there, as Mistral-Small's config.json has it), not under transformers 5's rope_parameters
        config = json.loads((hf / "config.json").read_text())
        config["text_config"]["rope_theta"] = text["rope_theta"]
        (hf / "config.json").write_text(json.dumps(config))
    else:
        torch_model = save_qwen3(hf, text, seed=7, scale=0.02)
    model, config = load_model(hf, lazy=True)
    model, config = quantize_model(model, config, group_size=32, bits=4)
    save_model(tmp_path / "q4", model)
    save_config(config, tmp_path / "q4" / "config.json")
    del model

    taps = (1, 3, 5)   # 5 = the last layer: transformers' and mlx-lm's final-normed output
    encoder = text_encoder_spec(tmp_path / "q4", taps).build()
    assert isinstance(encoder.embed_tokens, nn.QuantizedEmbedding)
    assert isinstance(encoder.layers[0].mlp.down_proj, nn.QuantizedLinear)
    assert isinstance(encoder.layers[4].self_attn.q_proj, nn.QuantizedLinear)
    rng = np.random.default_rng(1)

    # the same quantized folder through mlx-lm's own loader and forward (no padding: mlx-lm has no padding mask)
    mlx_lm_model, _ = load_model(tmp_path / "q4")
    inner = mlx_lm_model.language_model.model if family == "mistral3" else mlx_lm_model.model
    ids = rng.integers(0, 200, (2, 10))
    last = np.array(encoder(ids))[..., -text["hidden_size"]:]
    assert max_rel_err(last, np.array(inner(mx.array(ids)))) <= 1e-5

    ids = rng.integers(0, 200, (1, 11))
    mask = np.ones((1, 11), np.int64)
    mask[0, :3] = 0
    ours = np.array(encoder(ids, mask))
    with torch.no_grad():
        out = torch_model(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask), output_hidden_states=True)
    ref = torch.cat([out.hidden_states[k] for k in taps], dim=-1).numpy()
    rms_err = float(np.linalg.norm(ours - ref) / np.linalg.norm(ref))
    print(f"{family} 4-bit g32 vs float: relative RMS error {rms_err:.3f}, max_rel_err {max_rel_err(ours, ref):.3f}")
    # Bound: 4-bit affine in groups of 32 leaves about 8% RMS error on each Gaussian weight matrix (step = range/15,
    # the range of 32 samples about 4 sigma, error RMS = step/sqrt(12)); through the quantized embedding and five
    # layers that compounds to the 18-20% measured here. An unrelated output would be about 1.4.
    assert rms_err < 0.25


def test_wrong_architecture_and_bad_taps(tmp_path, qwen3_case):
    clip = tmp_path / "clip"
    clip.mkdir()
    (clip / "config.json").write_text(json.dumps({"architectures": ["CLIPTextModelWithProjection"],
                                                  "model_type": "clip_text_model", "hidden_size": 32}))
    with pytest.raises(MlxdiffError, match="clip_text_model.*not a FLUX.2 text encoder"):
        text_encoder_spec(clip, (10, 20, 30)).build()

    _, folder, _, _ = qwen3_case
    with pytest.raises(MlxdiffError, match="need 9 decoder layers"):
        text_encoder_spec(folder, (1, 9)).build()

    bnb = tmp_path / "bnb"
    shutil.copytree(folder, bnb)
    config = json.loads((bnb / "config.json").read_text())
    (bnb / "config.json").write_text(json.dumps({**config, "quantization_config": {"quant_method": "bitsandbytes"}}))
    with pytest.raises(MlxdiffError, match="bitsandbytes"):
        text_encoder_spec(bnb, (1, 2)).build()


def test_chat_template_missing_or_in_processor_file(tmp_path, mistral_tokenizer):
    bare = tmp_path / "bare"
    build_tokenizer(bare, ["<s>", "</s>", "<pad>"], None, "left", "<pad>", "<s>", "</s>")
    with pytest.raises(MlxdiffError, match="no chat template"):
        tokenizers.load_chat_tokenizer(bare)
    tokenizer = transformers.AutoTokenizer.from_pretrained(bare)
    with pytest.raises(MlxdiffError, match="no chat template"):
        tokenizers.tokenize_dev(tokenizer, ["a fox"], 16)

    # a processor folder may keep the template only in the processor's legacy chat_template.json
    (bare / "chat_template.json").write_text(json.dumps({"chat_template": MISTRAL_TEMPLATE}))
    assert tokenizers.load_chat_tokenizer(bare).chat_template == MISTRAL_TEMPLATE
