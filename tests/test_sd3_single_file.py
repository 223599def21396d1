"""End to end from the original single-file layout: sd3.5_*.safetensors (model.diffusion_model.* +
first_stage_model.*) with clip_l / clip_g / t5xxl files in text_encoders/ beside it, or an "incl_clips" file:
final latents within 1e-4 and images within 2 levels of diffusers (tests/parity.py)."""

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

import mlxdiff
from parity import IMAGE_LEVELS, LATENT_TOL, assert_inputs_matter, levels, rel_diff
from sd3_helpers import sd3_tiny_components
from twins import diffusers_to_ldm, sd3_to_sai

H, W = 32, 40


@pytest.fixture(scope="module")
def original_files(tmp_path_factory):
    from diffusers import StableDiffusion3Pipeline
    comps = sd3_tiny_components(seed=4, single_file=True)
    # what diffusers does for SD3 single files: CLIP-L's projection is the identity
    with torch.no_grad():
        comps["text_encoder"].text_projection.weight.copy_(torch.eye(64))
    pipe = StableDiffusion3Pipeline(**comps)
    sd = lambda m: {k: v.detach().clone().contiguous() for k, v in m.state_dict().items()}
    root = tmp_path_factory.mktemp("sd3_single")
    main = {"model.diffusion_model." + k: v for k, v in sd3_to_sai(sd(pipe.transformer), 3).items()}
    main.update({"first_stage_model." + k: v for k, v in diffusers_to_ldm(sd(pipe.vae), 2).items()})
    clip_l = {k: v for k, v in sd(pipe.text_encoder).items() if k != "text_projection.weight"}
    t5 = {k: v for k, v in sd(pipe.text_encoder_3).items() if k != "encoder.embed_tokens.weight"}
    save_file(main, str(root / "sd3.5_tiny.safetensors"))
    (root / "text_encoders").mkdir()
    save_file(clip_l, str(root / "text_encoders" / "clip_l.safetensors"))
    save_file(sd(pipe.text_encoder_2), str(root / "text_encoders" / "clip_g.safetensors"))
    save_file(t5, str(root / "text_encoders" / "t5xxl_fp16.safetensors"))
    incl = dict(main)
    incl.update({"text_encoders.clip_l.transformer." + k: v for k, v in clip_l.items()})
    incl.update({"text_encoders.clip_g.transformer." + k: v for k, v in sd(pipe.text_encoder_2).items()})
    incl.update({"text_encoders.t5xxl.transformer." + k: v for k, v in t5.items()})
    (root / "incl").mkdir()
    save_file(incl, str(root / "incl" / "sd3_medium_incl_clips_t5xxl.safetensors"))
    return root, pipe


NOISE = np.random.default_rng(7).standard_normal((1, 16, H // 2, W // 2)).astype(np.float32)
RUN = dict(prompt="a lighthouse at dusk", negative_prompt="fog", guidance_scale=5.0)


@pytest.fixture(scope="module")
def reference(original_files):
    """diffusers' (latents, image) on the twin, run once for both layouts, with the prompt, the negative prompt and
    the CFG scale each shown to move it."""
    _, pipe = original_files

    def run(**kw):
        final = {}

        def keep_latents(_, i, t, tensors):   # before the VAE's scaling is undone, as mlxdiff's Result.latents
            final["latents"] = tensors["latents"].numpy()
            return {}
        image = pipe(height=H, width=W, num_inference_steps=3, latents=torch.from_numpy(NOISE), output_type="np",
                     callback_on_step_end=keep_latents, **kw).images[0]
        return final["latents"], image
    return assert_inputs_matter(run, RUN, {"the prompt": dict(prompt="a red fox in the snow"),
                                           "the negative prompt": dict(negative_prompt=None),
                                           "guidance": dict(guidance_scale=8.0)})


@pytest.mark.parametrize("layout", ["separate_text_encoders", "incl_clips"])
def test_single_file_matches_diffusers(original_files, reference, layout):
    root, _ = original_files
    path = root / "sd3.5_tiny.safetensors" if layout == "separate_text_encoders" else \
        root / "incl" / "sd3_medium_incl_clips_t5xxl.safetensors"
    ref_latents, ref = reference
    ours = mlxdiff.load(str(path)).generate(RUN["prompt"], negative_prompt=RUN["negative_prompt"], width=W,
                                            height=H, steps=3, guidance=RUN["guidance_scale"], latents=NOISE,
                                            progress_bar=False)
    assert rel_diff(ours.latents, ref_latents) <= LATENT_TOL
    assert levels(ours.image, ref) <= IMAGE_LEVELS


def test_missing_text_encoder_is_one_clear_error(original_files, tmp_path):
    import shutil
    from mlxdiff.errors import MlxdiffError
    root, _ = original_files
    shutil.copy(root / "sd3.5_tiny.safetensors", tmp_path / "sd3.5_tiny.safetensors")
    with pytest.raises(MlxdiffError, match="clip_l"):
        mlxdiff.load(str(tmp_path / "sd3.5_tiny.safetensors"))
