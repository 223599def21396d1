"""A hub id (`org/name`) -> a snapshot folder in the Hugging Face cache that holds what this run reads, downloaded
through huggingface_hub (its cache, its resumed transfers, its progress bars, HF_ENDPOINT / HF_HOME / HF_TOKEN /
HF_HUB_OFFLINE). Only the files the run reads are fetched: model_index.json first, then, for each component the
model's family reads from it (`reads`: pipelines.detect's answer from the family's layouts), the folder's small
files (configs, tokenizer files) and its safetensors weights of the chosen variant, never .bin weights, never a
component the family does not read, and no weights of a component a user's file replaces. docs/downloads.md says
how it is used. Every failure a user can meet (gated, missing, offline, no network, a full disk) is one MlxdiffError
line saying what to do.
"""

import errno
import glob
import re
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

import httpx2   # huggingface_hub's HTTP client: a transfer that failed after its retries raises its errors
from huggingface_hub import constants, get_cached_repo_tree, get_token, snapshot_download
from huggingface_hub.errors import (CachedRepoTreeNotFoundError, GatedRepoError, HfHubHTTPError, HFValidationError,
                                    IncompleteSnapshotError, LocalEntryNotFoundError, RepositoryNotFoundError,
                                    RevisionNotFoundError)
from huggingface_hub.utils import validate_repo_id

from ..errors import MlxdiffError
from ..formats import safetensors as st

INDEX = "model_index.json"
INDEXES = (INDEX, "modular_model_index.json")   # a diffusers pipeline; a modular one (FLUX 3) saves only the second
# a component's weights in formats mlxdiff does not read from a folder (PyTorch pickles, Flax, ONNX, ...): never
# fetched; its safetensors are the weights
OTHER_WEIGHTS = (".bin", ".ckpt", ".pt", ".pth", ".msgpack", ".h5", ".onnx", ".onnx_data", ".pb", ".tflite", ".ot",
                 ".gguf", ".mlmodel", ".npz", ".pkl")
SMALL_FILE_BYTES = 256 << 20   # a component's other files are configs and tokenizers (tens of MB at most)
SHARD = re.compile(r"-\d{5}-of-\d{5}$")                       # transformers' / diffusers' shard suffix
INDEX_FILE = re.compile(r"^[^.]+\.safetensors\.index(?:\.([^.]+))?\.json$")   # diffusers: X.safetensors.index.V.json
VARIANT = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_-]{0,31}$")    # fp16, bf16, non_ema, ...
DISK_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


@dataclass(frozen=True)
class HubRequest:
    """How a hub id is looked up: `download` (False: the local cache only, as `--no-download`), `revision` (a
    branch, tag or commit; None: main) and `variant` (diffusers' weight variant, e.g. "fp16": its files where a
    component has them, the plain ones elsewhere)."""
    download: bool = True
    revision: str | None = None
    variant: str | None = None

    def checked(self) -> "HubRequest":
        if not isinstance(self.download, bool):
            raise MlxdiffError(f"download={self.download!r}: expected True (fetch what is missing) or False (the "
                               "local Hugging Face cache only)")
        for name in ("revision", "variant"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value.strip() or len(value) > 256):
                raise MlxdiffError(f"{name}={value!r}: expected a non-empty string"
                                   + (" (a branch, tag or commit hash)" if name == "revision" else " such as 'fp16'"))
        if self.variant is not None and not VARIANT.match(self.variant):
            raise MlxdiffError(f"variant={self.variant!r}: expected a weight variant's name such as 'fp16' or 'bf16'")
        return self

    def command(self, repo_id) -> str:
        """The `hf download` command that fetches the repo (huggingface_hub 2.x's CLI)."""
        return f"hf download {repo_id}" + (f" --revision {self.revision}" if self.revision else "")


def looks_like_hub_id(model) -> bool:
    return isinstance(model, str) and model.count("/") == 1 and not model.startswith((".", "/", "~"))


def fetch(repo_id: str, request: HubRequest, reads) -> Path:
    """The snapshot folder of `repo_id` at `request.revision` holding every file this run reads, fetched where
    missing (unless request.download is False). `reads(folder)`: given a folder holding model_index.json, the
    components the run reads from it, {component: whether its weights are read} (a replaced one: config only)."""
    request = request.checked()
    try:
        validate_repo_id(repo_id)
    except HFValidationError as e:
        raise MlxdiffError(f"{repo_id!r}: neither a local path nor a valid hub id ({str(e).splitlines()[0]}); give "
                           "ORG/NAME or a folder / file path") from None
    local_only = not request.download
    with one_line(repo_id, request):
        root = Path(snapshot_download(repo_id, revision=request.revision, allow_patterns=list(INDEXES),
                                      local_files_only=local_only))
    index = next((name for name in INDEXES if (root / name).is_file()), None)
    if index is None:
        raise MlxdiffError(f"{repo_id}: has no {INDEX}, so it is not a diffusers pipeline repository; download the "
                           f"file you want (hf download {repo_id} FILE) and give its path")
    components = reads(root)
    sizes = listing(repo_id, root)
    files = needed_files(repo_id, sizes, components, request.variant, index)
    missing = [f for f in files if not (root / f).is_file()]
    if missing:
        if local_only or constants.is_offline_mode():
            raise MlxdiffError(partial(repo_id, request, missing))
        total = sum(sizes[f] or 0 for f in missing)
        print(f"mlxdiff: downloading {len(missing)} of the {len(files)} files this run reads from {repo_id} "
              f"(commit {root.name[:12]}, {total / 1e6:.1f} MB) into {constants.HF_HUB_CACHE}", file=sys.stderr)
        with one_line(repo_id, request):     # pinned to the commit: no second look-up
            snapshot_download(repo_id, revision=root.name, allow_patterns=[glob.escape(f) for f in missing])
    check_folders(root, components, files)
    return root


def listing(repo_id, root: Path) -> dict:
    """{path in the repo: size or None} of the snapshot's commit: the tree huggingface_hub cached when it listed
    the repo, else (a cache filled by an older client) the files the snapshot folder holds."""
    try:
        return {f.path: f.size for f in get_cached_repo_tree(repo_id, revision=root.name)}
    except CachedRepoTreeNotFoundError:
        return {p.relative_to(root).as_posix(): None for p in root.rglob("*") if p.is_file()}


def variant_of(name: str):
    """diffusers' variant of a weight file: diffusion_pytorch_model.fp16.safetensors -> "fp16",
    model.fp16-00001-of-00002.safetensors -> "fp16", model.safetensors -> None."""
    stem = SHARD.sub("", name.removesuffix(".safetensors"))
    return stem.split(".", 1)[1] if "." in stem else None


def needed_files(repo_id, sizes: dict, components: dict, variant, index=INDEX) -> list:
    """The repo paths this run reads: its index (model_index.json); per component read, the small files of its folder and,
    when its weights are read, its safetensors (and their index) of `variant` where it has them, else the plain
    ones."""
    files = [index]
    for name, weights in components.items():
        here = {PurePosixPath(p).name: p for p in sizes if PurePosixPath(p).parent == PurePosixPath(name)}
        small = [p for n, p in here.items() if not n.endswith((".safetensors", *OTHER_WEIGHTS))
                 and not INDEX_FILE.match(n) and (sizes[p] or 0) <= SMALL_FILE_BYTES]
        files += sorted(small)
        if weights:
            files += weight_files(repo_id, name, here, variant)
    return files


def weight_files(repo_id, name, here: dict, variant) -> list:
    """A component folder's safetensors of one variant: `variant` where the folder has it, else the plain files
    (diffusers' fallback), else the folder's only variant."""
    groups = {}
    for n, p in here.items():
        if n.endswith(".safetensors"):
            groups.setdefault(variant_of(n), []).append(p)
    if not groups:
        other = sorted(n for n in here if n.endswith(OTHER_WEIGHTS))
        raise MlxdiffError(f"{repo_id}: {name}/ has no .safetensors weights"
                           + (f" (only {', '.join(other[:3])}: PyTorch / other formats mlxdiff does not read)"
                              if other else "") + "; choose a repository (or revision) that has safetensors")
    if variant in groups:
        chosen = variant
    elif None in groups:
        chosen = None
    elif len(groups) == 1:
        chosen = next(iter(groups))
    else:
        raise MlxdiffError(f"{repo_id}: {name}/ has weights of the variants " + ", ".join(sorted(groups))
                           + " and no plain ones; choose one with variant=")
    indexes = [p for n, p in here.items() if (m := INDEX_FILE.match(n)) and m.group(1) == chosen]
    return sorted(groups[chosen]) + sorted(indexes)


def check_folders(root: Path, components: dict, files: list) -> None:
    """The component folders' loader (formats.safetensors.safetensors_files) reads exactly the weights chosen: a
    snapshot holding two variants of a component (from runs that chose each) would give it both."""
    chosen = {root / f for f in files}
    for name, weights in components.items():
        if not weights:
            continue
        read = set(st.safetensors_files(root / name))
        if not read <= chosen:
            extra = sorted(p.name for p in read - chosen)
            raise MlxdiffError(f"{root / name}: also holds {', '.join(extra[:3])} (another weight variant fetched by "
                               "an earlier run), which mlxdiff would read with this run's; delete that folder and run "
                               "again (huggingface_hub relinks what this run reads from its cache)")


def partial(repo_id, request: HubRequest, missing) -> str:
    """The line for a cache that holds only part of what the run reads while nothing may be downloaded."""
    why = "--no-download (download=False) is given" if not request.download else "HF_HUB_OFFLINE is set"
    shown = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
    return (f"{repo_id}: the local Hugging Face cache ({constants.HF_HUB_CACHE}) holds only part of what this run "
            f"reads (not {shown}) and {why}; "
            + (f"leave it out, or run {request.command(repo_id)}" if not request.download else
               f"unset HF_HUB_OFFLINE to download the rest, or run {request.command(repo_id)} while online"))


@contextmanager
def one_line(repo_id, request: HubRequest):
    """huggingface_hub's and the disk's failures as one MlxdiffError line each (anything else keeps its
    traceback)."""
    try:
        yield
    except Exception as e:
        line = failure(repo_id, request, e)
        if line is None:
            raise
        raise MlxdiffError(line) from None


def failure(repo_id, request: HubRequest, e: Exception) -> str | None:
    """The one line for a huggingface_hub or disk failure fetching `repo_id`; None for anything else (a bug)."""
    endpoint, cache = constants.ENDPOINT, constants.HF_HUB_CACHE
    command = request.command(repo_id)
    if isinstance(e, OSError) and e.errno in DISK_FULL:
        return (f"no space left on the disk of the Hugging Face cache ({cache}) while downloading {repo_id} "
                f"({e.strerror}); free some space or point HF_HOME at a disk with room, then run again (the files "
                "already complete are kept)")
    if isinstance(e, GatedRepoError):
        if get_token():
            return (f"{repo_id}: a gated model, and the token given (HF_TOKEN or hf auth login) has no access to it; "
                    f"accept its terms at {endpoint}/{repo_id} with that token's account, then run again")
        return (f"{repo_id}: a gated model; accept its terms at {endpoint}/{repo_id} while logged in, then set "
                "HF_TOKEN to an access token of that account (or run hf auth login)")
    if isinstance(e, RepositoryNotFoundError):
        token = " (or it is private, and the token given cannot read it)" if get_token() else \
            " (or it is private: set HF_TOKEN to a token that can read it)"
        return f"{repo_id}: no such model on {endpoint}{token}; check the id, or give a local folder or file"
    if isinstance(e, RevisionNotFoundError):
        return (f"{repo_id}: has no revision {request.revision!r}; give --revision (revision=) a branch, tag or commit "
                "hash of the repository")
    if isinstance(e, IncompleteSnapshotError):     # model_index.json missing from a snapshot it lists
        return partial(repo_id, request, [INDEX])
    if isinstance(e, LocalEntryNotFoundError):
        if not request.download:
            return (f"{repo_id!r} is neither a local path nor a model in the local Hugging Face cache ({cache}); "
                    f"download it ({command}) or leave --no-download (download=False) out, or give a folder / file "
                    "path")
        if constants.is_offline_mode():
            return (f"{repo_id}: not in the local Hugging Face cache ({cache}) and HF_HUB_OFFLINE is set; unset it to "
                    f"download the model, or run {command} while online")
        return (f"{repo_id}: cannot reach {endpoint} and the local Hugging Face cache ({cache}) does not have (all "
                "of) what this run reads; check the network (and HF_ENDPOINT), or set HF_HUB_OFFLINE=1 to run only models already cached")
    if isinstance(e, HfHubHTTPError):
        status = e.response.status_code if e.response is not None else "an error"
        return f"{repo_id}: {endpoint} answered {status} ({str(e).splitlines()[0][:120]}); try again later"
    if isinstance(e, httpx2.TransportError):
        return (f"{repo_id}: the download from {endpoint} failed ({type(e).__name__}: {str(e)[:120]}); check the "
                "network and run again (the files already complete are kept)")
    if isinstance(e, OSError):
        return (f"{repo_id}: cannot fetch it into the Hugging Face cache {cache} ({e.strerror or str(e)[:160]}); "
                "check that folder (HF_HOME) is writable, or run again")
    return None
