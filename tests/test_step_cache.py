"""Step caching (pipelines/step_cache.py) against diffusers' hooks, same injected noise, images within 2 levels:
`--cache first-block[:T]` against its First Block Cache hook (for the same threshold the same forwards skip their
remaining blocks), `--cache taylorseer[:N[:K]]` against its TaylorSeer hook in lite mode (the same forwards
predicted; factors in float32 on both sides).

diffusers 0.42's hook fails on both transformers (FLUX.2's tail block returns the joined [text; image] stream:
huggingface/diffusers#14280; SD3.5's last block returns no text stream). The reference here is that hook with only
its tail arithmetic mended, as the open fix (#14359) does: the tail residual is taken per stream. Every decision
(the head residual's relative change against the threshold) is diffusers' own code."""

import numpy as np
import pytest
import torch

import mlxdiff
from bad_input_helpers import assert_refused, gen
from mlxdiff.errors import MlxdiffError
from mlxdiff.pipelines.step_cache import FirstBlockCache, parse
from step_cache_helpers import FirstBlockCacheRecorder
from twins import H, TAPS, W, build_pipeline, text_length

STEPS = 10


def _with_context(transformer, name="cond"):
    """diffusers' SD3 and FLUX.2-dev pipelines set no cache context (klein's set "cond"/"uncond" themselves)."""
    from diffusers.hooks.hooks import CacheContext, _set_cache_context
    _set_cache_context(transformer, CacheContext(name))


def _own_sd3(sd3_tiny):
    """(folder, a diffusers SD3 pipeline of its own): the session's shared one's components with the transformer
    (which the hooks change) and the scheduler copied, so that the shared fixture stays as it is."""
    import copy
    from diffusers import StableDiffusion3Pipeline
    folder, pipe = sd3_tiny
    return folder, StableDiffusion3Pipeline(**{**pipe.components, "transformer": copy.deepcopy(pipe.transformer),
                                               "scheduler": copy.deepcopy(pipe.scheduler)})


def _image(result):
    return np.asarray(result.image).astype(np.float32) / 255.0


def _check(ours, ref_image, recorder):
    assert ours.cached_steps == recorder.steps()
    skipped = sum(len(v) for v in ours.cached_steps.values())
    forwards = sum(len(v) for v in recorder.skipped.values())
    assert 0 < skipped < forwards - len(recorder.skipped), (ours.cached_steps, forwards)   # some of each
    assert np.abs(_image(ours) - (ref_image * 255).round() / 255.0).max() <= 2 / 255
    assert "first-block cache" in " ".join(ours.notes)


# thresholds among the tiny random models' relative changes (0.5-2, far above a trained model's), so that some
# forwards skip and some run
@pytest.mark.parametrize("kind, guidance, threshold", [("klein_base", 3.5, 1.0), ("dev", 3.5, 0.8)])
def test_flux2_skips_what_diffusers_skips(kind, guidance, threshold, tmp_path, monkeypatch):
    ours, ref, recorder = _flux2_both(kind, guidance, tmp_path, 2, f"first-block:{threshold}",
                                      lambda transformer: FirstBlockCacheRecorder(monkeypatch, transformer, threshold))
    _check(ours, ref, recorder)


def _flux2_both(kind, guidance, tmp_path, seed, cache, recorder_for):
    """(our Result with `cache`, diffusers' image with the recorder's hook, the recorder) on one tiny FLUX.2
    pipeline and injected noise."""
    _, folder, pipe = build_pipeline(kind, tmp_path)
    noise = np.random.default_rng(seed).standard_normal((1, 20, H // 4, W // 4)).astype(np.float32)
    recorder = recorder_for(pipe.transformer)
    _with_context(pipe.transformer)
    seq = text_length(kind)     # dev: past its system message, so that the prompt reaches the tokens
    ref = pipe(prompt="a red fox in the snow", height=H, width=W, num_inference_steps=STEPS, guidance_scale=guidance,
               latents=torch.from_numpy(noise), max_sequence_length=seq, text_encoder_out_layers=TAPS,
               output_type="np").images[0]
    ours = mlxdiff.load(str(folder)).generate("a red fox in the snow", width=W, height=H, steps=STEPS,
                                              guidance=guidance, latents=noise, max_sequence_length=seq,
                                              text_encoder_out_layers=TAPS, progress_bar=False, cache=cache)
    return ours, ref, recorder


def test_sd3_skips_what_diffusers_skips(sd3_tiny, monkeypatch):
    folder, pipe = _own_sd3(sd3_tiny)
    H3, W3, threshold = 40, 24, 0.9
    noise = np.random.default_rng(1).standard_normal((1, 16, H3 // 2, W3 // 2)).astype(np.float32)
    recorder = FirstBlockCacheRecorder(monkeypatch, pipe.transformer, threshold)
    _with_context(pipe.transformer)
    ref = pipe(prompt="a cat", negative_prompt="blurry", height=H3, width=W3, num_inference_steps=STEPS,
               guidance_scale=4.0, latents=torch.from_numpy(noise), output_type="np").images[0]
    ours = mlxdiff.load(str(folder)).generate("a cat", negative_prompt="blurry", width=W3, height=H3, steps=STEPS,
                                              guidance=4.0, latents=noise, progress_bar=False,
                                              cache=f"first-block:{threshold}")
    _check(ours, ref, recorder)


class _TaylorRecorder:
    """diffusers' TaylorSeer cache, lite mode (every block skipped, proj_out predicted), each forward's decision
    recorded per context (proj_out's hook: one decision per forward)."""

    def __init__(self, monkeypatch, transformer, interval, order):
        from diffusers.hooks.taylorseer_cache import (TaylorSeerCacheConfig, TaylorSeerCacheHook, TaylorSeerState,
                                                      apply_taylorseer_cache)
        self.predicted = {}
        recorder, measure = self, TaylorSeerCacheHook._measure_should_compute
        update, predict = TaylorSeerState.update, TaylorSeerState.predict

        # diffusers 0.42.1's skipped-block state reads .dtype of every output, and SD3.5's last block returns
        # (None, image): mended here by keeping where the Nones were and giving them back in the prediction
        def update_without_nones(state, outputs):
            state.nones = tuple(o is None for o in outputs)
            update(state, tuple(o for o in outputs if o is not None))

        def predict_with_nones(state):
            out = iter(predict(state))
            return [None if none else next(out) for none in getattr(state, "nones", ())] or list(out)
        monkeypatch.setattr(TaylorSeerState, "update", update_without_nones)
        monkeypatch.setattr(TaylorSeerState, "predict", predict_with_nones)

        def recorded(hook):
            compute, state = measure(hook)
            if not state.is_inactive:
                recorder.predicted.setdefault(hook.state_manager.context.name, []).append(not compute)
            return compute, state
        monkeypatch.setattr(TaylorSeerCacheHook, "_measure_should_compute", recorded)
        apply_taylorseer_cache(transformer, TaylorSeerCacheConfig(cache_interval=interval, max_order=order,
                                                                  use_lite_mode=True,
                                                                  taylor_factors_dtype=torch.float32))

    def steps(self) -> dict:
        return {name: [i for i, p in enumerate(flags) if p] for name, flags in self.predicted.items()}


def _check_taylor(ours, ref_image, recorder, interval):
    assert ours.cached_steps == recorder.steps()
    for name, flags in recorder.predicted.items():      # diffusers' schedule: 3 run, then one in `interval`
        assert [i for i, p in enumerate(flags) if not p] == [i for i in range(len(flags))
                                                             if i < 3 or (i - 4) % interval == 0]
    assert np.abs(_image(ours) - (ref_image * 255).round() / 255.0).max() <= 2 / 255
    assert "taylorseer cache" in " ".join(ours.notes)


@pytest.mark.parametrize("kind, guidance, interval, order", [("klein_base", 3.5, 5, 1), ("dev", 3.5, 3, 2)])
def test_flux2_predicts_what_diffusers_taylorseer_predicts(kind, guidance, interval, order, tmp_path, monkeypatch):
    ours, ref, recorder = _flux2_both(kind, guidance, tmp_path, 3, f"taylorseer:{interval}:{order}",
                                      lambda transformer: _TaylorRecorder(monkeypatch, transformer, interval, order))
    _check_taylor(ours, ref, recorder, interval)


def test_sd3_predicts_what_diffusers_taylorseer_predicts(sd3_tiny, monkeypatch):
    folder, pipe = _own_sd3(sd3_tiny)
    H3, W3 = 40, 24
    noise = np.random.default_rng(4).standard_normal((1, 16, H3 // 2, W3 // 2)).astype(np.float32)
    recorder = _TaylorRecorder(monkeypatch, pipe.transformer, 5, 1)
    _with_context(pipe.transformer)
    ref = pipe(prompt="a cat", negative_prompt="blurry", height=H3, width=W3, num_inference_steps=STEPS,
               guidance_scale=4.0, latents=torch.from_numpy(noise), output_type="np").images[0]
    ours = mlxdiff.load(str(folder)).generate("a cat", negative_prompt="blurry", width=W3, height=H3, steps=STEPS,
                                              guidance=4.0, latents=noise, progress_bar=False, cache="taylorseer")
    _check_taylor(ours, ref, recorder, 5)


@pytest.mark.parametrize("spec, match", [
    ("second-block", "unknown kind 'second-block'"), ("first-block:", None), ("first-block:abc", "a number > 0"),
    ("first-block:0", "a number > 0"), ("first-block:-1", "a number > 0"), ("first-block:inf", "a number > 0"),
    (3, "give first-block"), ("taylorseer:0", "from 1 to 1000"), ("taylorseer:x", "'x' is not a whole number"),
    ("taylorseer:5:9", "from 0 to 4"), ("taylorseer:5:-1", "from 0 to 4"), ("taylorseer:2.5", "not a whole")])
def test_bad_cache_specs_are_one_line(spec, match):
    if match is None:
        assert parse(spec).threshold == 0.05      # "first-block:" is the default threshold
        return
    with pytest.raises(MlxdiffError, match=match) as e:
        parse(spec)
    assert "\n" not in str(e.value)


def test_parse_gives_a_fresh_cache():
    assert parse(None) is None
    given = FirstBlockCache(0.3)
    given.context("cond").reused.append(True)
    fresh = parse(given)
    assert fresh is not given and fresh.threshold == 0.3 and not fresh.contexts
    assert parse("first-block").threshold == 0.05 and parse(" first-block:0.2").threshold == 0.2
    ts = parse("taylorseer")
    assert (ts.interval, ts.order) == (5, 1) and (parse("taylorseer:3:2").interval, parse("taylorseer:3:2").order) == (3, 2)
    ts.forward("cond", lambda cache: 1.0)
    again = parse(ts)
    assert again is not ts and not again.contexts and (again.interval, again.order) == (5, 1)


def test_cli_cache_bad_and_good(tmp_path):
    from adversarial import run_cases
    bad, good = run_cases([gen(tmp_path / "bad.png", "--cache", "first-block:fast"),
                           gen(tmp_path / "good.png", "--cache", "first-block:0.3", "--steps", "3")], tmp_path)
    assert_refused(bad, "first-block:fast", "a number > 0")
    assert not (tmp_path / "bad.png").exists()
    assert good.rc == 0, good.describe()
    assert "first-block cache (threshold 0.3): remaining blocks skipped in" in good.stdout
    assert (tmp_path / "good.png").exists()
