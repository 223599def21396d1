"""Tokenizer parity with the real CLIP and T5 vocabularies (bundled in mlxdiff/assets; the same files as
../shared/fixtures/tokenizers), padded and truncated as diffusers' StableDiffusion3Pipeline does."""

import numpy as np
import pytest

from mlxdiff.tokenizers import bundled_clip_tokenizer, bundled_t5_tokenizer, tokenize
from helpers import ASSETS, FIXTURES

LONG = "a highly detailed photograph of a small red fox sitting in fresh snow under pine trees " * 20


def test_bundled_vocabularies_are_the_fixtures():
    if not FIXTURES.exists():
        pytest.skip("../shared/fixtures not present on this machine (the bundled copies are still tested below)")
    for rel in ("clip/vocab.json", "clip/merges.txt", "t5/tokenizer.json"):
        assert (ASSETS / rel).read_bytes() == (FIXTURES / rel).read_bytes(), rel


def test_known_ids():
    # reference ids from ../shared/fixtures/tokenizers/README.md (open_clip's and HF T5's tokenizers)
    assert bundled_clip_tokenizer("<|endoftext|>")("A photo of a cat").input_ids == \
        [49406, 320, 1125, 539, 320, 2368, 49407]
    assert bundled_t5_tokenizer()("A photo of a cat").input_ids == [71, 1202, 13, 3, 9, 1712, 1]


def test_padding_as_sd3():
    truncated = []
    l_ids = tokenize(bundled_clip_tokenizer("<|endoftext|>"), ["a cat"], 77, truncated)
    g_ids = tokenize(bundled_clip_tokenizer("!"), ["a cat"], 77, truncated)
    t_ids = tokenize(bundled_t5_tokenizer(), ["a cat"], 256, truncated)
    assert l_ids.shape == g_ids.shape == (1, 77) and t_ids.shape == (1, 256)
    assert list(l_ids[0, :4]) == [49406, 320, 2368, 49407] and (l_ids[0, 4:] == 49407).all()   # CLIP-L pads with EOS
    assert list(g_ids[0, :4]) == [49406, 320, 2368, 49407] and (g_ids[0, 4:] == 0).all()       # CLIP-G pads with "!"
    assert list(t_ids[0, :4]) == [3, 9, 1712, 1] and (t_ids[0, 4:] == 0).all()                  # T5 pads with <pad>
    assert truncated == []


def test_long_prompts_truncate_like_diffusers(sd3_tiny):
    """Same ids as diffusers' own tokenizer calls in _get_clip_prompt_embeds / _get_t5_prompt_embeds."""
    _, pipe = sd3_tiny
    truncated = []
    for tok, n in ((pipe.tokenizer, 77), (pipe.tokenizer_2, 77), (pipe.tokenizer_3, 256)):
        ref = tok([LONG], padding="max_length", max_length=n, truncation=True, add_special_tokens=True,
                  return_tensors="np").input_ids
        ours = tokenize(tok, [LONG], n, truncated)
        assert np.array_equal(ours, ref)
        assert ours[0, -1] == (49407 if n == 77 else 1)  # the end token survives truncation
    assert len(truncated) == 3  # every encoder saw the cut; the pipeline reports it once (test_sd3_pipeline)
