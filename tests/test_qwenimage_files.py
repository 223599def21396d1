"""Qwen-Image from ComfyUI's files, against diffusers' QwenImagePipeline on the equivalent folder (the same weights):
models/diffusion_models/qwen_image_bf16.safetensors (diffusers' names under `model.diffusion_model.`), found beside
it models/text_encoders/qwen_2.5_vl_7b.safetensors (Qwen2.5-VL in transformers' names, its vision tower included)
and models/vae/qwen_image_vae.safetensors (Wan's names); the same files given alone, a Q8_0 GGUF transformer (kept quantized), ComfyUI's fp8 transformer and
fp8_scaled encoder; the
missing parts and wrong files in one line each."""

import copy
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

import mlxdiff
import parity
from gguf_helpers import dequantized, write_q8_0_gguf
from helpers import max_rel_err, randomize_
from mlxdiff.errors import MlxdiffError
from qwenimage_helpers import check_parity, to_original
from twins import build_tokenizer
import fixture_guard

H, W = 32, 48      # latents 8 x 12 (VAE factor 4), 4 x 6 tokens
Z = 16             # Qwen-Image's latent channels: its VAE's latent statistics are the file reader's
SEQ, STEPS = 96, 3
PROMPT, NEGATIVE = "a red fox sitting in the snow at dawn", "blurry, dark"
# heads of 128, as every Qwen2.5-VL has (the file reader's heads come from the rows over 128)
TEXT = dict(hidden_size=256, intermediate_size=96, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
            vocab_size=321, max_position_embeddings=256, rms_norm_eps=1e-6,
            rope_parameters=dict(rope_type="default", rope_theta=1e6, mrope_section=[16, 24, 24]))
VISION = dict(depth=1, hidden_size=16, intermediate_size=24, num_heads=2, out_hidden_size=256, patch_size=4,
              spatial_merge_size=2, temporal_patch_size=2, window_size=8, fullatt_block_indexes=[0])
# head 32 split as rope_axes splits it (the shapes do not say the axes)
TRANSFORMER = dict(patch_size=2, in_channels=4 * Z, out_channels=Z, num_layers=2, attention_head_dim=32,
                   num_attention_heads=3, joint_attention_dim=TEXT["hidden_size"], axes_dims_rope=(4, 14, 14))
VAE = dict(base_dim=6, z_dim=Z, dim_mult=[1, 2, 2], num_res_blocks=2, attn_scales=[],
           temperal_downsample=[False, True])


@pytest.fixture(autouse=True)
def _shared_fixtures_unchanged(request):
    """The module's shared fixtures are left as built (fixture_guard)."""
    yield from fixture_guard.unchanged(request, ['files', 'references'])


def one_line(error, *parts):
    message = str(error.value)
    assert "\n" not in message, message
    for part in parts:
        assert str(part) in message, message
    return message


def write_q8_gguf(path, tensors):
    """A city96-style GGUF of the transformer: diffusers' names, Q8_0 for the blocks' 2-D weights (their input widths
    whole 32-wide blocks), the rest F32."""
    return write_q8_0_gguf(path, tensors, "qwen_image", lambda name: name.startswith("transformer_blocks."))


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    import transformers
    from diffusers import (AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImagePipeline,
                           QwenImageTransformer2DModel)
    from transformers import AutoTokenizer
    from mlxdiff.pipelines.qwenimage.files import SCHEDULER
    root = tmp_path_factory.mktemp("qwenimage_files")
    config = transformers.Qwen2_5_VLConfig(text_config=TEXT, vision_config=VISION, tie_word_embeddings=False)
    encoder = randomize_(transformers.Qwen2_5_VLForConditionalGeneration(config).eval(), 5, 0.2)
    tok_dir = build_tokenizer(root / "tok_src", ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], None, "right",
                              "<|endoftext|>", eos="<|im_end|>")
    torch.manual_seed(0)
    transformer = randomize_(QwenImageTransformer2DModel(**TRANSFORMER), seed=10, scale=0.15).eval()
    vae = randomize_(AutoencoderKLQwenImage(**VAE), seed=11, scale=0.15)
    with torch.no_grad():      # RMS gammas around 1
        for name, p in vae.named_parameters():
            if name.endswith("gamma"):
                p.add_(1.0)
    pipe = QwenImagePipeline(scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULER), vae=vae.eval(),
                             text_encoder=encoder.float().eval(), tokenizer=AutoTokenizer.from_pretrained(str(tok_dir)),
                             transformer=transformer)
    folder = root / "pipeline"
    pipe.save_pretrained(str(folder))
    models = root / "models"
    for d in ("diffusion_models", "text_encoders", "vae", "unet"):
        (models / d).mkdir(parents=True)
    paths = dict(transformer=models / "diffusion_models" / "qwen_image_bf16.safetensors",
                 encoder=models / "text_encoders" / "qwen_2.5_vl_7b.safetensors",
                 vae=models / "vae" / "qwen_image_vae.safetensors", gguf=models / "unet" / "qwen-image-F32.gguf",
                 tokenizer=folder / "tokenizer", folder=folder)
    sd = lambda m: {k: v.detach().clone().contiguous() for k, v in m.state_dict().items()}   # noqa: E731
    save_file({"model.diffusion_model." + k: v for k, v in sd(transformer).items()}, str(paths["transformer"]))
    shutil.copy(folder / "text_encoder" / "model.safetensors", paths["encoder"])     # model.layers.*, visual.*
    save_file({to_original(k, VAE["num_res_blocks"]): v for k, v in sd(vae).items()}, str(paths["vae"]))
    quantized = write_q8_gguf(paths["gguf"], sd(transformer))
    # the GGUF's reference: the same pipeline with the file's values as gguf-py decodes them
    twin = copy.deepcopy(transformer)
    twin.load_state_dict({k: torch.from_numpy(v.copy()) for k, v in dequantized(paths["gguf"]).items()})
    folder_pipe = QwenImagePipeline.from_pretrained(str(folder))
    gguf_pipe = QwenImagePipeline(**{**folder_pipe.components, "transformer": twin.eval()})
    return paths, folder_pipe, gguf_pipe, quantized


def noise():
    return np.random.default_rng(2).standard_normal((1, (H // 8) * (W // 8), 4 * Z)).astype(np.float32)


def reference(pipe, prompt=PROMPT, negative_prompt=NEGATIVE):
    """diffusers' (latents, unpacked to the VAE's layout, from the step callback; image) at true CFG (4.0)."""
    final = {}

    def keep(_, i, t, tensors):
        final["latents"] = tensors["latents"]
        return {}
    with torch.no_grad():
        ref = pipe(prompt=prompt, negative_prompt=negative_prompt, height=H, width=W, num_inference_steps=STEPS,
                   max_sequence_length=SEQ, latents=torch.from_numpy(noise()), output_type="np",
                   callback_on_step_end=keep).images[0]
    return pipe._unpack_latents(final["latents"], H, W, pipe.vae_scale_factor)[:, :, 0].numpy(), ref


@pytest.fixture(scope="module")
def references(files):
    """(diffusers on the folder's weights, on the GGUF's decoded values): (latents, image) each; the prompt and the
    negative prompt each move the first (parity.assert_inputs_matter)."""
    _, pipe, gguf_pipe, _ = files
    plain = parity.assert_inputs_matter(lambda **kw: reference(pipe, **kw), {},
                                        {"the prompt": dict(prompt="a blue car parked in the desert at noon"),
                                         "the negative prompt": dict(negative_prompt="sharp, vivid colours")})
    return plain, reference(gguf_pipe)


def compare(loaded, ref, what):
    """mlxdiff's run of `loaded` against diffusers' (latents, image) `ref`: the Result."""
    assert loaded.family == "qwenimage" and loaded.pipeline_class == "QwenImagePipeline"
    got = loaded.generate(PROMPT, negative_prompt=NEGATIVE, width=W, height=H, steps=STEPS, latents=noise(),
                          max_sequence_length=SEQ, progress_bar=False)
    check_parity(got, *ref, f"Qwen-Image {what}")
    assert np.asarray(got.image).std() > 5      # a real picture, not a flat one
    return got


def test_files_match_diffusers(files, references):
    """ComfyUI's folders (the encoder and VAE found beside the transformer) and the same files given alone: read the
    same way, so mlxdiff's two results are equal bit for bit."""
    paths = files[0]
    results = []
    for layout in ("comfyui_folders", "files_alone"):
        if layout == "comfyui_folders":
            loaded = mlxdiff.load(str(paths["transformer"]), tokenizer=str(paths["tokenizer"]), dtype="float32")
            assert loaded.components["text_encoder"].files == [paths["encoder"]]
            assert loaded.components["vae"].files == [paths["vae"]]
        else:
            loaded = mlxdiff.load(transformer=str(paths["transformer"]), text_encoder=str(paths["encoder"]),
                                  vae=str(paths["vae"]), tokenizer=str(paths["tokenizer"]), dtype="float32")
        assert loaded.components["text_encoder"].args.taps == (TEXT["num_hidden_layers"],)     # hidden_states[-1]
        assert loaded.components["transformer"].args.axes_dims_rope == TRANSFORMER["axes_dims_rope"]
        results.append(compare(loaded, references[0], layout))
    a, b = results
    assert np.array_equal(np.asarray(a.latents), np.asarray(b.latents))
    assert np.array_equal(np.asarray(a.image), np.asarray(b.image))


def test_q8_gguf_matches_diffusers_on_its_values(files, references):
    """The Q8_0 GGUF transformer kept quantized, against diffusers with the file's decoded values."""
    import mlx.core as mx
    import mlx.nn as nn
    from mlxdiff.formats.gguf import RawLinear
    paths, _, _, quantized = files
    loaded = mlxdiff.load(transformer=str(paths["gguf"]), text_encoder=str(paths["encoder"]), vae=str(paths["vae"]),
                          tokenizer=str(paths["tokenizer"]), dtype="float32")
    assert loaded.components["transformer"].args.axes_dims_rope == TRANSFORMER["axes_dims_rope"]
    model = loaded.components["transformer"].build()
    assert sum(isinstance(m, (nn.QuantizedLinear, RawLinear)) for _, m in model.named_modules()) == len(quantized)
    (plain_latents, _), gguf_ref = references
    err = max_rel_err(compare(loaded, gguf_ref, "q8_gguf").latents, gguf_ref[0])
    # the file's values are what agree: the unquantized pipeline's latents are further off
    moved = max_rel_err(plain_latents, gguf_ref[0])
    assert moved > 10 * max(err, 1e-6), (moved, err)


def test_missing_parts_and_wrong_files_are_one_line(files, tmp_path):
    paths = files[0]
    alone = tmp_path / "qwen_image_bf16.safetensors"
    shutil.copy(paths["transformer"], alone)
    with pytest.raises(MlxdiffError) as e:
        mlxdiff.load(str(alone))
    one_line(e, alone, "a Qwen-Image transformer; no Qwen2.5-VL text encoder", "no VAE (qwen_image_vae")
    with pytest.raises(MlxdiffError) as e:     # the transformer as the encoder
        mlxdiff.load(str(alone), text_encoder=str(paths["transformer"]), vae=str(paths["vae"]))
    one_line(e, paths["transformer"], "not Qwen-Image's Qwen2.5-VL text encoder")
    with pytest.raises(MlxdiffError) as e:     # a diffusers-named VAE
        mlxdiff.load(str(alone), text_encoder=str(paths["encoder"]),
                     vae=str(paths["folder"] / "vae" / "diffusion_pytorch_model.safetensors"))
    one_line(e, "not Qwen-Image's VAE in Wan's names")
    with pytest.raises(MlxdiffError) as e:     # the folder has its own parts
        mlxdiff.load(str(paths["folder"]), vae=str(paths["vae"]))
    one_line(e, "vae=: ", "is a Qwen-Image folder")


def test_fp8_files_match_diffusers_with_the_decoded_weights(files, tmp_path):
    """ComfyUI's qwen_image_fp8_e4m3fn.safetensors (the blocks' linear weights cast to fp8, unscaled) and
    qwen_2.5_vl_7b_fp8_scaled.safetensors (the `scaled_fp8` marker, the decoder layers' linear weights fp8 with
    `scale_weight`): both kept at 8 bits by the fp8 reader, the result diffusers' with the decoded weights."""
    from safetensors.torch import load_file
    paths, pipe = files[:2]
    transformer, decoded_t = {}, {}
    for name, value in load_file(str(paths["transformer"])).items():
        if name.startswith("model.diffusion_model.transformer_blocks.") and value.ndim == 2:
            value = value.to(torch.float8_e4m3fn)
        transformer[name], decoded_t[name[len("model.diffusion_model."):]] = value, value.float()
    encoder, decoded_e = {"scaled_fp8": torch.empty(0, dtype=torch.float8_e4m3fn)}, {}
    for name, value in load_file(str(paths["encoder"])).items():
        if name.startswith("model.layers.") and value.ndim == 2:
            scale = value.abs().amax() / 448.0
            encoder[name] = (value / scale).to(torch.float8_e4m3fn)
            encoder[name[:-len(".weight")] + ".scale_weight"] = scale.reshape(()).float()
            decoded_e[name] = encoder[name].float() * scale
        else:
            encoder[name], decoded_e[name] = value, value
    t_path, e_path = tmp_path / "qwen_image_fp8_e4m3fn.safetensors", tmp_path / "qwen_2.5_vl_7b_fp8_scaled.safetensors"
    save_file(transformer, str(t_path))
    save_file(encoder, str(e_path))
    twin = copy.deepcopy(pipe.transformer)
    twin.load_state_dict(decoded_t)
    text = copy.deepcopy(pipe.text_encoder)
    # the saved names (model.layers.*, visual.*) as transformers 5 holds them in memory (model.language_model.*)
    in_memory = any(n.startswith("model.language_model.") for n in text.state_dict())
    renamed = {("model.language_model." + k[len("model."):] if k.startswith("model.") else "model." + k
                if k.startswith("visual.") else k) if in_memory else k: v for k, v in decoded_e.items()}
    missing, unexpected = text.load_state_dict(renamed, strict=False)
    assert not unexpected and not [k for k in missing if not k.startswith("lm_head")], (missing, unexpected)
    from diffusers import QwenImagePipeline
    twin_pipe = QwenImagePipeline(**{**pipe.components, "transformer": twin.eval(), "text_encoder": text.eval()})
    loaded = mlxdiff.load(str(t_path), text_encoder=str(e_path), vae=str(paths["vae"]),
                          tokenizer=str(paths["tokenizer"]), dtype="float32")
    import mlx.core as mx
    for component in ("transformer", "text_encoder"):                  # kept at 8 bits
        model = loaded.components[component].build()
        kinds = {type(m).__name__ for _, m in model.named_modules()}
        assert "Fp8Linear" in kinds, (component, kinds)
    compare(loaded, reference(twin_pipe), "fp8 transformer + fp8_scaled encoder")
