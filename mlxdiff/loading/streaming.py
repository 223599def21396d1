"""Below the weights: a component whose weights do not fit the budget runs with some of its repeated blocks
(transformer blocks, encoder layers) left in the file, read, used and dropped in every forward, while as many blocks
as fit stay resident (issue "Below the weights"; figures: bench/RESULTS.md, "Streaming below the weights").

How, for every family and file form alike:
- the file's tensors are grouped by block from their names (the first `<name>.<index>.` of a tensor's name:
  `double_blocks.3.`, `model.layers.7.`, `blk.7.`, `encoder.block.2.`), and each group is checked to map, through
  the component's own key map and sanitize, onto exactly one block of the model (all of its parameters and nothing
  else); a group that does not is simply loaded with the rest;
- the model is built around stand-ins for the groups (formats.open_weights(standins=True): lazy zeros of each
  tensor's loaded form, or a safetensors file's lazy mapping; nothing read), so its layers get their quantized, raw
  or float8 forms; the resident groups' weights are then read into their blocks, the streamed ones wrapped;
- a streamed block (StreamedBlock) reads its group through the same validated readers and the same mapping as a
  resident load (ComponentSpec.weights with the group's names, build.in_model_names, flatten_quantized, the same
  dtype casts), so its weights are the same arrays and a streamed forward gives the numbers of a resident one; the
  next streamed group's bytes are read ahead on a thread (into the page cache: no process memory) while the device
  computes;
- before each streamed read, the file is checked to be the one the plan was made from (FileIdentity: its size,
  modification time, inode and a digest of its header bytes, taken when the plan is made): a file truncated,
  replaced by a rename or rewritten in place under a run stops it in one line, rather than feeding the run the
  wrong bytes at the planned offsets (it ran on, once to an all-black image).

The plan is chosen from the budget and each group's exact loaded size (from the headers): the resident weights,
the streamed blocks in flight (IN_FLIGHT_BLOCKS) and the rest of the component fit the budget less a reserve for the
activations and the caches (half of it, at most RESERVE_BYTES; for a model that says its activations' size,
Model.activation_bytes, that plus an allowance). A budget below that for no resident block at all is
refused, naming the smallest limit that works. Weights that would have to be quantized again at every use (a
float checkpoint with quantize=) are refused with the command that converts them once.
"""

import hashlib
import os
import re
import threading
import time
from dataclasses import dataclass, field, replace

from .. import backend  # noqa: F401  (OpenBLAS preload before mlx)
import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_map_with_path, tree_unflatten

from ..arguments import quantize_setting
from ..errors import MlxdiffError
from ..formats import loaded_nbytes, reuse_headers, tensor_nbytes, tensor_ranges
from ..formats.quantized import flatten_quantized
from ..lora import LoRALinear
from ..memory import GB, RESERVE_BYTES, RESERVE_SHARE, device_cache_bytes, fit_hint, fmt_gb
from .build import check_finite, in_model_names, keep_activations_in
from .matmul import use_strategy
from .spec import NATIVE_KEY

BLOCK_NAME = re.compile(r"(?:^|\.)[A-Za-z_]\w*\.(\d+)\.")
# a model that says how large its activations get (Model.activation_bytes: a text encoder's at its longest prompt)
# keeps that plus this for MLX's cache and a layer's transient float copy (the CPU's matmul of bf16 weights)
KNOWN_ACTIVATIONS_ALLOWANCE = 384 << 20
IN_FLIGHT_BLOCKS = 2      # streamed blocks alive at once: the one computing and the next one read
READ_CHUNK = 16 << 20     # bytes per read of the read-ahead thread


def file_group(name: str):
    """The block a file tensor belongs to, by name ("double_blocks.3" of "double_blocks.3.img_attn.qkv.weight"),
    or None (embedders, norms, heads: loaded with the rest)."""
    m = BLOCK_NAME.search(name)
    return name[:m.end() - 1] if m else None


@dataclass
class Group:
    key: str                  # the file-side block name ("double_blocks.3")
    names: dict               # file -> {tensor names}
    block: str = ""           # the model's block path ("transformer_blocks.3")
    nbytes: int = 0           # loaded bytes
    ranges: list = field(default_factory=list)   # (file, offset, bytes): what reading it reads

    @property
    def all_names(self):
        return set().union(*self.names.values())


@dataclass
class StreamPlan:
    resident: list            # groups read once, into their blocks
    streamed: list            # groups read at every use
    rest_nbytes: int          # the component's other weights
    budget: int
    loose: list = field(default_factory=list)    # groups that map onto no one block: loaded with the rest

    @property
    def streamed_nbytes(self) -> int:
        return sum(g.nbytes for g in self.streamed)

    def note(self, name) -> str:
        total = len(self.resident) + len(self.streamed)
        return (f"{name}: {len(self.streamed)} of its {total} blocks streamed from the file "
                f"({fmt_gb(self.streamed_nbytes)} read per forward), {len(self.resident)} resident, to fit the "
                f"memory budget of {fmt_gb(self.budget)}")


def _module_at(model, path):
    node = model
    for part in path.split("."):
        node = node[int(part)] if isinstance(node, list) else getattr(node, part, None)
        if node is None:
            return None
    return node


def _container(model, path):
    """(list, index) when `path` names an element of a list of blocks in `model`, else None."""
    head, _, index = path.rpartition(".")
    parent = _module_at(model, head) if head else None
    if not index.isdigit() or not isinstance(parent, list) or int(index) >= len(parent):
        return None
    return parent, int(index)


def _is_lora(path) -> bool:
    return any(f".{name}." in f".{path}" for name in ("lora_a", "lora_b", "lora_dora"))


def _block_keys(block) -> set:
    """A block's parameter names as its weights are named before LoRAs wrapped its layers."""
    return {k.replace(".base.", ".") for k, _ in tree_flatten(block.parameters()) if not _is_lora(k)}


def _lora_paths(block) -> set:
    return {path for path, m in block.named_modules() if isinstance(m, LoRALinear)}


def _groups(spec) -> tuple:
    """({file-side block name: Group}, {file: names of the other tensors}) from the headers."""
    groups, rest = {}, {}
    for f in spec.files:
        for name in tensor_nbytes(f):
            if not name.startswith(spec.prefix):
                continue
            key = file_group(name[len(spec.prefix):])
            if key is None:
                rest.setdefault(f, set()).add(name)
            else:
                groups.setdefault(key, Group(key, {})).names.setdefault(f, set()).add(name)
    return groups, rest


def _block_head(key):
    """"transformer_blocks.3" of "transformer_blocks.3.attn.to_q.weight": up to its first index."""
    parts = key.split(".")
    index = next((i for i, p in enumerate(parts) if p.isdigit()), None)
    return None if index is None else ".".join(parts[:index + 1])


def _mapped_block(spec, model, group, native):
    """(the model block the group maps onto, or None; whether it maps onto anything at all), from its stand-ins
    through the key map and sanitize: nothing is read."""
    try:
        weights = spec.weights(model.compute_dtype, names=group.all_names, standins=group.all_names)
        keys = list(flatten_quantized(in_model_names(model, weights, native))[0])
    except MlxdiffError:          # a key map that needs more than the group (FLUX.2's checks of a whole file)
        return None, True
    if not keys:
        return None, False        # e.g. an LLM encoder's layer past its last tapped one: never read
    heads = {_block_head(k) for k in keys}
    head = heads.pop() if len(heads) == 1 else None
    found = _container(model, head) if head else None
    if found is None or {k[len(head) + 1:] for k in keys} != _block_keys(found[0][found[1]]):
        return None, True
    return head, True


def plan(spec, model, budget, native=False):
    """The StreamPlan for `spec` (`model`: built around stand-ins for all its tensors, nothing read) under `budget`
    bytes, in the model's compute dtype; refused in one line if no plan fits."""
    compute_dtype = model.compute_dtype
    groups, rest = _groups(spec)
    blocks, loose = [], []
    for group in groups.values():
        block, used = _mapped_block(spec, model, group, native)
        group.block = block or ""
        if block:
            blocks.append(group)
        elif used:                    # a group that maps onto no one block: read once with the rest
            loose.append(group)
            for f, names in group.names.items():
                rest.setdefault(f, set()).update(names)
    for group in blocks:
        group.nbytes = sum(loaded_nbytes(f, compute_dtype, spec.gguf_layout, names=names)
                           for f, names in group.names.items())
        ranges = {f: tensor_ranges(f) for f in group.names}
        group.ranges = sorted((f, *ranges[f][n]) for f, names in group.names.items() for n in names)
    reads = getattr(spec.arch, "reads_stored", None)   # an LLM encoder's vision tower, say, is never read
    if reads is not None:
        rest = {f: {n for n in names if reads(n[len(spec.prefix):], spec.args)} for f, names in rest.items()}
    rest_nbytes = sum(loaded_nbytes(f, compute_dtype, spec.gguf_layout, names=names) for f, names in rest.items())
    rest_nbytes += spec.lora_nbytes()
    # model order: container by container, index by index
    order = {path: i for i, (path, _) in enumerate(model.named_modules())}
    blocks.sort(key=lambda g: (order.get(g.block, 0), int(g.block.rpartition(".")[2])))
    if not blocks:
        raise MlxdiffError(f"{spec.name} needs {fmt_gb(rest_nbytes)} of weights but the memory budget is "
                           f"{fmt_gb(budget)}, and it has no repeated blocks to stream; {fit_hint(spec, budget)}")
    first = set(getattr(model, "resident_blocks", tuple)())   # read outside their own call: never streamed
    largest = max(g.nbytes for g in blocks)
    floor = rest_nbytes + sum(g.nbytes for g in blocks if g.block in first) + IN_FLIGHT_BLOCKS * largest
    reserve = min(RESERVE_SHARE * budget, RESERVE_BYTES)
    known = getattr(model, "activation_bytes", None)
    if known is not None:
        reserve = min(reserve, known(compute_dtype) + KNOWN_ACTIVATIONS_ALLOWANCE + device_cache_bytes())
    room = budget - reserve - floor
    if room < 0:
        if known is not None:
            smallest = floor + known(compute_dtype) + KNOWN_ACTIVATIONS_ALLOWANCE + device_cache_bytes()
        else:
            smallest = 2 * floor if floor <= RESERVE_BYTES else floor + RESERVE_BYTES
        raise MlxdiffError(f"{spec.name}: a memory limit of {fmt_gb(budget)} cannot hold even its streamed form "
                           f"({fmt_gb(floor)} of weights at once: the non-repeated weights and "
                           f"{IN_FLIGHT_BLOCKS} blocks of {fmt_gb(largest)} in flight, plus room for the "
                           f"activations); the smallest limit that works is about {fmt_gb(smallest)}, or "
                           f"{fit_hint(spec, budget)}")
    resident, streamed = [], []
    for g in blocks:
        if g.block in first:
            resident.append(g)
        elif g.nbytes <= room:
            room -= g.nbytes
            resident.append(g)
        else:
            streamed.append(g)
    return StreamPlan(resident, streamed, rest_nbytes, budget, loose)


@dataclass(frozen=True)
class FileIdentity:
    """What a streamed run planned from, per file: its size, modification time, inode (and device) and a digest
    of its header bytes (up to the first tensor's data, the part the plan's offsets come from)."""
    path: str
    size: int
    mtime_ns: int
    inode: tuple
    header_end: int
    header_digest: bytes

    @classmethod
    def of(cls, path) -> "FileIdentity":
        path = str(path)
        st = os.stat(path)
        end = min((offset for offset, _ in tensor_ranges(path).values()), default=0)
        return cls(path, st.st_size, st.st_mtime_ns, (st.st_dev, st.st_ino), end, _header_digest(path, end))

    def check(self) -> None:
        """Before each read: the file is still the one planned from, else one line saying what changed."""
        try:
            st = os.stat(self.path)
        except OSError as e:
            reason = f"is gone ({e.strerror or e})"
        else:
            reason = None
            if (st.st_dev, st.st_ino) != self.inode:
                reason = "was replaced by another file (a rename or a copy over its name)"
            elif st.st_size != self.size:
                reason = f"was {'truncated' if st.st_size < self.size else 'extended'} from {self.size} to " \
                         f"{st.st_size} bytes"
            elif st.st_mtime_ns != self.mtime_ns:
                reason = "was rewritten in place (its modification time changed)"
            elif not os.access(self.path, os.R_OK, effective_ids=os.access in os.supports_effective_ids):
                reason = "can no longer be read (its permissions changed)"
            elif _header_digest(self.path, self.header_end) != self.header_digest:
                reason = "was rewritten in place (its header changed)"
        if reason:
            raise MlxdiffError(f"{self.path}: {reason} while this run was streaming its blocks; the run is stopped "
                               "and nothing was written. Run again once the file is complete and left alone")


def _header_digest(path, end) -> bytes:
    try:
        with open(path, "rb") as f:
            return hashlib.blake2b(f.read(end), digest_size=16).digest()
    except OSError:
        return b""


def file_identities(spec) -> dict:
    """{file: FileIdentity} of a spec's regular weight files (a Core ML package, a folder, is not streamed from a
    range of one file)."""
    return {f: FileIdentity.of(f) for f in spec.files if os.path.isfile(f)}


class ReadAhead:
    """Reads a group's byte ranges on a background thread, into the page cache (each chunk read and dropped: no
    process memory), so that the device computes one block while the file gives the next."""

    def __init__(self):
        self._thread, self._fds = None, {}

    def _fd(self, path):
        if path not in self._fds:
            self._fds[path] = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        return self._fds[path]

    def _read(self, ranges):
        # one reused buffer: the read-ahead holds READ_CHUNK bytes of the process's memory, not a new one per read
        view = memoryview(bytearray(READ_CHUNK))
        try:
            for path, offset, n in ranges:
                fd = self._fd(path)
                end = offset + n
                while offset < end:
                    got = os.preadv(fd, [view[:min(READ_CHUNK, end - offset)]], offset)
                    if not got:
                        break
                    offset += got
        except OSError:   # read-ahead only: the real read, through the checked readers, reports what is wrong
            pass

    def start(self, ranges):
        self.wait()
        if not ranges:
            return
        self._thread = threading.Thread(target=self._read, args=(ranges,), daemon=True,
                                        name="mlxdiff-read-ahead")
        self._thread.start()

    def wait(self):
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def close(self):
        self.wait()
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    __del__ = close


class BlockStream:
    """The streamed groups of one loaded component: reads a group's weights into its block for one call, drops
    them after, reads the next group ahead; counts what it read and how long it waited."""

    def __init__(self, spec, model, groups, native, identities=None):
        self.spec, self.model, self.groups = spec, model, groups
        self.identities = identities or {}     # {file: FileIdentity}: checked before each read
        self.compute_dtype, self.native = model.compute_dtype, native   # the build's, whatever phase reads later
        self.next_of = {g.key: groups[(i + 1) % len(groups)] for i, g in enumerate(groups)}
        self.read_ahead = ReadAhead()
        self.headers = {}      # each GGUF header parsed once (formats.reuse_headers)
        self.checked = set()
        self.reset()

    def reset(self):
        self.bytes_read, self.seconds_reading, self.forwards = 0, 0.0, 0

    def summary(self, name) -> str:
        """What a phase read: bytes per forward and the rate reached (bytes over the time the forwards waited for
        them: read-ahead that kept up with the device makes this high)."""
        per = self.bytes_read / max(1, self.forwards)
        rate = self.bytes_read / self.seconds_reading if self.seconds_reading else float("inf")
        return (f"{name}: read {fmt_gb(per)} of streamed blocks per forward ({self.forwards} forwards), "
                f"{rate / GB:.2f} GB/s over the {self.seconds_reading:.1f} s spent waiting for and mapping them")

    def weights_of(self, group, block) -> dict:
        """{parameter path in `block` (the model for a loose group): array} of `group`, read and mapped as a
        resident load maps them."""
        with reuse_headers(self.headers):
            weights = self.spec.weights(self.compute_dtype, names=group.all_names)
        flat, _ = flatten_quantized(in_model_names(self.model, weights, self.native))
        wrapped = _lora_paths(block)
        skip = len(group.block) + 1 if group.block else 0
        out = {}
        for key, value in flat.items():
            local = key[skip:]
            layer, _, leaf = local.rpartition(".")
            # a group that is one LoRA-wrapped layer (Qwen-Image 2.1's modulation.1): its own path is ""
            out[f"{layer}.base.{leaf}".lstrip(".") if layer in wrapped else local] = value
        return out

    def load(self, group, block):
        start = time.perf_counter()
        self.read_ahead.wait()
        for f in group.names:
            if f in self.identities:
                self.identities[f].check()
        # the next group is read while this one is mapped, converted and computed
        self.read_ahead.start(self.next_of[group.key].ranges)
        block.update(tree_unflatten(list(self.weights_of(group, block).items())))
        stored = keep_activations_in(block, self.compute_dtype)
        if group.key not in self.checked:    # the small tensors' values, once per block (as a resident load)
            check_finite(block, self.spec.source, stored, compute_dtype=self.compute_dtype)
            self.checked.add(group.key)
        self.bytes_read += group.nbytes
        self.forwards += group is self.groups[0]
        self.seconds_reading += time.perf_counter() - start

    def close(self):
        self.read_ahead.close()


class StreamedBlock(nn.Module):
    """A block whose weights live in the file: each call reads them in (BlockStream.load), runs the block and lets
    them go (the stand-ins back); the arrays stay alive only as long as the call's lazy output needs them. The block
    itself is kept out of the module tree, so that nothing evaluates or counts its stand-ins."""

    def __init__(self, block, stream, group):
        super().__init__()
        # fresh lazy zeros for the stand-ins (the build's value checks evaluated the small ones); LoRA factors stay
        standins = tree_map_with_path(
            lambda path, a: a if _is_lora(path) else mx.zeros(a.shape, a.dtype), block.parameters())
        block.update(standins)
        self.__dict__.update(_block=block, _stream=stream, _group=group, _standins=standins)

    def __call__(self, *args, **kwargs):
        return self.call_with(lambda block, *a, **k: block(*a, **k), *args, **kwargs)

    def call_with(self, fn, *args, **kwargs):
        """fn(the block with its weights read in, *args): a call, or a computation with the block's parts
        (models/fused.through)."""
        block = self.__dict__["_block"]
        self.__dict__["_stream"].load(self.__dict__["_group"], block)
        try:
            return fn(block, *args, **kwargs)
        finally:
            block.update(self.__dict__["_standins"])

    def _extra_repr(self):
        group = self.__dict__["_group"]
        return f"streamed from {group.key} ({fmt_gb(group.nbytes)})"


def _read_into(stream, group, module, source):
    module.update(tree_unflatten(list(stream.weights_of(group, module).items())))
    stored = keep_activations_in(module, stream.compute_dtype)
    check_finite(module, source, stored, compute_dtype=stream.compute_dtype)
    mx.eval(module.parameters())


def load_streamed(spec, budget, strategy):
    """(model, plan): `spec`'s model, in the installed policy's compute dtype (ComponentSpec.build), with the plan's
    resident blocks read (and its quantized layers given `strategy`, loading/matmul.py) and its streamed blocks
    wrapped (nothing of them read here). The model's `block_stream` counts what the streamed blocks read."""
    if spec.quantize:
        raise MlxdiffError(f"{spec.name}: its weights do not fit the memory budget of {fmt_gb(budget)} and would "
                           "have to be quantized again at every step to be streamed; quantize them once: "
                           f"python -m mlxdiff.convert MODEL DEST --quantize {spec.name}={quantize_setting(spec.quantize).text}, "
                           "then use DEST")
    native = bool(spec.config.get(NATIVE_KEY))
    identities = file_identities(spec)     # what the plan is made from: each later read checks it still is
    everything = frozenset(n for f in spec.files for n in tensor_nbytes(f))
    # planned on a model built around stand-ins for everything (nothing read; without LoRAs, which the real build
    # reads once below: a block's parameters are compared as named before LoRAs wrap its layers)
    probe = replace(spec, loras=()).build(standins=everything, check=False)
    streaming = plan(spec, probe, budget, native)
    # built again, for real, around stand-ins for the block groups only (unread: the values checked below)
    blocks = frozenset().union(*(g.all_names for g in streaming.resident + streaming.streamed))
    model = spec.build(standins=blocks, check=False)
    use_strategy(model, strategy)
    stream = BlockStream(spec, model, streaming.streamed, native, identities)
    for group in streaming.resident:
        parent, index = _container(model, group.block)
        _read_into(stream, group, parent[index], spec.source)
    for group in streaming.streamed:
        parent, index = _container(model, group.block)
        parent[index] = StreamedBlock(parent[index], stream, group)
    check_finite(model, spec.source)   # the rest and the resident blocks
    model.streamed_blocks = len(streaming.streamed)
    model.block_stream = stream
    return model, streaming
