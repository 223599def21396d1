"""End to end: mlxdiff's FLUX.2 pipelines against diffusers' Flux2Pipeline (dev: Mistral3 encoder, embedded
guidance) and Flux2KleinPipeline (Qwen3 encoder; base with CFG, distilled without), on the same injected noise:
final latents within 1e-4 and images within 2 levels, for two prompts, each input the test covers shown to move
diffusers' own output (tests/parity.py)."""

import numpy as np
import pytest

import mlxdiff
from mlxdiff.errors import MlxdiffError
from parity import IMAGE_LEVELS, LATENT_TOL, assert_moves, assert_inputs_matter, levels, rel_diff
from twins import H, SEQ, TAPS, W, build_pipeline, flux2_reference, text_length

PROMPT, OTHER = "a red fox in the snow", "a lighthouse by the sea"


@pytest.fixture(scope="module", params=["klein_base", "klein_distilled", "dev"])
def saved_pipeline(request, tmp_path_factory):
    return build_pipeline(request.param, tmp_path_factory.mktemp(f"flux2_{request.param}"))


def test_flux2_pipeline_matches_diffusers(saved_pipeline):
    kind, folder, pipe = saved_pipeline
    noise = np.random.default_rng(2).standard_normal((1, 20, H // 4, W // 4)).astype(np.float32)
    guidance, seq = (1.0 if kind == "klein_distilled" else 3.5), text_length(kind)
    runs = {}

    def reference(**kw):
        runs[kw["prompt"], kw["guidance_scale"]] = out = flux2_reference(pipe, noise, **kw)
        return out
    base = dict(prompt=PROMPT, height=H, width=W, num_inference_steps=3, guidance_scale=guidance,
                max_sequence_length=seq, text_encoder_out_layers=TAPS)
    changes = {"the prompt": dict(prompt=OTHER)}
    if kind != "klein_distilled":      # dev: the embedded guidance; klein base: CFG's scale (uncond branch)
        changes["guidance"] = dict(guidance_scale=5.0)
    ref_latents, ref = assert_inputs_matter(reference, base, changes)
    ours_pipe = mlxdiff.load(str(folder))
    # both prompts against diffusers: a prompt dropped or replaced before tokenizing cannot match both
    for prompt in (PROMPT, OTHER):
        ours = ours_pipe.generate(prompt, width=W, height=H, steps=3, guidance=guidance, latents=noise,
                                  max_sequence_length=seq, text_encoder_out_layers=TAPS, progress_bar=False)
        want_latents, want = runs[prompt, guidance]
        assert ours.latents.shape == noise.shape
        assert rel_diff(ours.latents, want_latents) <= LATENT_TOL, prompt
        assert levels(ours.image, want) <= IMAGE_LEVELS, prompt
    if kind == "dev":
        dev_prompts_reach_the_tokens(pipe, ours_pipe, seq)


def dev_prompts_reach_the_tokens(pipe, ours_pipe, seq):
    """FLUX.2-dev's system message comes first in every prompt's tokens: at the twins' text length the prompt still
    fits (left padding remains), two prompts give different embeddings in diffusers, and mlxdiff's match both."""
    from diffusers.pipelines.flux2.pipeline_flux2 import format_input
    embeds = {}
    for prompt in (PROMPT, OTHER):
        tokens = pipe.tokenizer.apply_chat_template(
            format_input(prompts=[prompt], system_message=pipe.system_message), add_generation_prompt=False,
            tokenize=True, return_dict=True, return_tensors="pt", padding="max_length", truncation=True,
            max_length=seq)
        assert tokens["attention_mask"][0, 0] == 0, f"{prompt!r} is truncated at {seq} tokens"
        theirs = pipe.encode_prompt(prompt=prompt, device="cpu", max_sequence_length=seq,
                                    text_encoder_out_layers=TAPS)[0].detach().numpy()
        ours = ours_pipe.encode_prompt(prompt, max_sequence_length=seq, text_encoder_out_layers=TAPS).as_numpy()
        assert rel_diff(ours["prompt_embeds"], theirs) <= LATENT_TOL, prompt
        embeds[prompt] = theirs
    assert_moves("the prompt", embeds[PROMPT], embeds[OTHER])


def test_joint_attention_mismatch_is_one_clear_line(tmp_path):
    _, folder, _ = build_pipeline("klein_base", tmp_path)
    with pytest.raises(MlxdiffError, match="joint_attention_dim"):
        mlxdiff.load(str(folder)).generate("a cat", width=W, height=H, steps=1, max_sequence_length=SEQ,
                                           text_encoder_out_layers=(1, 3), progress_bar=False)
