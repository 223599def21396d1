"""Bad input, third round (issue 45), the surfaces that landed this round: each refused where it is read, through
the command line (exit 2, one line naming the flag or file and what to do, no output file):

1. inpainting's and outpainting's inputs: --mask not an image / missing / all black / without --image / with a
   family that takes no mask (Chroma), --mask-blur negative, huge or without a mask, --outpaint malformed,
   negative, huge, without --image or with a family that has no outpainting; a mask of another aspect ratio is
   not refused: it is stretched as diffusers' mask_processor stretches it, and the run says so;
2. ControlNets: --controlnet with a family that has none (FLUX.2), of another family (SD3's), of another size, not
   there, a SCALE that is no number; --control-image missing, not an image, too few, too many, without
   --controlnet; --control-start after --control-end, or outside 0..1;
3. --preview-vae: not a weight file, a folder, missing, another model's safetensors (an SD VAE, a CLIP, an empty
   one);
4. hub ids (HF_HUB_OFFLINE=1, an empty cache, no network): malformed, absent from the cache with and without
   --no-download; --revision with a local folder, or empty;
5. a streamed run whose file changes under it (bench/fuzz_streamed.py's seeded share: truncated, extended,
   rewritten in place, its header rewritten with the time put back, replaced by a rename, deleted, made
   unreadable), at a random read: one line naming the file and the change, no output file;
6. UNet LoRAs (bench/fuzz_unet_lora.py's seeded share): kohya / PEFT files for SD 1.x with mutated names, shapes,
   dtypes, ranks, alphas, values, truncated: refused in one line naming the file, or applied with the weight
   changes diffusers' own loading gives;
7. convert of a K-quant GGUF says in one line what it writes: each type's affine form, Q2_K re-quantized.

The CLI cases (1-5) run in one tests/adversarial.py fork server (each case a forked child under a memory cap and an
alarm)."""

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np
import PIL.Image
import pytest
import torch

import mlxdiff
from adversarial import refused, run_cases
from gguf import GGMLQuantizationType as T
import gguf_helpers
from gguf_helpers import write_city96_gguf
from ldm_helpers import sd15_components, twin_
from chroma_helpers import chroma_components
from twins import flux2_to_bfl
from mlxdiff import default_model
from mlxdiff.convert import convert

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
import fuzz_streamed  # noqa: E402  (the streamed-run cases' seeded share)
import fuzz_unet_lora  # noqa: E402  (the UNet LoRA fuzzer's seeded share)

MODEL = str(default_model.FOLDER)
# tests/test_controlnet.py's SD 1.5 ControlNet shape (the UNet of ldm_helpers.sd15_components)
SD15_NET = dict(in_channels=4, block_out_channels=(16, 24), norm_num_groups=8, layers_per_block=1,
                down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), cross_attention_dim=20,
                attention_head_dim=4, conditioning_embedding_out_channels=(8, 12, 16))
STREAMED_CASES, STREAMED_SEED = 3, 9      # truncated, rewritten, permissions (the rest: the bench run)
UNET_LORA_MUTANTS, UNET_LORA_SEED = 10, 7


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """The models and inputs the cases read: a tiny SD 1.5 folder, its ControlNet and one of another size, an SD3
    ControlNet's config, a tiny Chroma folder, images and files that are no images."""
    from diffusers import ChromaPipeline, ControlNetModel, StableDiffusionPipeline
    root = tmp_path_factory.mktemp("features")
    StableDiffusionPipeline(**sd15_components()).save_pretrained(str(root / "sd15"))
    torch.manual_seed(3)
    twin_(ControlNetModel(**SD15_NET), seed=3).save_pretrained(str(root / "controlnet"))
    twin_(ControlNetModel(**{**SD15_NET, "block_out_channels": (16, 32)}), seed=4).save_pretrained(
        str(root / "controlnet-bigger"))
    (root / "sd3-controlnet").mkdir()
    (root / "sd3-controlnet" / "config.json").write_text(json.dumps({"_class_name": "SD3ControlNetModel",
                                                                     "num_layers": 2}))
    ChromaPipeline(**chroma_components()).save_pretrained(str(root / "chroma"))
    PIL.Image.new("RGB", (32, 32), (200, 100, 50)).save(root / "image.png")
    PIL.Image.new("L", (32, 32), 0).save(root / "black.png")
    PIL.Image.new("L", (32, 32), 255).save(root / "white.png")
    wide = np.zeros((16, 64), np.uint8)
    wide[:, 32:] = 255
    PIL.Image.fromarray(wide).save(root / "wide.png")
    (root / "text.png").write_text("not an image")
    (root / "empty.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ")
    return root


def _cases(root: Path) -> list:
    """[(case, needles the one line must hold)]: mlxdiff.generate's command line, each case its own output file."""
    out = root / "outputs"
    out.mkdir(exist_ok=True)
    sd15, img, white = str(root / "sd15"), str(root / "image.png"), str(root / "white.png")
    cn, ci = ["--controlnet", str(root / "controlnet")], ["--control-image", img]
    preview = ["--preview", str(out / "preview.png")]
    table = [
        # 1. masks and outpainting
        ((MODEL, "--image", img, "--mask", str(root / "text.png")), ["mask", "text.png", "not an image", "PNG"]),
        ((MODEL, "--image", img, "--mask", str(root / "nope.png")), ["mask", "nope.png", "no such file"]),
        ((MODEL, "--image", img, "--mask", str(root / "black.png")), ["black.png", "all black", "nothing to repaint"]),
        ((MODEL, "--mask", white), ["--mask", "give --image FILE too"]),
        ((str(root / "chroma"), "--image", img, "--mask", white), ["mask", "this is a Chroma model"]),
        ((MODEL, "--image", img, "--mask", white, "--mask-blur", "-1"), ["mask_blur=-1", "from 0 to"]),
        ((MODEL, "--image", img, "--mask", white, "--mask-blur", "1000000000"), ["mask_blur=1000000000"]),
        ((MODEL, "--image", img, "--mask-blur", "3"), ["--mask-blur 3", "give --mask FILE or --outpaint"]),
        ((MODEL, "--image", img, "--outpaint", "1,2,3"), ["outpaint='1,2,3'", "expected 4 integers"]),
        ((MODEL, "--image", img, "--outpaint", "a,b,c,d"), ["outpaint='a,b,c,d'", "expected 4 integers"]),
        ((MODEL, "--image", img, "--outpaint=-8,0,0,0"), ["outpaint='-8,0,0,0'", "from 0 to"]),
        ((MODEL, "--image", img, "--outpaint", "100000,0,0,0"), ["outpaint='100000,0,0,0'"]),
        ((MODEL, "--image", img, "--strength", "1", "--outpaint", "4070,0,0,0"),
         ["past 4096 pixels a side", "pad less"]),
        ((MODEL, "--outpaint", "8,0,0,0"), ["--outpaint 8,0,0,0", "give --image FILE too"]),
        ((str(root / "chroma"), "--image", img, "--outpaint", "8,0,0,0"), ["outpaint", "this is a Chroma model"]),
        # 2. ControlNets
        ((MODEL, *cn, *ci), ["controlnets=", "this is a FLUX.2 model", "leave"]),
        ((sd15, "--controlnet", str(root / "sd3-controlnet"), *ci), ["sd3-controlnet", "SD3ControlNetModel"]),
        ((sd15, "--controlnet", str(root / "controlnet-bigger"), *ci),
         ["controlnet-bigger", "block_out_channels is [16, 32]", "another size"]),
        ((sd15, "--controlnet", str(root / "nowhere"), *ci), ["nowhere", "no such folder or file"]),
        ((sd15, "--controlnet", str(root / "controlnet") + ":abc", *ci), ["--controlnet", "'abc' is not a number"]),
        ((sd15, *cn, "--control-image", str(root / "nope.png")), ["nope.png", "no such file"]),
        ((sd15, *cn, "--control-image", str(root / "text.png")), ["text.png", "not an image"]),
        ((sd15, *cn), ["--controlnet given 1 times but --control-image 0", "one control image per ControlNet"]),
        ((sd15, *cn, *ci, *ci), ["--control-image 2", "one control image per ControlNet"]),
        ((sd15, *ci), ["--control-image", "give --controlnet PATH too"]),
        ((sd15, *cn, *ci, "--control-start", "0.6", "--control-end", "0.5"),
         ["control_start 0.6 is not below control_end 0.5"]),
        ((sd15, *cn, *ci, "--control-start", "-0.5"), ["-0.5", "from 0 to 1"]),
        ((sd15, *cn, *ci, "--control-end", "nan"), ["nan", "from 0 to 1"]),
        # 3. --preview-vae
        ((MODEL, *preview, "--preview-vae", str(root / "text.png")), ["text.png", "tiny VAE (TAESD)"]),
        ((MODEL, *preview, "--preview-vae", str(root / "nope.safetensors")), ["nope.safetensors", "not found"]),
        ((MODEL, *preview, "--preview-vae", str(root / "sd15" / "vae")), ["sd15/vae", "is a folder"]),
        ((MODEL, *preview, "--preview-vae", str(root / "empty.safetensors")),
         ["empty.safetensors", "not an AutoencoderTiny (TAESD) decoder", "give a TAESD-family decoder"]),
        ((MODEL, *preview, "--preview-vae", str(root / "sd15" / "vae" / "diffusion_pytorch_model.safetensors")),
         ["diffusion_pytorch_model.safetensors", "not an AutoencoderTiny", "give a TAESD-family decoder"]),
        ((MODEL, *preview, "--preview-vae", str(root / "sd15" / "text_encoder" / "model.safetensors")),
         ["model.safetensors", "no tiny VAE decoder's", "give a TAESD-family decoder"]),
        ((MODEL, "--preview-vae", str(root / "empty.safetensors")), ["--preview-vae", "give --preview FILE too"]),
        # 4. hub ids, offline with an empty cache
        (("not//a valid id",), ["not//a valid id", "not a local path", "ORG/NAME"]),
        (("a/b/c/d",), ["a/b/c/d", "not a local path", "ORG/NAME"]),
        (("someone/some-model", "--no-download"), ["'someone/some-model'", "local Hugging Face cache",
                                                   "hf download someone/some-model"]),
        (("someone/some-model",), ["someone/some-model", "local Hugging Face cache"]),
        ((MODEL, "--revision", "v1"), ["revision='v1'", "for a hub id", "local path"]),
        (("someone/some-model", "--revision", "", "--no-download"), ["revision=''", "non-empty"]),
    ]
    cases = []
    for i, ((model, *more), needles) in enumerate(table):
        argv = ["--model", model, "--steps", "1", "--width", "32", "--height", "32", "--no-progress", "--prompt",
                "a fox", "--output", str(out / f"{i}.png"), *more]
        cases.append(({"cli": "mlxdiff.generate", "argv": argv, "timeout": 60, "out": str(out / f"{i}.png")},
                      needles))
    return cases


@pytest.fixture(scope="module")
def streamed_root():
    """A folder `nobody` can reach (a streamed case made unreadable goes on as that user when run as root)."""
    root = Path(tempfile.mkdtemp(prefix="mlxdiff-streamed-"))
    os.chmod(root, 0o777)
    yield root
    shutil.rmtree(root, ignore_errors=True)


def test_feature_inputs_through_the_command_line(files, streamed_root, tmp_path, monkeypatch):
    """Every case of sections 1-5: exit 2, one line naming the flag or file and what to do, no output file; a mask
    of another aspect ratio is run (stretched, as diffusers does) and the run's line says so."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")            # read by the fork server's huggingface_hub at its import
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-hub-cache"))
    cases = _cases(files)
    streamed = [fuzz_streamed.make_case(STREAMED_SEED, i, streamed_root) for i in range(STREAMED_CASES)]
    aspect_out = files / "outputs" / "aspect.png"
    aspect = {"cli": "mlxdiff.generate", "timeout": 60, "argv": [
        "--model", MODEL, "--steps", "2", "--width", "32", "--height", "32", "--no-progress", "--prompt", "a fox",
        "--image", str(files / "image.png"), "--mask", str(files / "wide.png"), "--output", str(aspect_out)]}
    outcomes = run_cases([c for c, _ in cases] + streamed + [aspect], tmp_path)
    wrong = []      # every case that fails, not only the first
    for (case, needles), outcome in zip(cases, outcomes):
        line = outcome.stderr.strip()
        missing = [needle for needle in needles if needle not in line]
        if not refused(outcome) or not line.startswith("mlxdiff: error: ") or missing or Path(case["out"]).exists():
            wrong.append(f"{missing} {Path(case['out']).exists()} {outcome.describe()}")
    assert not wrong, "\n".join(wrong)
    kinds = set()
    for case, outcome in zip(streamed, outcomes[len(cases):]):
        assert fuzz_streamed.judge(case, outcome) is None, (case["kind"], case["at"],
                                                            fuzz_streamed.judge(case, outcome))
        kinds.add(case["kind"])
    assert len(kinds) == STREAMED_CASES, kinds
    run = outcomes[-1]
    assert run.rc == 0 and aspect_out.exists(), run.describe()
    assert "another aspect ratio, so the mask is stretched" in run.stdout, run.stdout


def test_unet_lora_mutants_are_refused_or_read_as_diffusers(tmp_path):
    """bench/fuzz_unet_lora.py's seeded share, in this process: none unacceptable (a traceback, an unclean error,
    a load of a file diffusers refuses, of non-finite values, or with other weight changes than diffusers'), and
    the mutants reach the refusals both make, the stricter ones and loads equal to diffusers'."""
    result = fuzz_unet_lora.run(UNET_LORA_MUTANTS, UNET_LORA_SEED, tmp_path)
    assert result["n"] == UNET_LORA_MUTANTS and result["unacceptable"] == 0, result["failures"]
    counts = result["counts"]
    assert counts.get("refused (reference refuses too)", 0) >= 3, counts
    assert counts.get("refused (reference accepts)", 0) >= 1, counts
    assert counts.get("loaded = reference", 0) >= 2, counts


def test_convert_of_a_k_quant_gguf_says_what_it_writes(tmp_path, monkeypatch):
    """A FLUX.2 transformer GGUF (the default model's shapes) holding Q2_K, Q3_K, Q4_K and Q6_K layers: convert
    writes MLX's affine form (a folder has no form for a GGUF's own blocks) and says so in one line, naming Q2_K
    as re-quantized (4-bit g64, not exact) and each other type's form; the folder loads and draws."""
    from diffusers import Flux2Transformer2DModel
    config = {k: v for k, v in json.loads((default_model.FOLDER / "transformer" / "config.json").read_text()).items()
              if not k.startswith("_")}
    with torch.device("meta"):
        shapes = flux2_to_bfl(Flux2Transformer2DModel(**config).state_dict(), config)
    cycle, count = [T.Q2_K, T.Q3_K, T.Q4_K, T.Q6_K], [0]

    def kquant_mix(name, shape, family):     # every matrix whose rows K-quants can hold, the types in turn
        if len(shape) == 2 and shape[1] % 256 == 0:
            count[0] += 1
            return cycle[count[0] % len(cycle)]
        return T.F32 if len(shape) == 1 else T.F16
    monkeypatch.setattr(gguf_helpers, "city96_type", kquant_mix)    # where write_city96_gguf looks it up
    path = tmp_path / "klein-kquants.gguf"
    types = write_city96_gguf(path, shapes, "flux2", "flux", random=True, block_scale=1e-2)
    assert {t for t in types.values()} >= set(cycle)
    said = []
    dest = convert(MODEL, tmp_path / "converted", transformer=str(path), progress=said.append)
    lines = [line for line in said if line.startswith("transformer: ")]
    assert len(lines) == 1 and "\n" not in lines[0], said
    line = lines[0]
    assert "MLX's affine form" in line, line
    for needle in ("Q2_K re-quantized to 4-bit g64", "not exact", "Q3_K as 8-bit g128 (exact)",
                   "Q4_K as 4-bit g32 (exact)", "Q6_K as 8-bit g32 (near-exact)"):
        assert needle in line, (needle, line)
    assert not any("GGUF" in s for s in said if not s.startswith("transformer: ")), said
    image = mlxdiff.load(str(dest)).generate("a fox", steps=1, width=32, height=32, progress_bar=False, seed=1).image
    assert np.isfinite(np.asarray(image, np.float32)).all() and image.size == (32, 32)
