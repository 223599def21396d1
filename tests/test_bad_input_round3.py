"""Bad input, third round (issue 45): the features of the last round refuse in one line (exit 2 through the CLI,
nothing partial, no image), and a streamed run never draws from a changed file. One section per kind:

1. --clip-skip beyond the encoders' layers (SD 1.x, SDXL): refused from the configs, before anything loads;
2. scheduler configs whose numbers give no schedule (beta_start >= beta_end, betas outside (0, 1), NaN / inf, no
   training steps): refused where the config is read (the folder's checked config) and by the samplers themselves;
3. palettized checkpoints whose tables do not fit their indices (shorter, longer, not 2**n, not float), or whose
   indices are not packed bytes: refused where the checkpoint's layers are made, naming the tensor;
4. a --vae of another latent channel count or another image channel count: refused when the file is read;
5. a streamed run checks before each block read that the file is the one it planned from: truncated, replaced by a
   rename, rewritten in place (even with its modification time put back): one line, no image;
6. convert of a single file (SD 1.x, SDXL, sd.cpp GGUF) writes the pipeline's own class, and the folder draws the
   file's image;
7. img2img's size on the command line is the API's: the init image's own, rounded down to the VAE's factor;
8. a Core ML package's files (model.mlmodel, weight.bin, Manifest.json and its entries) resolving outside it
   (symbolic links, ..) are refused; links inside it are read;
9. quantize= on a checkpoint stored quantized at another setting is refused in one line, saying why (the same
   setting is accepted);
10. SGM single files whose first level (no attention) is 32 wide are read (only attention needs 64-wide heads),
    and the UNet matches diffusers';
11. Apple's chunked Core ML UNets (one chunk, or the folder of both) that are not one model's halves say so;
12. forged GGUF text-encoder hyperparameters (arrays, other types) refused naming the key.
Plus the seeded share of the palettized-checkpoint fuzzer (bench/fuzz_palettized.py).

The CLI cases run mlxdiff.generate's main in this process (test_command_line)."""

import json
import os
import shutil
import sys
from pathlib import Path

import numpy as np
import PIL.Image
import pytest
import torch

import mlxdiff
import mlx.core as mx

sys.path.insert(0, os.path.dirname(__file__))
from helpers import max_rel_err, randomize_  # noqa: E402
from ldm_helpers import clip_to_openclip, unet_to_ldm, vae_to_ldm, write_sdcpp_gguf  # noqa: E402

from mlxdiff import default_model, ldm_schedulers, schedulers  # noqa: E402
from mlxdiff.errors import MlxdiffError  # noqa: E402
from mlxdiff.formats import coreml, palettized as P  # noqa: E402
from mlxdiff.loading import streaming  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
import fuzz_gguf_text  # noqa: E402  (the GGUF text-encoder writer and base files)
import fuzz_palettized  # noqa: E402  (the palettized-checkpoint fuzzer's seeded share)

MODEL = default_model.FOLDER
KW = dict(steps=1, width=32, height=32, progress_bar=False, seed=3)

# the tiny SD 1.x / SDXL single files: CLIP with 77 positions and the real vocabulary (the bundled tokenizers),
# a 4-level VAE (factor 8, as SD's); SDXL's first level has no attention and is 32 wide (section 10)
L77 = dict(vocab_size=49408, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=1,
           max_position_embeddings=77, hidden_act="quick_gelu", eos_token_id=2, bos_token_id=0, pad_token_id=1)
G77 = dict(vocab_size=49408, hidden_size=128, intermediate_size=256, num_hidden_layers=3, num_attention_heads=2,
           max_position_embeddings=77, hidden_act="gelu", projection_dim=96, eos_token_id=2, bos_token_id=0,
           pad_token_id=1)
BIG_G_PREFIX = "conditioner.embedders.1.model."
VAE = dict(block_out_channels=(32, 32, 32, 32), layers_per_block=1, latent_channels=4, norm_num_groups=32,
           down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4)
SD = {
    "sd15": dict(unet=dict(sample_size=8, in_channels=4, out_channels=4, block_out_channels=(32, 64),
                           layers_per_block=1, down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
                           up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), cross_attention_dim=64,
                           attention_head_dim=8, norm_num_groups=32),
                 vae=VAE, clip_prefix="cond_stage_model.transformer.", big_g=False),
    "sdxl": dict(unet=dict(sample_size=8, in_channels=4, out_channels=4, block_out_channels=(32, 64),
                           layers_per_block=1, down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
                           up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"), cross_attention_dim=192,
                           attention_head_dim=(1, 1), use_linear_projection=True, addition_embed_type="text_time",
                           addition_time_embed_dim=256, projection_class_embeddings_input_dim=96 + 6 * 256,
                           norm_num_groups=32),
                 vae=VAE, clip_prefix="conditioner.embedders.0.transformer.", big_g=True),
}


def _numpy_state(model) -> dict:
    """A torch model's state dict as float32 numpy, in its checkpoints' names (transformers 5's CLIPTextModel leaves
    out the `text_model.` level every CLIP-L checkpoint has)."""
    state = {k: v.detach().float().numpy().copy() for k, v in model.state_dict().items()
             if not k.endswith("position_ids")}
    if type(model).__name__ == "CLIPTextModel":
        state = {k if k.startswith("text_model.") else "text_model." + k: v for k, v in state.items()}
    return state


def _checkpoint(models, spec) -> dict:
    """The ldm / SGM-named checkpoint {name: float32 numpy} of the torch models (ldm_helpers' inverse maps)."""
    cfg = spec["unet"]
    up_attention = [t == "CrossAttnUpBlock2D" for t in cfg["up_block_types"]]
    out = {"model.diffusion_model." + k: v for k, v in
           unet_to_ldm(_numpy_state(models["unet"]), cfg["layers_per_block"], up_attention).items()}
    out.update({"first_stage_model." + k: v for k, v in
                vae_to_ldm(_numpy_state(models["vae"]), len(spec["vae"]["block_out_channels"])).items()})
    out.update({spec["clip_prefix"] + k: v for k, v in _numpy_state(models["text_encoder"]).items()})
    if spec["big_g"]:
        out.update({BIG_G_PREFIX + k: v for k, v in
                    clip_to_openclip(_numpy_state(models["text_encoder_2"]), np.concatenate).items()})
    return {k: np.ascontiguousarray(v) for k, v in out.items()}


def _models(name):
    from diffusers import AutoencoderKL, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection
    spec = SD[name]
    torch.manual_seed(0)
    models = {"unet": randomize_(UNet2DConditionModel(**spec["unet"]).eval(), seed=1, scale=0.1),
              "vae": randomize_(AutoencoderKL(**spec["vae"]).eval(), seed=2, scale=0.1),
              "text_encoder": randomize_(CLIPTextModel(CLIPTextConfig(**L77)).eval(), seed=3, scale=0.1)}
    if spec["big_g"]:
        models["text_encoder_2"] = randomize_(CLIPTextModelWithProjection(CLIPTextConfig(**G77)).eval(), seed=4,
                                              scale=0.1)
    return models


@pytest.fixture(scope="module")
def sd(tmp_path_factory):
    """{"sd15" | "sdxl": (its .safetensors path, torch models), "gguf": an sd.cpp Q8_0 GGUF of sd15's checkpoint,
    "root": a folder for files made from them}."""
    from safetensors.numpy import save_file
    root = tmp_path_factory.mktemp("round3")
    out = {"root": root}
    for name in SD:
        models = _models(name)
        checkpoint = _checkpoint(models, SD[name])
        path = root / f"{name}.safetensors"
        save_file(checkpoint, str(path))
        out[name] = (path, models)
        if name == "sd15":
            from gguf import GGMLQuantizationType
            out["gguf"] = root / "sd15-q8_0.gguf"
            write_sdcpp_gguf(out["gguf"], checkpoint, GGMLQuantizationType.Q8_0)
    return out


def one_line(excinfo, *needles):
    message = str(excinfo.value)
    assert "\n" not in message, message
    for needle in needles:
        assert needle in message, (needle, message)
    return message


# -- 1. --clip-skip beyond the encoders' layers ------------------------------------------------------------------

def test_clip_skip_beyond_the_layers(sd):
    """SD takes hidden state -(clip_skip + 1) of its L + 1, SDXL -(clip_skip + 2): past L (SD) or L - 1 (SDXL, the
    shallower of its two encoders) there is no such layer (it was an IndexError mid-encode). Refused at generate's
    first step, from the encoders' configs: nothing is loaded (the residency is empty after the refusal)."""
    sd15 = mlxdiff.load(str(sd["sd15"][0]))
    sdxl = mlxdiff.load(str(sd["sdxl"][0]))
    layers = {"sd15": L77["num_hidden_layers"], "sdxl": min(L77["num_hidden_layers"], G77["num_hidden_layers"])}
    for pipe, name, most in ((sd15, "sd15", layers["sd15"]), (sdxl, "sdxl", layers["sdxl"] - 1)):
        for skip in (most + 1, 64):
            with pytest.raises(MlxdiffError) as e:
                pipe.generate("a fox", clip_skip=skip, **KW)
            one_line(e, f"clip_skip={skip}", f"at most {most}")
        with pytest.raises(MlxdiffError) as e:
            pipe.encode_prompt("a fox", clip_skip=most + 1)
        one_line(e, f"at most {most}")
        pipe.check_clip_skip(most)      # the deepest skip there is: taken


def test_sd3_clip_skip_beyond_the_layers(sd3_tiny):
    """SD3.5 reads hidden state -(clip_skip + 2) of each CLIP's L + 1 (diffusers' _get_clip_prompt_embeds): past
    L - 1 of the shallower encoder there is none. Refused from the configs, in generate and encode_prompt alike."""
    pipe = mlxdiff.load(str(sd3_tiny[0]))
    most = min(pipe.components[n].args.num_hidden_layers for n in ("text_encoder", "text_encoder_2")) - 1
    for call in (lambda s: pipe.generate("a fox", clip_skip=s, width=24, height=40, steps=1, progress_bar=False),
                 lambda s: pipe.encode_prompt("a fox", clip_skip=s)):
        with pytest.raises(MlxdiffError) as e:
            call(most + 1)
        one_line(e, f"clip_skip={most + 1}", f"at most {most}")
    pipe.check_clip_skip(most)


# -- 2. scheduler configs that give no schedule ----------------------------------------------------------------------

LDM_BAD = [
    ({"beta_start": 0.02, "beta_end": 0.0001}, "beta_start 0.02 is not below beta_end"),
    ({"beta_start": 0.012, "beta_end": 0.012}, "is not below beta_end"),
    ({"beta_start": -0.1}, "beta_start is -0.1"),
    ({"beta_end": 1.5}, "beta_end is 1.5"),
    ({"beta_end": float("nan")}, "beta_end is nan"),
    ({"beta_start": float("inf")}, "beta_start is inf"),
    ({"beta_end": "0.012"}, "beta_end is '0.012'"),
    ({"num_train_timesteps": 0}, "num_train_timesteps is 0"),
    ({"num_train_timesteps": 1}, "num_train_timesteps is 1"),
    ({"num_train_timesteps": 999.5}, "num_train_timesteps is 999.5"),
    ({"num_train_timesteps": True}, "num_train_timesteps is True"),
    ({"steps_offset": -1}, "steps_offset is -1"),
    ({"sigma_min": -1.0}, "sigma_min is -1.0"),
]
FLOW_BAD = [
    ({"num_train_timesteps": 0}, "num_train_timesteps is 0"),
    ({"num_train_timesteps": -5}, "num_train_timesteps is -5"),
    ({"num_train_timesteps": 2.5}, "num_train_timesteps is 2.5"),
    ({"shift": float("nan")}, "shift is nan"),
    ({"shift": float("inf")}, "shift is inf"),
    ({"shift": -3.0}, "shift must be positive"),
    ({"base_shift": "0.5"}, "base_shift is '0.5'"),
    ({"shift_terminal": 1.0}, "shift_terminal is 1.0"),
]


def test_scheduler_values_are_checked_by_the_samplers():
    """Every UNet-family sampler and the flow-match schedule refuse numbers that give no schedule, in one line
    naming the key (they were a ZeroDivisionError, an IndexError, or NaN sigmas drawing a black image)."""
    for config, needle in LDM_BAD:
        for name in ldm_schedulers.SCHEDULERS:
            with pytest.raises(MlxdiffError) as e:
                ldm_schedulers.make_sampler(name, {**config, "skip_prk_steps": True}, 4)
            one_line(e, "scheduler_config.json", needle)
    for config, needle in FLOW_BAD:
        with pytest.raises(MlxdiffError) as e:
            schedulers.sd3_sigmas(4, config)
        one_line(e, "scheduler_config.json", needle)
    # the released configs still give their schedules
    assert len(ldm_schedulers.make_sampler("pndm", {"beta_start": 0.00085, "beta_end": 0.012, "skip_prk_steps": True,
                                                    "beta_schedule": "scaled_linear", "steps_offset": 1}, 4).timesteps)
    assert np.isfinite(schedulers.sd3_sigmas(4, {"shift": 3.0, "shift_terminal": 0})[0]).all()


def bad_scheduler_folders(sd, tmp_path):
    """(a converted SD 1.5 folder with beta_start above beta_end, the embedded default with no training steps), and
    their scheduler_config.json files: refused as the folder is read (test_command_line)."""
    bad_sd = Path(shutil.copytree(converted(sd, "sd15"), tmp_path / "sd15-bad"))
    config = bad_sd / "scheduler" / "scheduler_config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "beta_start": 0.02, "beta_end": 0.001}))
    bad_flow = Path(shutil.copytree(MODEL, tmp_path / "flow-bad"))
    flow_config = bad_flow / "scheduler" / "scheduler_config.json"
    flow_config.write_text(json.dumps({**json.loads(flow_config.read_text()), "num_train_timesteps": 0}))
    return bad_sd, config, bad_flow, flow_config


def test_scheduler_config_refused_where_the_folder_is_read(sd, tmp_path):
    """The UNet family's folder: its checked config (LdmSchedulerArgs' rule) refuses a falling schedule when the
    folder is read, before anything is built; a flow-matching folder's (SchedulerArgs) one with no training steps."""
    bad_sd, config, bad_flow, flow_config = bad_scheduler_folders(sd, tmp_path)
    with pytest.raises(MlxdiffError) as e:
        mlxdiff.load(str(bad_sd))
    one_line(e, str(config), "beta_end is 0.001", "above beta_start")
    with pytest.raises(MlxdiffError) as e:
        mlxdiff.load(str(bad_flow))
    one_line(e, str(flow_config), "num_train_timesteps")


# -- 3. palettized checkpoints whose tables do not fit their indices ---------------------------------------------------

@pytest.fixture(scope="module")
def palettized_default(tmp_path_factory):
    """The embedded default converted with its transformer palettized at p6 (mlxdiff.convert), and its transformer's
    tensors."""
    from mlxdiff.convert import convert
    dest = convert(str(MODEL), tmp_path_factory.mktemp("pal") / "p6", quantize={"transformer": "p6"},
                   progress=lambda *_: None)
    return dest, dict(mx.load(str(dest / "transformer" / "model.safetensors")))


def _edited_file(palettized_default, tmp_path, edit):
    """The p6 transformer's file with `edit(tensors, layer)` applied to its first palettized layer's tensors."""
    _, tensors = palettized_default
    tensors = dict(tensors)
    layer = sorted(k for k in tensors if k.endswith(".lut"))[0][:-len(".lut")]
    edit(tensors, layer)
    path = tmp_path / f"edit-{len(list(tmp_path.iterdir()))}.safetensors"
    mx.save_safetensors(str(path), tensors, metadata={"format": "mlxdiff"})
    return path, layer


def _edited(palettized_default, tmp_path, edit):
    """A copy of the p6 checkpoint with `edit(tensors, layer)` applied to its first palettized layer's tensors."""
    dest, tensors = palettized_default
    copy = Path(shutil.copytree(dest, tmp_path / f"edit-{len(list(tmp_path.iterdir()))}"))
    tensors = dict(tensors)
    layer = sorted(k for k in tensors if k.endswith(".lut"))[0][:-len(".lut")]
    edit(tensors, layer)
    mx.save_safetensors(str(copy / "transformer" / "model.safetensors"), tensors, metadata={"format": "mlxdiff"})
    return copy, layer


PALETTE_EDITS = {
    "a 16-entry table for 6-bit indices": (lambda t, k: t.__setitem__(f"{k}.lut", t[f"{k}.lut"][:, :16]),
                                           ["16 entries (4-bit", "its indices are 6-bit"]),
    "a 2-entry table": (lambda t, k: t.__setitem__(f"{k}.lut", t[f"{k}.lut"][:, :2]), ["2 entries", "6-bit"]),
    "a 128-entry table": (lambda t, k: t.__setitem__(f"{k}.lut", mx.concatenate([t[f"{k}.lut"]] * 2, axis=1)),
                          ["shape (1, 128)", "nbits one of"]),
    "a 32-entry (5-bit) table": (lambda t, k: t.__setitem__(f"{k}.lut", t[f"{k}.lut"][:, :32]),
                                 ["shape (1, 32)", "nbits one of"]),
    "a 5-entry table": (lambda t, k: t.__setitem__(f"{k}.lut", t[f"{k}.lut"][:, :5]), ["shape (1, 5)"]),
    "a 1-D table": (lambda t, k: t.__setitem__(f"{k}.lut", t[f"{k}.lut"][0]), ["shape (64,)"]),
    "an integer table": (lambda t, k: t.__setitem__(f"{k}.lut", t[f"{k}.lut"].astype(mx.int32)), ["int32 table"]),
    "float indices": (lambda t, k: t.__setitem__(f"{k}.weight", t[f"{k}.weight"].astype(mx.float32)),
                      ["weight is float32", "uint8 packed indices"]),
    "rows cut short": (lambda t, k: t.__setitem__(f"{k}.weight", t[f"{k}.weight"][:, :-3]),
                       ["bytes a row", "fits no index width"]),
    "7 tables for 192 rows": (lambda t, k: t.__setitem__(f"{k}.lut", mx.concatenate([t[f"{k}.lut"]] * 7)),
                              ["7 tables", "do not divide the 192 rows"]),
    "no indices": (lambda t, k: t.pop(f"{k}.weight"), ["weight is missing"]),
    "a scale of another length": (lambda t, k: t.__setitem__(f"{k}.scale", mx.ones((5,))),
                                  ["scale is float32 of shape (5,)"]),
}


def test_palettized_tables_must_fit_their_indices(palettized_default, tmp_path):
    """Each kind refused in one line naming the tensor when the checkpoint's layers are made (it was a KeyError, or
    an all-wrong decode); the untouched checkpoint draws."""
    from mlxdiff.loading.spec import ComponentSpec
    from mlxdiff.models import flux2
    config = json.loads((palettized_default[0] / "transformer" / "config.json").read_text())
    for name, (edit, needles) in PALETTE_EDITS.items():
        path, layer = _edited_file(palettized_default, tmp_path, edit)
        with pytest.raises(MlxdiffError) as e:
            ComponentSpec("transformer", flux2, config, [path]).build()
        one_line(e, str(path), "palettized checkpoint", layer, *needles)
    ComponentSpec("transformer", flux2, config, [palettized_default[0] / "transformer" / "model.safetensors"]).build()


def test_core_ml_tables_too_short_for_their_indices():
    """A Core ML palette reaches formats/palettized through `palettized(indices, lut)`: indices past the table's
    end are refused in one line (the Core ML reader's own checks tie a table's length to its index type)."""
    indices = np.arange(16, dtype=np.uint8).reshape(4, 4)
    with pytest.raises(MlxdiffError) as e:
        P.palettized(indices, np.zeros((1, 4), np.float16))
    one_line(e, "indices outside 0..3", "2-bit table")
    assert P.palettized(indices, np.zeros((1, 16), np.float16)).nbits == 4


# -- 4. a --vae of other channels --------------------------------------------------------------------------------------

def _vae_file(path, ldm=True, **config):
    from diffusers import AutoencoderKL
    from safetensors.torch import save_file
    torch.manual_seed(5)
    vae = randomize_(AutoencoderKL(**{**VAE, **config}).eval(), seed=6, scale=0.1)
    state = {k: v.contiguous() for k, v in vae.state_dict().items()}
    if ldm:
        state = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in
                 vae_to_ldm({k: v.numpy() for k, v in state.items()}, len(VAE["block_out_channels"])).items()}
    save_file(state, str(path))
    return path


def test_vae_of_other_channels_is_refused_when_read(sd, tmp_path):
    """A VAE file decoding latents of another channel count than the UNet's, or images of other than 3 channels
    (ldm or diffusers names), or a checkpoint whose own VAE decodes 4-channel images: refused in one line when the
    file is read, before any phase runs (it was a crash inside Pillow after the whole denoise)."""
    from mlxdiff.pipelines.stable_diffusion.single_file import sd_single_file
    model = sd["sd15"][0]
    cases = {
        "8 latent channels": (_vae_file(tmp_path / "latent8.safetensors", latent_channels=8),
                              ["the UNet takes in_channels 4 but the VAE gives latent_channels 8"]),
        "RGBA out": (_vae_file(tmp_path / "rgba.safetensors", out_channels=4), ["decodes to images of 4 channels"]),
        "1 channel in": (_vae_file(tmp_path / "gray.safetensors", in_channels=1), ["encodes images of 1 channels"]),
        "diffusers names, RGBA out": (_vae_file(tmp_path / "rgba-diffusers.safetensors", ldm=False, out_channels=4),
                                      ["decodes to images of 4 channels"]),
    }
    for name, (path, needles) in cases.items():
        with pytest.raises(MlxdiffError) as e:
            mlxdiff.load(str(model), vae=str(path))
        one_line(e, str(path), *needles)
    # the checkpoint's own VAE
    from safetensors.numpy import load_file, save_file
    checkpoint = load_file(str(model))
    bad = {k: v for k, v in checkpoint.items()}
    bad["first_stage_model.decoder.conv_out.weight"] = np.concatenate(
        [bad["first_stage_model.decoder.conv_out.weight"]] * 2)[:4]
    bad["first_stage_model.decoder.conv_out.bias"] = np.concatenate(
        [bad["first_stage_model.decoder.conv_out.bias"]] * 2)[:4]
    save_file(bad, str(tmp_path / "rgba-checkpoint.safetensors"))
    with pytest.raises(MlxdiffError) as e:
        sd_single_file(tmp_path / "rgba-checkpoint.safetensors")
    one_line(e, "decodes to images of 4 channels")
    # the right VAE file is taken
    assert mlxdiff.load(str(model), vae=str(_vae_file(tmp_path / "ok.safetensors"))).generate("a", **KW).image


# -- 5. a streamed run checks its file before each read -----------------------------------------------------------

def _change(kind, path: Path):
    data = bytearray(path.read_bytes())
    if kind == "truncated":
        os.truncate(path, len(data) - 100_000)
    elif kind == "replaced":              # a new file renamed over the name (as a download tool finishes)
        data[-50_000:] = bytes(50_000)
        path.with_suffix(".new").write_bytes(bytes(data))
        os.replace(path.with_suffix(".new"), path)
    elif kind == "rewritten":             # the same size, written in place
        with open(path, "r+b") as f:
            f.seek(-50_000, 2)
            f.write(bytes(50_000))
    else:                                 # "header rewritten": the same size, its modification time put back
        st = path.stat()
        with open(path, "r+b") as f:      # a byte of the first tensor's name, in the JSON header
            f.seek(10)
            f.write(bytes([data[10] ^ 0x20]))
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


CHANGES = {"truncated": "was truncated from", "replaced": "was replaced by another file",
           "rewritten": "modification time changed", "header rewritten": "its header changed"}


def test_streamed_run_stops_when_its_file_changes(tmp_path, monkeypatch):
    """The embedded default streamed at a 12 MB budget (8 of its 9 transformer blocks read at every forward): the
    file changed as the third block is read (the read wrapped) is noticed before that read, one line naming the
    file and what changed, no result (replaced by a rename: through the CLI in test_command_line; each kind, the
    header's too: test_file_identity_sees_each_change)."""
    load = streaming.BlockStream.load
    for kind in ("truncated", "rewritten"):
        folder = Path(shutil.copytree(MODEL, tmp_path / kind))
        weights = folder / "transformer" / "diffusion_pytorch_model.safetensors"
        reads = []

        def wrapped(self, group, block, kind=kind, weights=weights, reads=reads):
            reads.append(group.key)
            if len(reads) == 3:
                _change(kind, weights)
            return load(self, group, block)
        monkeypatch.setattr(streaming.BlockStream, "load", wrapped)
        with pytest.raises(MlxdiffError) as e:
            mlxdiff.load(str(folder), memory_limit=0.012).generate("a", **KW)
        one_line(e, str(weights), CHANGES[kind], "nothing was written")
        assert len(reads) == 3          # stopped at the read after the change


def test_file_identity_sees_each_change(tmp_path):
    """FileIdentity, the check itself, on each kind of change (and none)."""
    path = Path(shutil.copy(Path(MODEL) / "transformer" / "diffusion_pytorch_model.safetensors",
                            tmp_path / "w.safetensors"))
    for kind, needle in CHANGES.items():
        shutil.copy(Path(MODEL) / "transformer" / "diffusion_pytorch_model.safetensors", path)
        identity = streaming.FileIdentity.of(path)
        identity.check()
        _change(kind, path)
        with pytest.raises(MlxdiffError) as e:
            identity.check()
        one_line(e, str(path), needle)
    path.unlink()
    with pytest.raises(MlxdiffError) as e:
        identity.check()
    one_line(e, "is gone")


# -- 6. convert of a single file ---------------------------------------------------------------------------------------

_CONVERTED = {}


def converted(sd, name):
    """The folder mlxdiff.convert writes from sd[name] (made once per module)."""
    from mlxdiff.convert import convert
    if name not in _CONVERTED:
        source = sd[name][0] if name in SD else sd[name]
        _CONVERTED[name] = convert(str(source), sd["root"] / f"{name}-converted", progress=lambda *_: None)
    return _CONVERTED[name]


@pytest.mark.parametrize("name,pipeline", [("sd15", "StableDiffusionPipeline"), ("sdxl", "StableDiffusionXLPipeline"),
                                           ("gguf", "StableDiffusionPipeline")])
def test_convert_of_a_single_file_loads_and_draws_the_same(sd, name, pipeline):
    """model_index.json names the pipeline the file is (it was StableDiffusion3Pipeline), each component's library
    (text encoders: transformers), and the folder draws the file's image bit for bit (the same arrays)."""
    folder = converted(sd, name)
    index = json.loads((folder / "model_index.json").read_text())
    assert index["_class_name"] == pipeline
    assert index["unet"] == ["diffusers", "UNet2DConditionModel"] and index["vae"][0] == "diffusers"
    assert index["text_encoder"] == ["transformers", "CLIPTextModel"]
    if name == "sdxl":
        assert index["text_encoder_2"] == ["transformers", "CLIPTextModelWithProjection"]
    source = sd[name][0] if name in SD else sd[name]
    small = {**KW, "width": 16, "height": 16}
    a = mlxdiff.load(str(source)).generate("a red fox", **small)
    b = mlxdiff.load(str(folder)).generate("a red fox", **small)
    # the same weights; OpenCLIP's fused in_proj is sliced in the file and stored split in the folder, which can
    # move a float32 sum by an ulp
    assert max_rel_err(b.latents, a.latents) <= 1e-6
    assert np.array_equal(np.asarray(a.image), np.asarray(b.image))


# -- 7. img2img's size: one rule --------------------------------------------------------------------------------------

def test_img2img_size_is_the_images_on_the_command_line_too(sd, tmp_path):
    """A 63x65 init image gives 56x64 (rounded down to the VAE's factor 8, README's rule) through the API and the
    CLI alike (the CLI gave the model's default 64x64)."""
    image = tmp_path / "init.png"
    PIL.Image.fromarray(np.random.default_rng(0).integers(0, 255, (65, 63, 3), dtype=np.uint8)).save(image)
    pipe = mlxdiff.load(str(sd["sd15"][0]))
    assert pipe.vae_scale_factor() == 8
    api = pipe.generate("a fox", image=str(image), steps=1, strength=1.0, progress_bar=False)
    assert api.image.size == (56, 64)
    from mlxdiff import generate
    out = tmp_path / "cli.png"
    assert generate.main(["--model", str(sd["sd15"][0]), "--image", str(image), "--steps", "1", "--strength", "1",
                          "--no-progress", "--output", str(out)]) == 0
    assert PIL.Image.open(out).size == (56, 64)


# -- 8. Core ML packages: nothing outside the package ------------------------------------------------------------------

@pytest.fixture(scope="module")
def package(tmp_path_factory):
    """A small .mlpackage (a traced Linear, coremltools) and a folder of copies of its files outside it."""
    import warnings
    import coremltools as ct
    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32)).eval()
    x = torch.randn(2, 16)
    mlmodel = ct.convert(torch.jit.trace(model, (x,)), inputs=[ct.TensorType(name="x", shape=x.shape)],
                         convert_to="mlprogram", minimum_deployment_target=ct.target.iOS18)
    root = tmp_path_factory.mktemp("coreml")
    path = root / "small.mlpackage"
    mlmodel.save(str(path))
    outside = root / "outside"
    outside.mkdir()
    for name in ("weights/weight.bin", "model.mlmodel"):
        shutil.copy(path / "Data" / "com.apple.CoreML" / name, outside / Path(name).name)
    return path, outside


def _linked(package, tmp_path, edit):
    path, outside = package
    copy = Path(shutil.copytree(path, tmp_path / f"p{len(list(tmp_path.iterdir()))}.mlpackage"))
    edit(copy, copy / "Data" / "com.apple.CoreML", outside)
    return copy


def _relink(target):
    def edit(path):
        path.unlink()
        path.symlink_to(target)
    return edit


def _manifest(copy, edit):
    manifest = copy / "Manifest.json"
    info = json.loads(manifest.read_text())
    edit(info)
    manifest.write_text(json.dumps(info))


CORE_ML_ESCAPES = {
    "weight.bin a link out": (lambda c, d, o: _relink(o / "weight.bin")(d / "weights" / "weight.bin"),
                              "weights/weight.bin"),
    "model.mlmodel a link out": (lambda c, d, o: _relink(o / "model.mlmodel")(d / "model.mlmodel"), "model.mlmodel"),
    "the weights folder a link out": (lambda c, d, o: (shutil.rmtree(d / "weights"), (d / "weights").symlink_to(o)),
                                      "com.apple.CoreML/weights"),
    "Manifest.json a link out": (lambda c, d, o: _relink(o / "model.mlmodel")(c / "Manifest.json"), "Manifest.json"),
    "the root entry ..": (lambda c, d, o: _manifest(c, lambda i: i["itemInfoEntries"][i["rootModelIdentifier"]].update(
        path="../../outside/model.mlmodel")), "'../../outside/model.mlmodel'"),
    "another entry ..": (lambda c, d, o: _manifest(c, lambda i: i["itemInfoEntries"].update(
        extra={"path": "../../../etc/passwd"})), "'../../../etc/passwd'"),
    "a relative link out": (lambda c, d, o: _relink(Path("../../../../outside/weight.bin"))(
        d / "weights" / "weight.bin"), "weights/weight.bin"),
}


def test_core_ml_paths_resolving_outside_the_package(package, tmp_path):
    """Each escape refused in one line naming the path and where it resolves (it loaded the other file); links
    that stay inside the package are read as before."""
    for name, (edit, needle) in CORE_ML_ESCAPES.items():
        copy = _linked(package, tmp_path, edit)
        with pytest.raises(MlxdiffError) as e:
            coreml.read(copy)
        one_line(e, needle, "resolves outside it")

    def inside(copy, data, outside):
        blob = data / "weights" / "weight.bin"
        shutil.move(blob, copy / "Data" / "blob.bin")
        blob.symlink_to("../../blob.bin")
    copy = _linked(package, tmp_path, inside)
    expected = coreml.decode_all(coreml.read(package[0]))
    got = coreml.decode_all(coreml.read(copy))
    assert got.keys() == expected.keys() and all(np.array_equal(got[k], expected[k]) for k in got)


def test_core_ml_in_a_hub_cache_reads_its_blob_links(package, tmp_path):
    """A package in a Hugging Face hub cache is a tree of links into the repository's blobs folder: those are its
    own files, read (package_roots)."""
    path, _ = package
    repo = tmp_path / "models--apple--tiny"
    snapshot = repo / "snapshots" / "abc123" / "small.mlpackage"
    (repo / "blobs").mkdir(parents=True)
    for f in path.rglob("*"):
        if f.is_file():
            blob = repo / "blobs" / f"{abs(hash(str(f.relative_to(path))))}"
            shutil.copy(f, blob)
            link = snapshot / f.relative_to(path)
            link.parent.mkdir(parents=True, exist_ok=True)
            link.symlink_to(os.path.relpath(blob, link.parent))
    assert coreml.read(snapshot).keys() == coreml.read(path).keys()


# -- 9. quantize= on a checkpoint stored quantized -------------------------------------------------------------------

def test_quantize_on_a_stored_quantized_checkpoint(palettized_default, tmp_path):
    """quantize unet=p4 on a p6 checkpoint (or affine bits on it, or p4 on an 8-bit one) is refused in one line
    saying what it is stored at and what to do, instead of running at p6 without a word. Chosen over
    re-quantizing: the float weights are gone, and a p4 table found from p6's 64 values adds a second error to the
    first (it is not the p4 of the weights). The setting it is stored at is what it holds: accepted."""
    from mlxdiff.convert import convert
    folder = palettized_default[0]
    for wanted, shown in (("p4", "p4"), ("p6:g16", "p6:g16"), (4, "4"), (8, "8")):
        with pytest.raises(MlxdiffError) as e:
            mlxdiff.load(str(folder), quantize={"transformer": wanted})
        one_line(e, f"transformer={shown}", "already stored at p6", "leave transformer out of --quantize")
    with pytest.raises(MlxdiffError) as e:
        mlxdiff.load(str(folder), quantize=4)      # every component: the stored one says so
    one_line(e, "transformer=4", "already stored at p6")
    assert mlxdiff.load(str(folder), quantize={"transformer": "p6"}).components["transformer"].quantize is None
    eight = convert(str(MODEL), tmp_path / "q8", quantize={"transformer": 8}, progress=lambda *_: None)
    with pytest.raises(MlxdiffError) as e:
        mlxdiff.load(str(eight), quantize={"transformer": "p4"})
    one_line(e, "transformer=p4", "already stored at 8")
    mlxdiff.load(str(eight), quantize={"transformer": 8})


# -- 10. SGM single files with a 32-wide first level ------------------------------------------------------------------

def test_sgm_file_with_a_32_wide_first_level(sd):
    """The SDXL-shaped file's first level (no attention) is 32 wide: read (it was refused, "widths are not multiples
    of 64"), and its UNet gives diffusers' output (<= 1e-4, float32). A level with attention that is not 64-wide
    is still refused."""
    from mlxdiff.models import unet
    from mlxdiff.pipelines.stable_diffusion.single_file import sd_single_file
    path, models = sd["sdxl"]
    spec = sd_single_file(path).components["unet"]
    assert spec.config["block_out_channels"] == [32, 64]
    model = spec.build()
    rng = np.random.default_rng(0)
    sample = rng.standard_normal((2, 4, 8, 8)).astype(np.float32)
    context = rng.standard_normal((2, 5, 192)).astype(np.float32)
    text_embeds = rng.standard_normal((2, 96)).astype(np.float32)
    time_ids = np.array([[32, 32, 0, 0, 32, 32]] * 2, np.float32)
    with torch.no_grad():
        want = models["unet"](torch.from_numpy(sample), torch.tensor([500.0, 20.0]), torch.from_numpy(context),
                              added_cond_kwargs={"text_embeds": torch.from_numpy(text_embeds),
                                                 "time_ids": torch.from_numpy(time_ids)}).sample.numpy()
    got = model(mx.array(sample), mx.array([500.0, 20.0]), mx.array(context),
                {"text_embeds": mx.array(text_embeds), "time_ids": mx.array(time_ids)})
    assert max_rel_err(np.array(got), want) <= 1e-4
    shapes = {k[len(unet.ORIGINAL_PREFIX):]: np.zeros(v.shape, np.float32)
              for k, v in mlxdiff.formats.tensor_shapes(path).items() if k.startswith(unet.ORIGINAL_PREFIX)}
    level1 = dict(shapes)   # the attended level's first resnet made 96 wide: refused
    key = "input_blocks.3.0.in_layers.2.weight"
    level1[key] = np.zeros((96, *shapes[key].shape[1:]), np.float32)
    with pytest.raises(MlxdiffError) as e:
        unet.config_from_original(level1)
    one_line(e, "levels with attention are not multiples of 64")


# -- 11. Apple's chunked Core ML UNets -------------------------------------------------------------------------------

def chunk_folder(package, tmp_path):
    folder = tmp_path / "coreml-chunks"
    folder.mkdir()
    for n in (1, 2):
        shutil.copytree(package[0], folder / f"UnetChunk{n}.mlpackage")
    return folder


def test_chunked_core_ml_unets_are_named(package, tmp_path):
    """Two copies of one whole UNet package named UnetChunk1 / UnetChunk2 (not the halves of one model; issue 46
    joins real halves: tests/test_coreml_apple.py): one line saying so. The folder holding them given as a file
    stands for its first chunk; as the model itself, one line saying what it is and what is missing (it said "is a
    folder; the transformer file must be one .safetensors or .gguf file", or "model_index.json is missing";
    --transformer FOLDER: test_command_line)."""
    from mlxdiff.loading.sources import not_a_folder
    folder = chunk_folder(package, tmp_path)
    with pytest.raises(MlxdiffError) as e:
        coreml.read(folder / "UnetChunk1.mlpackage")
    one_line(e, "UnetChunk2.mlpackage", "chunks of two models")
    assert not_a_folder(folder, "transformer file") == folder / "UnetChunk1.mlpackage"
    with pytest.raises(MlxdiffError) as e:
        mlxdiff.load(str(folder / "UnetChunk1.mlpackage"))
    one_line(e, "Apple's chunked Core ML UNet", "without the rest of Apple's folder")
    with pytest.raises(MlxdiffError) as e:
        mlxdiff.load(str(folder))
    one_line(e, "Apple's Core ML folder without its TextEncoder.mlpackage")


# -- 12. forged GGUF text-encoder hyperparameters --------------------------------------------------------------------

V = fuzz_gguf_text.V
FORGED_TYPES = {
    "an array of strings": (V.ARRAY, ["4", "4"], V.STRING),
    "an array of floats": (V.ARRAY, [4.0, 4.0], V.FLOAT32),
    "an array of booleans": (V.ARRAY, [True, True], V.BOOL),
    "an empty array": (V.ARRAY, [], V.UINT32),
    "an array of one": (V.ARRAY, [4], V.UINT32),
    "a string": (V.STRING, "4", None),
    "a float64": (V.FLOAT64, 4.0, None),
    "a boolean": (V.BOOL, True, None),
}
NUMERIC_KEYS = ("attention.head_count", "attention.head_count_kv", "block_count", "context_length",
                "embedding_length", "feed_forward_length", "attention.key_length", "vocab_size", "rope.freq_base",
                "attention.layer_norm_rms_epsilon")


def test_forged_gguf_hyperparameters_name_the_key(tmp_path):
    """Every numeric key a text-encoder GGUF carries, written as an array (of any item type, any length) or another
    scalar type, is refused in one line naming the file and the key (the typed read, formats/gguf_header
    .metadata_value, through text_llm.gguf_values); a per-layer array of equal head counts, as llama.cpp writes
    them, is read."""
    from mlxdiff.loading.sources import text_encoder_from_file
    count = 0
    for kind, arch in (("mistral", "llama"), ("qwen3", "qwen3")):
        metadata, tensors = fuzz_gguf_text.base(kind)
        present = {k for k, *_ in metadata}
        for key in NUMERIC_KEYS:
            full = f"{arch}.{key}"
            if full not in present:
                continue
            for what, forged in FORGED_TYPES.items():
                if what == "a float64" and key in ("rope.freq_base", "attention.layer_norm_rms_epsilon"):
                    continue          # a float of another width is still a float there
                edited = [(k, *forged) if k == full else (k, t, v, i) for k, t, v, i in metadata]
                count += 1
                path = fuzz_gguf_text.write(tmp_path / f"{kind}-{count}.gguf", edited, tensors)
                with pytest.raises(MlxdiffError) as e:
                    text_encoder_from_file(path, (1, 2))
                message = one_line(e, full)
                assert message.startswith(f"{path}: "), message
    assert count > 100
    metadata, tensors = fuzz_gguf_text.base("qwen3")
    per_layer = [(k, V.ARRAY, [4, 4], V.UINT32) if k == "qwen3.attention.head_count" else (k, t, v, i)
                 for k, t, v, i in metadata]
    spec = text_encoder_from_file(fuzz_gguf_text.write(tmp_path / "per-layer.gguf", per_layer, tensors), (1, 2))
    assert spec.args.text_config["num_attention_heads"] == 4


# -- the palettized-checkpoint fuzzer's seeded share ------------------------------------------------------------------

def test_palettized_fuzzer_finds_nothing_unacceptable(tmp_path):
    """bench/fuzz_palettized.py's seeded share (in this process; the bench's run forks a child per mutant through
    bench/fuzz_readers.py --format palettized): 60 mutants of a palettized checkpoint, each refused in one line
    naming the file where the form's rules (written out in the fuzzer) refuse it too, or loaded with every layer
    decoding to the reference's numpy decode of the file's own bytes, bit for bit."""
    result = fuzz_palettized.run(60, seed=7, workdir=tmp_path)
    assert result["n"] == 60 and result["unacceptable"] == 0, fuzz_palettized.summary(result)
    assert result["counts"].get("refused (reference refuses too)", 0) >= 30, result["counts"]
    assert result["counts"].get("loaded = reference", 0) >= 6, result["counts"]


# -- every kind through the command line: exit 2, one line, no image ------------------------------------------------

def test_command_line(sd, palettized_default, package, tmp_path, monkeypatch, capsys):
    """mlxdiff.generate's main, one case of each kind whose refusal comes from a run's own path (the others refuse
    where `mlxdiff.load` reads, which the CLI calls the same way): exit 2, one stderr line, no image. In this process
    (tests/adversarial.py's forked cases cost a fork server's imports: tests/test_bad_input_round2.py has those)."""
    from mlxdiff import generate
    out = tmp_path / "out.png"
    palette, layer = _edited(palettized_default, tmp_path, PALETTE_EDITS["a 16-entry table for 6-bit indices"][0])
    rgba = _vae_file(tmp_path / "rgba.safetensors", out_channels=4)
    chunks = chunk_folder(package, tmp_path)
    streamed = Path(shutil.copytree(MODEL, tmp_path / "cli"))
    weights = streamed / "transformer" / "diffusion_pytorch_model.safetensors"
    load, reads = streaming.BlockStream.load, []

    def replaced_at_the_third_read(self, group, block):
        reads.append(group.key)
        if len(reads) == 3:
            _change("replaced", weights)
        return load(self, group, block)
    monkeypatch.setattr(streaming.BlockStream, "load", replaced_at_the_third_read)

    def argv(model, *more):
        return ["--model", str(model), "--steps", "1", "--width", "32", "--height", "32", "--no-progress",
                "--output", str(out), *more]
    cases = [
        (argv(sd["sdxl"][0], "--clip-skip", "2"), ["clip_skip=2", "at most 1"]),
        (argv(palette), [f"{layer}.lut has 16 entries"]),
        (argv(sd["sd15"][0], "--vae", str(rgba)), [str(rgba), "4 channels"]),
        (argv(streamed, "--memory-limit", "0.012"), [str(weights), "was replaced by another file"]),
        (argv(sd["sd15"][0], "--transformer", str(chunks)), ["UnetChunk2.mlpackage", "chunks of two models"]),
    ]
    for args, needles in cases:
        capsys.readouterr()
        assert generate.main(args) == 2, args
        lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
        assert len(lines) == 1 and lines[0].startswith("mlxdiff: error: "), (args, lines)
        for needle in needles:
            assert needle in lines[0], (needle, lines[0])
        assert not out.exists()
    assert len(reads) == 3
