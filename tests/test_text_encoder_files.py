"""Text encoders given as one file (issue 14): FLUX.2's `text_encoder=FILE` / `--text-encoder FILE` and SD3.5's
`text_encoders={...}` with a pipeline folder.

The files are made as the tools make them: ComfyUI's flat safetensors (`model.embed_tokens.weight`,
`model.layers.N.*`, `model.norm.weight`, plus its `tekken_model` tokenizer tensor), pruned like its 30-layer Mistral,
transformers' own names (Qwen3ForCausalLM's state dict), and GGUFs written the way llama.cpp's convert_hf_to_gguf.py
writes them (gguf-py's GGUFWriter; llama-arch q/k rows permuted by its LlamaModel.permute, Qwen3's not; Q8_0 blocks
from gguf-py's quantizer). Each loads through mlxdiff.load on a tiny FLUX.2 folder (tests/twins.py) and its tapped
hidden states are compared with transformers'.
"""

import gc
import json
import shutil

import numpy as np
import pytest

from mlxdiff import backend  # noqa: F401  (before mlx)
import mlx.core as mx

import mlxdiff
from mlxdiff import tokenizers
from mlxdiff.errors import MlxdiffError
from mlxdiff.loading.quantize import materialize, parameter_nbytes
from gguf_helpers import language_model, write_llama_cpp_gguf, write_t5_encoder_gguf
from helpers import max_rel_err
from twins import H, SEQ, TAPS, W, build_pipeline

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")
from safetensors.torch import save_file  # noqa: E402

PROMPTS = ["a red fox in the snow", "a watercolor painting of a lighthouse by the sea at dawn"]
LENGTH = 40


def with_taps(folder, dest, drop_text_encoder=False):
    """A copy of a pipeline folder whose model_index.json names the twins' taps (the folder's own taps, which
    mlxdiff reads and diffusers ignores); optionally without its text_encoder/ folder."""
    shutil.copytree(folder, dest)
    index = json.loads((dest / "model_index.json").read_text())
    (dest / "model_index.json").write_text(json.dumps({**index, "text_encoder_out_layers": list(TAPS)}))
    if drop_text_encoder:
        shutil.rmtree(dest / "text_encoder")
    return dest


@pytest.fixture(scope="module")
def dev(tmp_path_factory):
    root = tmp_path_factory.mktemp("dev")
    _, folder, pipe = build_pipeline("dev", root)
    return with_taps(folder, root / "tapped"), pipe.text_encoder


@pytest.fixture(scope="module")
def klein(tmp_path_factory):
    root = tmp_path_factory.mktemp("klein")
    _, folder, pipe = build_pipeline("klein_base", root)
    return with_taps(folder, root / "tapped"), pipe.text_encoder


def comfy_file(model, path, layers=None, norm=True):
    """ComfyUI's flat layout: the decoder under `model.`, the tokenizer as a uint8 `tekken_model` tensor; `layers`:
    keep only the first ones (the pruned files)."""
    sd = {}
    for k, v in language_model(model).state_dict().items():
        if k.startswith("layers.") and layers is not None and int(k.split(".")[1]) >= layers:
            continue
        if k.startswith("norm.") and not norm:
            continue
        sd["model." + k] = v.detach().clone().contiguous()
    sd["tekken_model"] = torch.frombuffer(bytearray(b'{"config": "a tokenizer"}'), dtype=torch.uint8).clone()
    save_file(sd, str(path))
    return path


def reference(model, ids, mask, taps=TAPS):
    """transformers' hidden_states[k] for k in taps, concatenated per token (what diffusers feeds the DiT)."""
    with torch.no_grad():
        out = model(input_ids=torch.from_numpy(np.asarray(ids)).long(),
                    attention_mask=torch.from_numpy(np.asarray(mask)).long(), output_hidden_states=True)
    return torch.cat([out.hidden_states[k] for k in taps], dim=-1).numpy()


def tokens(folder, kind):
    tok = tokenizers.load_chat_tokenizer(folder / "tokenizer")
    if kind == "dev":
        return tokenizers.tokenize_dev(tok, PROMPTS, LENGTH)
    return tokenizers.tokenize_klein(tok, PROMPTS, LENGTH)


def encoder_of(folder, file):
    """The encoder mlxdiff.load builds from `file` on `folder` (public API; the spec the pipeline holds)."""
    pipe = mlxdiff.load(str(folder), text_encoder=str(file))
    model = pipe.components["text_encoder"].build()
    materialize(model)
    return model


# -- FLUX.2: the encoder from one file matches transformers ---------------------------------------------------------

@pytest.mark.parametrize("layout", ["comfy_full", "comfy_pruned", "gguf_f32"])
def test_dev_encoder_file_matches_transformers(dev, tmp_path, layout):
    folder, model = dev
    if layout == "gguf_f32":
        file = write_llama_cpp_gguf(model, tmp_path / "mistral.gguf", "llama")
    else:   # pruned: the deepest tapped layer kept, the final norm and the deeper layers dropped
        file = comfy_file(model, tmp_path / "mistral_3_small_flux2.safetensors",
                          layers=max(TAPS) if layout == "comfy_pruned" else None, norm=layout == "comfy_full")
    ids, mask = tokens(folder, "dev")
    encoder = encoder_of(folder, file)
    assert len(encoder.layers) == max(TAPS)
    err = max_rel_err(np.array(encoder(ids, mask)), reference(model, ids, mask))
    print(f"{layout}: max_rel_err {err:.2e}")
    assert err <= 1e-4


@pytest.mark.parametrize("layout", ["transformers", "gguf_f32"])
def test_klein_encoder_file_matches_transformers(klein, tmp_path, layout):
    folder, model = klein
    if layout == "gguf_f32":   # Qwen3 GGUFs are not permuted (Qwen2Model in the converter)
        file = write_llama_cpp_gguf(model, tmp_path / "qwen3.gguf", "qwen3")
    else:   # qwen_3_4b.safetensors: Qwen3ForCausalLM's own names, lm_head included
        file = tmp_path / "qwen_3_4b.safetensors"
        save_file({k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}, str(file))
    ids, mask = tokens(folder, "klein")
    err = max_rel_err(np.array(encoder_of(folder, file)(ids, mask)), reference(model, ids, mask))
    print(f"klein {layout}: max_rel_err {err:.2e}")
    assert err <= 1e-4


def test_permutation_is_load_bearing(dev, tmp_path):
    """The same GGUF read as if unpermuted differs: the undoing of llama.cpp's q/k order is what makes it match."""
    folder, model = dev
    file = write_llama_cpp_gguf(model, tmp_path / "mistral.gguf", "llama")
    ids, mask = tokens(folder, "dev")
    pipe = mlxdiff.load(str(folder), text_encoder=str(file))
    spec = pipe.components["text_encoder"]
    assert spec.keymap is not None
    spec.keymap = None
    assert max_rel_err(np.array(spec.build()(ids, mask)), reference(model, ids, mask)) > 1e-2


@pytest.fixture(scope="module")
def q8_mistral(tmp_path_factory):
    """A Q8_0 GGUF of a Mistral decoder whose widths Q8_0's 32-blocks divide, and the transformers model holding the
    same weights as the Q8_0 blocks do (the reference)."""
    config = transformers.MistralConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=6,
                                        num_attention_heads=4, num_key_value_heads=2, head_dim=64, vocab_size=4000,
                                        max_position_embeddings=128, rope_theta=1e6, sliding_window=None,
                                        rms_norm_eps=1e-5, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.MistralForCausalLM(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.2 + (1.0 if p.ndim == 1 else 0.0))
    file = write_llama_cpp_gguf(model, tmp_path_factory.mktemp("q8") / "mistral-Q8_0.gguf", "llama",
                                gguf.GGMLQuantizationType.Q8_0)
    with torch.no_grad():   # the reference: the same weights as Q8_0 holds them
        for p in model.parameters():
            if p.ndim == 2:
                q = gguf.quants.quantize(p.numpy(), gguf.GGMLQuantizationType.Q8_0)
                p.copy_(torch.from_numpy(gguf.quants.dequantize(q, gguf.GGMLQuantizationType.Q8_0)))
    return file, model


@pytest.mark.parametrize("layout", ["raw", "affine"])
def test_q8_gguf_stays_quantized_and_matches(dev, q8_mistral, layout):
    """A Q8_0 GGUF of a Mistral decoder stays quantized (token_embd included): as the file's blocks (the CPU default;
    at most 1.1x its tensors' bytes) or in MLX's affine form, and matches transformers run on the same dequantized
    weights."""
    folder, _ = dev
    file, model = q8_mistral
    ids, mask = tokens(folder, "dev")
    pipe = mlxdiff.load(str(folder), text_encoder=str(file))
    spec = pipe.components["text_encoder"]
    spec.gguf_layout = layout
    gc.collect()
    mx.clear_cache()
    before = mx.get_active_memory()
    encoder = spec.build()
    materialize(encoder)
    gc.collect()
    mx.clear_cache()
    active = mx.get_active_memory() - before   # what loading left resident (the un-permuted copies are gone)
    raw = layout == "raw"
    assert type(encoder.embed_tokens).__name__ == ("RawEmbedding" if raw else "QuantizedEmbedding")
    assert all(type(layer.self_attn.q_proj).__name__ == ("RawLinear" if raw else "QuantizedLinear")
               for layer in encoder.layers)
    err = max_rel_err(np.array(encoder(ids, mask)), reference(model, ids, mask))
    print(f"Q8_0 {layout}: max_rel_err {err:.2e}")
    assert err <= 1e-4
    if not raw:
        return
    from mlxdiff.formats import tensor_nbytes
    from mlxdiff.models import text_llm
    args = text_llm.ModelArgs.from_dict(spec.config)
    read = sum(n for name, n in tensor_nbytes(file).items() if text_llm.reads_stored(name, args))
    resident = parameter_nbytes(encoder)
    print(f"Q8_0: parameters {resident} bytes, MLX active memory +{active} bytes, for {read} bytes of tensors read")
    assert resident <= 1.1 * read and active <= 1.1 * read


def test_file_image_equals_folder_image(klein, tmp_path):
    folder, model = klein
    file = tmp_path / "qwen_3_4b.safetensors"
    save_file({k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}, str(file))
    noise = np.random.default_rng(2).standard_normal((1, 20, H // 4, W // 4)).astype(np.float32)
    kw = dict(width=W, height=H, steps=2, guidance=3.5, latents=noise, max_sequence_length=SEQ, progress_bar=False)
    a = np.asarray(mlxdiff.load(str(folder)).generate("a red fox", **kw).image).astype(int)
    b = np.asarray(mlxdiff.load(str(folder), text_encoder=str(file)).generate("a red fox", **kw).image).astype(int)
    assert np.abs(a - b).max() <= 2


def released_shapes(hidden, vocab, layers, q_out, kv_out, inter, qk_norm=None, names="comfy"):
    """The header of a released encoder file (shapes only): ComfyUI's names or llama.cpp's."""
    from mlxdiff.formats import TensorShape
    if names == "comfy":
        shapes = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,),
                  "tekken_model": (1000,)}
        for i in range(layers):
            o = f"model.layers.{i}."
            shapes.update({o + "self_attn.q_proj.weight": (q_out, hidden),
                           o + "self_attn.k_proj.weight": (kv_out, hidden),
                           o + "self_attn.v_proj.weight": (kv_out, hidden),
                           o + "mlp.gate_proj.weight": (inter, hidden)})
            if qk_norm:
                shapes[o + "self_attn.q_norm.weight"] = (qk_norm,)
    else:
        shapes = {"token_embd.weight": (vocab, hidden), "output_norm.weight": (hidden,)}
        for i in range(layers):
            shapes.update({f"blk.{i}.attn_q.weight": (q_out, hidden), f"blk.{i}.attn_k.weight": (kv_out, hidden),
                           f"blk.{i}.ffn_gate.weight": (inter, hidden)})
    return {k: TensorShape(v) for k, v in shapes.items()}


@pytest.mark.parametrize("case", ["mistral_full", "mistral_pruned", "mistral_gguf", "qwen3_4b", "qwen3_8b"])
def test_released_encoders_configs(case):
    """The configs read off the released files' shapes are the published ones (Mistral-Small-3.2-24B's text_config,
    Qwen3-4B / 8B's config.json); the pruned Mistral keeps the full model's depth, so its tap 30 stays the raw output
    of layer 30, not the final-normed one."""
    from mlxdiff.models import text_llm
    if case.startswith("mistral"):
        layers = 30 if case == "mistral_pruned" else 40
        meta = {"general.architecture": "llama", "llama.attention.head_count": 32, "llama.rope.freq_base": 1e9,
                "llama.attention.layer_norm_rms_epsilon": 1e-5} if case == "mistral_gguf" else None
        shapes = released_shapes(5120, 131072, layers, 4096, 1024, 32768,
                                 names="gguf" if case == "mistral_gguf" else "comfy")
        config = text_llm.config_from_file(shapes, meta, expected="Mistral3ForConditionalGeneration")
        text = config["text_config"]
        assert (text["num_attention_heads"], text["num_key_value_heads"], text["head_dim"]) == (32, 8, 128)
        assert (text["rope_theta"], text["rms_norm_eps"], text["sliding_window"]) == (1e9, 1e-5, None)
        assert text["num_hidden_layers"] == 40 and config["file_layers"] == layers
        args = text_llm.ModelArgs.from_dict({**config, "taps": [10, 20, 30]})
        text_llm.check_args(args, "file")
        assert not args.tapped_final_norm
        assert text_llm.gguf_is_permuted(meta or {}, config)
    else:
        hidden, inter = (2560, 9728) if case == "qwen3_4b" else (4096, 12288)
        config = text_llm.config_from_file(released_shapes(hidden, 151936, 36, 4096, 1024, inter, qk_norm=128))
        assert config["model_type"] == "qwen3" and config["architectures"] == ["Qwen3ForCausalLM"]
        assert (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]) == (32, 8, 128)
        assert (config["rope_theta"], config["rms_norm_eps"], config["num_hidden_layers"]) == (1e6, 1e-6, 36)
        text_llm.check_args(text_llm.ModelArgs.from_dict({**config, "taps": [9, 18, 27]}), "file")
        assert not text_llm.gguf_is_permuted({"general.architecture": "qwen3"}, config)


# -- FLUX.2: every bad file is one line naming it -----------------------------------------------------------------

def one_line_naming(error, file):
    message = str(error.value)
    assert "\n" not in message and str(file) in message, message
    return message


def test_pruned_below_the_taps(dev, tmp_path):
    folder, model = dev
    file = comfy_file(model, tmp_path / "pruned.safetensors", layers=max(TAPS) - 1, norm=False)
    with pytest.raises(MlxdiffError) as e:
        mlxdiff.load(str(folder), text_encoder=str(file))
    assert "pruned" in one_line_naming(e, file)


def test_unknown_naming(dev, tmp_path):
    folder, _ = dev
    file = tmp_path / "other.safetensors"
    save_file({"encoder.block.0.weight": torch.zeros(4, 4)}, str(file))
    with pytest.raises(MlxdiffError) as e:
        mlxdiff.load(str(folder), text_encoder=str(file))
    assert "naming" in one_line_naming(e, file)


def test_shapes_of_no_known_model_without_folder_config(dev, tmp_path):
    folder, model = dev
    bare = with_taps(folder, tmp_path / "bare", drop_text_encoder=True)
    file = comfy_file(model, tmp_path / "mistral.safetensors")
    with pytest.raises(MlxdiffError) as e:
        mlxdiff.load(str(bare), text_encoder=str(file))
    assert "fit no known model" in one_line_naming(e, file)


def test_wrong_family_and_missing_tokenizer(dev, klein, tmp_path):
    folder, _ = dev
    _, qwen = klein
    file = tmp_path / "qwen3.safetensors"
    save_file({k: v.detach().clone().contiguous() for k, v in qwen.state_dict().items()}, str(file))
    with pytest.raises(MlxdiffError) as e:
        mlxdiff.load(str(folder), text_encoder=str(file))
    assert "Qwen3ForCausalLM" in one_line_naming(e, file)
    no_tok = tmp_path / "no_tok"
    shutil.copytree(klein[0], no_tok)
    shutil.rmtree(no_tok / "tokenizer")
    with pytest.raises(MlxdiffError) as e:
        mlxdiff.load(str(no_tok), text_encoder=str(file))
    assert "tokenizer" in one_line_naming(e, no_tok / "tokenizer")


def test_family_arguments(dev, sd3_tiny, tmp_path):
    folder, model = dev
    file = comfy_file(model, tmp_path / "m.safetensors")
    with pytest.raises(MlxdiffError, match="text_encoder=FILE"):
        mlxdiff.load(str(folder), text_encoders={"t5xxl": str(file)})
    with pytest.raises(MlxdiffError, match="SD3.5 model"):
        mlxdiff.load(str(sd3_tiny[0]), text_encoder=str(file))
    with pytest.raises(MlxdiffError, match="t6"):
        mlxdiff.load(str(sd3_tiny[0]), text_encoders={"t6": str(file)})


# -- SD3.5: text_encoders= with a folder ----------------------------------------------------------------------------

def test_sd3_folder_takes_encoder_files(sd3_tiny, tmp_path):
    """A file replaces the folder's component; with the folder encoder's shapes it takes the folder's other values
    (the tiny T5's max distance 24, CLIP-L's quick_gelu and 4 heads), so it encodes as the folder's encoder does:
    safetensors in transformers' names, and a T5 encoder GGUF in llama.cpp's."""
    folder, pipe = sd3_tiny
    files = {}
    for short, torch_model in (("t5xxl", pipe.text_encoder_3), ("clip_l", pipe.text_encoder)):
        files[short] = tmp_path / f"{short}.safetensors"
        save_file({k: v.detach().clone().contiguous() for k, v in torch_model.state_dict().items()},
                  str(files[short]))
    t5_gguf, _ = write_t5_encoder_gguf(pipe.text_encoder_3, tmp_path / "t5-v1_1-xxl-encoder-F32.gguf")
    theirs = mlxdiff.load(str(folder))
    ours = mlxdiff.load(str(folder), text_encoders={k: str(v) for k, v in files.items()})
    from_gguf = mlxdiff.load(str(folder), text_encoders={"t5xxl": str(t5_gguf)})
    ids = np.random.default_rng(0).integers(0, 1000, size=(1, 16))
    for component, short, pipeline, file in (("text_encoder_3", "t5xxl", ours, files["t5xxl"]),
                                             ("text_encoder", "clip_l", ours, files["clip_l"]),
                                             ("text_encoder_3", "t5xxl", from_gguf, t5_gguf)):
        assert pipeline.components[component].files == [file]
        a, b = (p.components[component].build()(ids) for p in (theirs, pipeline))
        pairs = [(a, b)] if isinstance(a, mx.array) else [(a.last_hidden_state, b.last_hidden_state),
                                                           (a.text_embeds, b.text_embeds)]
        for x, y in pairs:
            assert max_rel_err(np.array(y), np.array(x)) <= 1e-6
    assert ours.components["text_encoder_2"].files == theirs.components["text_encoder_2"].files


# -- the command line -----------------------------------------------------------------------------------------------

def test_cli_text_encoder_option(klein, tmp_path):
    from mlxdiff.cli import parse_text_encoders
    from mlxdiff.generate import main
    assert parse_text_encoders(["t5xxl=a.safetensors", "clip_l=b"]) == (None, {"t5xxl": "a.safetensors",
                                                                               "clip_l": "b"})
    assert parse_text_encoders(["dir/x=1.gguf"]) == ("dir/x=1.gguf", None)
    for bad in (["t6=a"], ["a", "b"], ["a", "t5xxl=b"], ["t5xxl=a", "t5xxl=b"]):
        with pytest.raises(MlxdiffError):
            parse_text_encoders(bad)
    folder, model = klein
    file = tmp_path / "qwen_3_4b.safetensors"
    save_file({k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}, str(file))
    out = tmp_path / "out.png"
    assert main(["--model", str(folder), "--text-encoder", str(file), "--prompt", "a fox", "--steps", "1",
                 "--width", str(W), "--height", str(H), "--no-progress", "--output", str(out)]) == 0
    from PIL import Image
    assert Image.open(out).text["mlxdiff:text_encoder"] == str(file)
