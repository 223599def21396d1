"""Tokenization through transformers, exactly as the diffusers pipelines call it."""

import sys
from pathlib import Path

import numpy as np

from .errors import MlxdiffError

ASSETS = Path(__file__).parent / "assets" / "tokenizers"


def load_tokenizer(folder, class_name=None):
    """A transformers tokenizer from a pipeline's `tokenizer*/` folder (class from model_index.json)."""
    import transformers
    folder = Path(folder)
    if not folder.is_dir():
        raise MlxdiffError(f"{folder}: tokenizer folder is missing; the model folder is incomplete")
    cls = getattr(transformers, class_name or "AutoTokenizer", None) or transformers.AutoTokenizer
    try:
        return cls.from_pretrained(str(folder))
    except (OSError, ValueError) as e:
        raise MlxdiffError(f"{folder}: cannot load the tokenizer ({str(e).splitlines()[0]})") from None


def bundled_clip_tokenizer(pad_token):
    """The real CLIP BPE tokenizer shipped with mlxdiff (for single files, which carry no tokenizer).
    SD3's CLIP-L tokenizer pads with <|endoftext|>, CLIP-G with "!"."""
    from transformers import CLIPTokenizer
    return CLIPTokenizer(str(ASSETS / "clip" / "vocab.json"), str(ASSETS / "clip" / "merges.txt"),
                         model_max_length=77, pad_token=pad_token)


def bundled_t5_tokenizer():
    from transformers import T5TokenizerFast
    return T5TokenizerFast(tokenizer_file=str(ASSETS / "t5" / "tokenizer.json"), model_max_length=512)


def tokenize(tokenizer, prompts, max_length, truncated: list):
    """Pad to max_length and truncate, as diffusers' _get_clip_prompt_embeds / _get_t5_prompt_embeds do.
    Prompts that lost tokens are appended to `truncated` as (prompt, dropped_text)."""
    ids = tokenizer(prompts, padding="max_length", max_length=max_length, truncation=True,
                    add_special_tokens=True)["input_ids"]
    full = tokenizer(prompts, padding="longest")["input_ids"]
    for prompt, kept, whole in zip(prompts, ids, full):
        if len(whole) > len(kept) or (len(whole) == len(kept) and whole != kept):
            truncated.append((prompt, tokenizer.decode(whole[max_length - 1:-1])))
    return np.array(ids, dtype=np.int32)


def report_truncation(truncated, limits: str):
    """One warning per encode call, however many encoders cut the prompt."""
    if truncated:
        dropped = truncated[0][1]
        print(f"mlxdiff: warning: prompt longer than the text encoders' limit ({limits}); this part was dropped: "
              f"{dropped!r}", file=sys.stderr)
