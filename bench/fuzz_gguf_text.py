"""GGUF text-encoder metadata mutants for bench/fuzz_readers.py (`--format gguf-text`; issue 30).

    python bench/fuzz_readers.py --format gguf-text --n 10000 --seed 1

The base files are two tiny llama.cpp GGUFs of FLUX.2's text encoders, with the metadata convert_hf_to_gguf.py
writes: a Mistral decoder (general.architecture "llama", q/k rows permuted) and a Qwen3 one ("qwen3", with q/k
norms). A mutant is the base's metadata edited 1 to 3 times, structure-aware, and the file written whole again
(so every mutant is a well-formed GGUF: the header-level corruptions are `--format gguf`'s): a key the encoder
reads (head counts, key/value lengths, rope base, rms epsilon, context length, widths, block count, the
architecture) retyped (string, bool, float for an integer, integer for a float, arrays of the right and wrong
lengths, negative, every integer width), set to an absurd or off-by-one value (0, 1e30, NaN, heads that do not
divide the width, odd head sizes, past the limits), deleted, or moved under another architecture's prefix.

Ours: `sources.text_encoder_from_file` (taps 1 and 2), then the encoder built and run on 8 tokens (the output must
be finite, of the tapped width). The reference is gguf-py's GGUFReader reading the same bytes, with the rules of
what such a file may hold written out here independently of mlxdiff: llama.cpp's types (integers for counts and
lengths, head counts also as one equal value per layer, float32/64 for the rope base and epsilon: its loader
refuses a key of another type), the limits of a config (each well above the largest released model), the
hyperparameters the tensors' shapes also give agreeing with them, and what the shapes need (a head size for the
Mistral, found from key_length or the head count; a rope base; an epsilon). It gives either the config the
encoder must have (head size, heads, KV heads, rope base, epsilon, context length, q/k order) or the keys that
make the file invalid.

Outcome classes: `refused (reference refuses too)` (one line naming the file and one of the keys the reference
finds bad), `refused (reference accepts)` (a check the reference does not make; listed), `loaded = reference`;
not acceptable: `WRONG: loaded, the reference refuses` (a silently coerced or trusted value), `WRONG: differs
from the reference`, `WRONG: refused naming none of the bad keys`, `WRONG: not finite` (the forward), `exception`,
`unclean error`, `hang`, `crash`.
"""

import math
import random
import re
import struct
from pathlib import Path

import mlxdiff  # noqa: F401  (OpenBLAS preload before mlx)
import mlx.core as mx
import numpy as np
from gguf import GGUFReader, GGUFValueType as V

from mlxdiff.errors import MlxdiffError
from mlxdiff.loading.sources import text_encoder_from_file   # imported once, before the children fork

TAPS = (1, 2)
TOKENS = 8
# the two base decoders: widths, heads, layers (tiny; both 2 layers)
KINDS = {
    "mistral": dict(arch="llama", hidden=64, heads=4, kv=2, head_dim=16, inter=96, vocab=128, layers=2,
                    theta=1e6, eps=1e-5, context=128),
    "qwen3": dict(arch="qwen3", hidden=64, heads=4, kv=2, head_dim=16, inter=80, vocab=96, layers=2,
                  theta=1e6, eps=1e-6, context=256),
}
INTS = (V.UINT8, V.INT8, V.UINT16, V.INT16, V.UINT32, V.INT32, V.UINT64, V.INT64)
FLOATS = (V.FLOAT32, V.FLOAT64)
FORMATS = {V.UINT8: "B", V.INT8: "b", V.UINT16: "H", V.INT16: "h", V.UINT32: "I", V.INT32: "i", V.FLOAT32: "f",
           V.BOOL: "?", V.UINT64: "Q", V.INT64: "q", V.FLOAT64: "d"}
RANGES = {V.UINT8: (0, 255), V.INT8: (-128, 127), V.UINT16: (0, 65535), V.INT16: (-32768, 32767),
          V.UINT32: (0, 2 ** 32 - 1), V.INT32: (-2 ** 31, 2 ** 31 - 1), V.UINT64: (0, 2 ** 64 - 1),
          V.INT64: (-2 ** 63, 2 ** 63 - 1)}

# The reference's table: key (under "<arch>.") -> (kind, lowest, highest, exclusive low, one per layer allowed).
# The limits are a config's (mlxdiff/config_checks.py documents them: each well above the largest released
# model); written here, not imported, so that the reference does not share the code under test.
SPEC = {
    "attention.key_length": ("int", 1, 1024, False, False),
    "attention.value_length": ("int", 1, 1024, False, False),
    "attention.head_count": ("int", 1, 1024, False, True),
    "attention.head_count_kv": ("int", 1, 1024, False, True),
    "embedding_length": ("int", 1, 1 << 16, False, False),
    "feed_forward_length": ("int", 1, 1 << 16, False, True),
    "block_count": ("int", 1, 1024, False, False),
    "vocab_size": ("int", 1, 1 << 20, False, False),
    "context_length": ("int", 1, 1 << 24, False, False),
    "rope.freq_base": ("float", 1.0, 1e12, False, False),
    "attention.layer_norm_rms_epsilon": ("float", 0.0, 1.0, True, False),
}
ARCHS = {"mistral": ("llama", "mistral", "mistral3"), "qwen3": ("qwen3",)}


# ---------------------------------------------------------------------------------------------------------------
# Writing: metadata as [(key, type, value, item type)], tensors F32, exactly (gguf-py's writer types values itself)

def _value(vtype, value, item=None) -> bytes:
    if vtype == V.STRING:
        raw = value.encode("utf-8", "surrogatepass") if isinstance(value, str) else value
        return struct.pack("<Q", len(raw)) + raw
    if vtype == V.ARRAY:
        return struct.pack("<IQ", item, len(value)) + b"".join(_value(item, v) for v in value)
    return struct.pack("<" + FORMATS[vtype], value)


def write(path, metadata, tensors):
    """A GGUF v3: `metadata` [(key, vtype, value, item type)], `tensors` {name: float32 array} (PyTorch order)."""
    out = [b"GGUF", struct.pack("<IQQ", 3, len(tensors), len(metadata))]
    for key, vtype, value, item in metadata:
        raw = key.encode()
        out += [struct.pack("<Q", len(raw)), raw, struct.pack("<I", vtype), _value(vtype, value, item)]
    offset, data = 0, []
    for name, array in tensors.items():
        raw = name.encode()
        out += [struct.pack("<Q", len(raw)), raw, struct.pack("<I", array.ndim),
                struct.pack(f"<{array.ndim}Q", *reversed(array.shape)), struct.pack("<IQ", 0, offset)]
        blob = np.ascontiguousarray(array, "<f4").tobytes()
        blob += b"\0" * (-len(blob) % 32)
        data.append(blob)
        offset += len(blob)
    header = b"".join(out)
    Path(path).write_bytes(header + b"\0" * (-len(header) % 32) + b"".join(data))
    return path


def base(kind):
    """(metadata, tensors) of a base decoder, as convert_hf_to_gguf.py names and describes it (random weights)."""
    d = KINDS[kind]
    arch = d["arch"]
    rng = np.random.default_rng(30 + len(kind))
    q_out, kv_out = d["heads"] * d["head_dim"], d["kv"] * d["head_dim"]
    w = lambda *shape: (rng.standard_normal(shape) * 0.05).astype(np.float32)
    tensors = {"token_embd.weight": w(d["vocab"], d["hidden"]),
               "output_norm.weight": 1 + w(d["hidden"])}
    for i in range(d["layers"]):
        b = f"blk.{i}."
        tensors.update({b + "attn_norm.weight": 1 + w(d["hidden"]), b + "attn_q.weight": w(q_out, d["hidden"]),
                        b + "attn_k.weight": w(kv_out, d["hidden"]), b + "attn_v.weight": w(kv_out, d["hidden"]),
                        b + "attn_output.weight": w(d["hidden"], q_out), b + "ffn_norm.weight": 1 + w(d["hidden"]),
                        b + "ffn_gate.weight": w(d["inter"], d["hidden"]),
                        b + "ffn_up.weight": w(d["inter"], d["hidden"]), b + "ffn_down.weight": w(d["hidden"], d["inter"])})
        if kind == "qwen3":
            tensors.update({b + "attn_q_norm.weight": 1 + w(d["head_dim"]),
                            b + "attn_k_norm.weight": 1 + w(d["head_dim"])})
    u32 = lambda key, v: (f"{arch}.{key}", V.UINT32, v, None)
    f32 = lambda key, v: (f"{arch}.{key}", V.FLOAT32, v, None)
    metadata = [("general.architecture", V.STRING, arch, None), ("general.name", V.STRING, f"tiny {kind}", None),
                u32("block_count", d["layers"]), u32("context_length", d["context"]),
                u32("embedding_length", d["hidden"]), u32("feed_forward_length", d["inter"]),
                u32("attention.head_count", d["heads"]), u32("attention.head_count_kv", d["kv"]),
                f32("rope.freq_base", d["theta"]), f32("attention.layer_norm_rms_epsilon", d["eps"]),
                u32("attention.key_length", d["head_dim"]), u32("attention.value_length", d["head_dim"]),
                u32("vocab_size", d["vocab"]),
                ("tokenizer.ggml.model", V.STRING, "gpt2", None),
                ("tokenizer.ggml.tokens", V.ARRAY, ["a", "b", "<s>"], V.STRING)]
    return metadata, tensors


# ---------------------------------------------------------------------------------------------------------------
# Mutations of the metadata list

ARCH_NAMES = ["llama", "mistral", "mistral3", "qwen3", "qwen2", "gpt2", "", "LLAMA", "llama\0", "x" * 300, "t5"]


def _fits(entry) -> bool:
    """Whether an integer (or integer array) encoding holds its value(s): an edit of an earlier edit's extreme value
    (-(2^64 - 1) as int64) cannot be written at all."""
    t, v, item = entry
    rng_ = RANGES.get(item if t == V.ARRAY else t)
    values = v if t == V.ARRAY else [v]
    return rng_ is None or all(isinstance(x, bool) or not isinstance(x, int) or rng_[0] <= x <= rng_[1]
                               for x in values)


def _retypes(rng, vtype, value, layers):
    """Other encodings of a value: every integer width, float for an integer, integer for a float, string, bool,
    arrays of the right and wrong length."""
    if vtype == V.STRING:
        return [(V.UINT32, 1, None), (V.ARRAY, [value], V.STRING), (V.BOOL, True, None)]
    if vtype in FLOATS:
        v = float(value)
        whole = int(v) if math.isfinite(v) and 0 <= v < 2 ** 32 else 7
        return [(V.FLOAT64, v, None), (V.UINT32, whole, None), (V.INT32, 1, None),
                (V.STRING, repr(v), None), (V.BOOL, True, None), (V.ARRAY, [v] * layers, V.FLOAT32),
                (V.ARRAY, [], V.FLOAT32)]
    v = int(value)
    out = [(t, v, None) for t in INTS if RANGES[t][0] <= v <= RANGES[t][1]]
    out += [(V.FLOAT32, float(v), None), (V.FLOAT64, float(v) + 0.5, None), (V.STRING, str(v), None),
            (V.BOOL, True, None), (V.BOOL, False, None), (V.INT64, -v, None)]
    items = [(t, xs, t) for t in (V.UINT32, V.INT32, V.UINT8, V.INT64) for xs in ([v] * layers,)]
    out += [(V.ARRAY, xs, t) for _, xs, t in items if all(RANGES[t][0] <= x <= RANGES[t][1] for x in xs)]
    v = v if 0 <= v < 2 ** 32 - 1 else 4   # the arrays below are of uint32
    out += [(V.ARRAY, [v] * (layers + 1), V.UINT32), (V.ARRAY, [v, v + 1][:layers], V.UINT32),
            (V.ARRAY, [v] * layers, V.FLOAT32), (V.ARRAY, [str(v)] * layers, V.STRING), (V.ARRAY, [], V.UINT32),
            (V.ARRAY, [True] * layers, V.BOOL)]
    return out


def _absurd(rng, vtype, value):
    """Values of the same type: edges, off-by-one, out of range, non-finite."""
    if vtype in FLOATS:
        v = float(value)
        return [(vtype, x, None) for x in (0.0, -0.0, -1.0, 1e30, 1e-30, 1e-45, math.inf, -math.inf, math.nan,
                                           1e12, 1.5e12, 0.5, 1.0, 2.0, 1e9, v * 10, v / 10, 3.4e38)]
    v = int(value)
    picks = [0, 1, 2, 3, 5, 6, 7, 8, 12, 32, 64, 128, 1024, 1025, v - 1, v + 1, 2 * v, v // 2, 1 << 16,
             (1 << 16) + 1, 1 << 20, 1 << 24, (1 << 24) + 1, 2 ** 31 - 1, 2 ** 32 - 1]
    out = [(V.UINT32, x, None) for x in picks if 0 <= x < 2 ** 32]
    out += [(V.UINT64, x, None) for x in (2 ** 32, 2 ** 63, 2 ** 64 - 1, 10 ** 19)]
    out += [(V.INT64, x, None) for x in (-1, -v, -2 ** 31)]
    return out


def mutate(metadata, rng, kind):
    """One edit of the metadata list -> (new list, description)."""
    meta = list(metadata)
    d = KINDS[kind]
    arch = next((v for k, t, v, _ in meta if k == "general.architecture" and t == V.STRING), d["arch"])
    read = [i for i, (k, _, _, _) in enumerate(meta) if k.startswith(f"{arch}.") or k == "general.architecture"]
    op = rng.random()
    if not read or op < 0.08:   # the architecture: another name, its keys left or moved along
        new = rng.choice(ARCH_NAMES)
        move = rng.random() < 0.5
        out = []
        for k, t, v, item in meta:
            if k == "general.architecture":
                out.append((k, V.STRING, new, None))
            elif move and k.startswith(f"{arch}."):
                out.append((new + k[len(arch):], t, v, item))
            else:
                out.append((k, t, v, item))
        if not any(k == "general.architecture" for k, *_ in meta):
            out.insert(0, ("general.architecture", V.STRING, new, None))
        return out, f"general.architecture = {new[:20]!r}" + (", keys moved" if move else "")
    i = rng.choice(read)
    key, vtype, value, item = meta[i]
    if vtype in (V.ARRAY, V.BOOL):   # an earlier edit's array or bool: edit it as the number it stood for
        value = next((x for x in (value if vtype == V.ARRAY else [value]) if isinstance(x, (int, float))
                      and not isinstance(x, bool)), 4)
        vtype = V.FLOAT32 if isinstance(value, float) else V.UINT32
    if op < 0.35:
        t, v, it = rng.choice([e for e in _retypes(rng, vtype, value, d["layers"]) if _fits(e)])
        meta[i] = (key, t, v, it)
        return meta, f"{key} retyped: {V(t).name}{'[' + V(it).name + ']' if it is not None else ''} {str(v)[:30]}"
    if op < 0.78:
        if vtype in INTS or vtype in FLOATS:
            t, v, it = rng.choice([e for e in _absurd(rng, vtype, value) if _fits(e)])
        else:
            t, v, it = rng.choice([(V.STRING, x, None) for x in ARCH_NAMES])
        meta[i] = (key, t, v, it)
        return meta, f"{key} = {V(t).name} {str(v)[:30]}"
    if op < 0.9:
        del meta[i]
        return meta, f"{key} deleted"
    if op < 0.95:   # the key under another architecture's prefix too (read by neither)
        other = rng.choice([a for a in ("llama", "qwen3", "mistral3", "gpt2") if a != arch])
        meta.append((other + key[len(arch):] if key.startswith(arch) else other + "." + key, vtype, value, item))
        return meta, f"{key} also under {other}."
    # a duplicate key: the writer writes it twice (GGUF forbids it)
    meta.append((key, vtype, value, item))
    return meta, f"{key} written twice"


def mutant(seed, i):
    """(kind, metadata, tensors, description) of mutant i of a seed: a function of (seed, i) alone."""
    rng = random.Random(f"gguf-text-{seed}-{i}")
    kind = rng.choice(sorted(KINDS))
    metadata, tensors = base(kind)
    edits = []
    for _ in range(rng.choices([1, 2, 3], [70, 20, 10])[0]):
        metadata, what = mutate(metadata, rng, kind)
        edits.append(what)
    return kind, metadata, tensors, f"{kind}: " + "; ".join(edits)


# ---------------------------------------------------------------------------------------------------------------
# The reference: gguf-py's reading and the rules written out above

def _read(reader, layers, key, spec):
    """(value, None) or (None, why) for one field by SPEC."""
    kind, lo, hi, exclusive, per_layer = spec
    field = reader.fields[key]
    types = list(field.types)
    if kind == "int" and per_layer and len(types) == 2 and types[0] == V.ARRAY and types[1] in INTS:
        items = [int(x) for x in field.contents()]
        if len(items) != layers or len(set(items)) != 1:
            return None, "per-layer values not one equal value per layer"
        value = items[0]
    elif kind == "int" and len(types) == 1 and types[0] in INTS:
        value = int(field.contents())
    elif kind == "float" and len(types) == 1 and types[0] in FLOATS:
        value = float(field.contents())
    else:
        return None, f"type {[V(t).name for t in types]}"
    if not math.isfinite(value) or value < lo or value > hi or (exclusive and value <= lo):
        return None, f"value {value} outside {lo}..{hi}"
    return value, None


def reference(path):
    """gguf-py's reading of the file -> ("valid", expected config) or ("invalid", {bad key: why})."""
    try:
        reader = GGUFReader(path)
    except KeyError as e:   # gguf-py refuses a key written twice (the GGUF spec forbids it)
        found = re.match(r"Duplicate (\S+) already", str(e.args[0]) if e.args else "")
        if not found:
            raise
        return "invalid", {found.group(1): "written twice"}
    shapes = {t.name: tuple(int(x) for x in reversed(t.shape.tolist())) for t in reader.tensors}
    kind = "qwen3" if "blk.0.attn_q_norm.weight" in shapes else "mistral"
    layers = len({n.split(".")[1] for n in shapes if n.startswith("blk.")})
    bad = {}
    arch = None
    if "general.architecture" in reader.fields:
        f = reader.fields["general.architecture"]
        if list(f.types) != [V.STRING]:
            bad["general.architecture"] = "not a string"
        else:
            arch = f.contents()
            if arch not in ARCHS[kind]:
                bad["general.architecture"] = f"{arch!r} for a {kind} decoder"
    values = {}
    if arch is not None and not bad:
        for key, spec in SPEC.items():
            if f"{arch}.{key}" in reader.fields:
                value, why = _read(reader, layers, f"{arch}.{key}", spec)
                if why:
                    bad[f"{arch}.{key}"] = why
                else:
                    values[key] = value
    full = (lambda key: f"{arch}.{key}") if arch is not None else (lambda key: "general.architecture")
    q_out, hidden = shapes["blk.0.attn_q.weight"]
    kv_out = shapes["blk.0.attn_k.weight"][0]
    inter = shapes["blk.0.ffn_gate.weight"][0]
    vocab = shapes["token_embd.weight"][0]
    head_dim, source = None, None
    if kind == "qwen3":
        head_dim = shapes["blk.0.attn_q_norm.weight"][0]
        if values.get("attention.key_length", head_dim) != head_dim:
            bad[full("attention.key_length")] = "not q_norm's length"
    elif "attention.key_length" in values:
        head_dim, source = values["attention.key_length"], "attention.key_length"
    elif "attention.head_count" in values:
        if q_out % values["attention.head_count"]:
            bad[full("attention.head_count")] = "does not divide q rows"
        else:
            head_dim, source = q_out // values["attention.head_count"], "attention.head_count"
    elif not bad:
        bad[full("attention.key_length")] = "missing: no head size"
    for key in ("rope.freq_base", "attention.layer_norm_rms_epsilon"):
        if key not in values and not bad:
            bad[full(key)] = "missing"
    if head_dim is not None:
        blame = full(source) if source else "blk.0.attn_q_norm.weight"
        if q_out % head_dim or kv_out % head_dim or (q_out // head_dim) % (kv_out // head_dim) or head_dim % 2:
            bad[blame] = f"head size {head_dim} does not fit the q/k rows (or is odd)"
        else:
            agree = {"attention.head_count": q_out // head_dim, "attention.head_count_kv": kv_out // head_dim,
                     "attention.value_length": head_dim, "embedding_length": hidden, "feed_forward_length": inter,
                     "vocab_size": vocab, "block_count": layers}
            for key, want in agree.items():
                if key in values and values[key] != want:
                    bad[full(key)] = f"{values[key]}, the tensors say {want}"
    if bad:
        return "invalid", bad
    expected = {"model_type": "qwen3" if kind == "qwen3" else "mistral3", "head_dim": head_dim,
                "num_attention_heads": q_out // head_dim, "num_key_value_heads": kv_out // head_dim,
                "rope_theta": values["rope.freq_base"], "rms_norm_eps": values["attention.layer_norm_rms_epsilon"],
                "max_position_embeddings": values.get("context_length", (1 << 24) if kind == "qwen3" else None),
                "hidden_size": hidden, "intermediate_size": inter, "vocab_size": vocab,
                "permuted": arch in ("llama", "mistral", "mistral3")}
    return "valid", expected


# ---------------------------------------------------------------------------------------------------------------
# Ours, and the comparison (in the forked child)

def ours(path):
    """What mlxdiff makes of the file: its config's values, its q/k order, and the forward's output."""
    spec = text_encoder_from_file(path, TAPS)
    args = spec.args
    text = args.text_config
    got = {"model_type": args.model_type, "permuted": spec.keymap is not None,
           **{k: text.get(k) for k in ("head_dim", "num_attention_heads", "num_key_value_heads", "rope_theta",
                                       "rms_norm_eps", "max_position_embeddings", "hidden_size",
                                       "intermediate_size", "vocab_size")}}
    model = spec.build()
    ids = np.arange(1, TOKENS + 1, dtype=np.int32)[None] % text["vocab_size"]
    mask = np.ones_like(ids)
    mask[0, :2] = 0   # padded rows too
    out = model(mx.array(ids), mask)
    mx.eval(out)
    return got, np.array(out)


def classify(path):
    try:
        got, out = ours(path)
    except MlxdiffError as e:
        message = str(e)
        if "\n" in message or str(path) not in message:
            return "unclean error", message[:300]
        verdict, detail = reference(path)
        if verdict == "valid":
            return "refused (reference accepts)", message[:600]
        if not any(re.search(re.escape(shown) + r"(?![\w.])", message) for key in detail
                   for shown in (key, repr(key)[1:-1])):   # a key with odd characters is named as its repr
            return "WRONG: refused naming none of the bad keys", f"{message[:400]} / reference: {detail}"
        return "refused (reference refuses too)", message[:600]
    verdict, detail = reference(path)
    if verdict == "invalid":
        return "WRONG: loaded, the reference refuses", f"{detail} / ours: {got}"
    diff = {k: (got[k], v) for k, v in detail.items() if got[k] != v}
    if diff:
        return "WRONG: differs from the reference", str(diff)
    if out.shape != (1, TOKENS, len(TAPS) * detail["hidden_size"]) or not np.isfinite(out).all():
        return "WRONG: not finite", f"output {out.shape}, {int((~np.isfinite(out)).sum())} non-finite"
    return "loaded = reference", ""


# ---------------------------------------------------------------------------------------------------------------
# The run (fuzz_readers.fuzz's loop, on these mutants)

def fuzz(n, seed, workdir, keep, only, run_one, run_mutants) -> dict:
    """`run_one(path)`: fuzz_readers' forked classification; `run_mutants`: its loop over the mutants."""
    workdir = Path(workdir)
    for kind in KINDS:   # the bases themselves load as the reference says
        metadata, tensors = base(kind)
        check = run_one(write(workdir / f"base-{kind}.gguf", metadata, tensors))
        if check["class"] != "loaded = reference":
            raise SystemExit(f"the {kind} base file does not read as the reference: {check}")

    def write_case(i):
        kind, metadata, tensors, what = mutant(seed, i)
        return write(workdir / f"mutant-{i}.gguf", metadata, tensors), what

    return run_mutants("gguf-text", n, seed, only, keep, write_case, run_one)
