"""Models fetched from the Hub (mlxdiff/loading/hub.py) through the real huggingface_hub client, against a local
endpoint started here on 127.0.0.1 that speaks the Hub's HTTP API as huggingface_hub 2.x uses it (repo info, the
recursive tree, resolve with HEAD and ranged GET), serving the embedded default model (weights/klein-shapes) with
files a run must not fetch beside it. HF_ENDPOINT points at it and HF_HOME at a temporary folder; huggingface_hub
reads both when its constants module loads, so the tests reload it with the variables set (and again after)."""

import hashlib
import importlib
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

import mlx.core as mx
import numpy as np
import pytest
from huggingface_hub import constants

import mlxdiff
from mlxdiff import default_model, generate
from mlxdiff.errors import MlxdiffError
from mlxdiff.loading.hub import needed_files
from mlxdiff.pipelines import hub_reads
from mlxdiff.pipelines.family import LoadRequest

KLEIN = default_model.FOLDER
SHA = "0123456789abcdef0123456789abcdef01234567"
TOKEN = "hf_test_token"
# what a run of the klein folder reads: model_index.json and its five components' files
READ = {"model_index.json", "scheduler/scheduler_config.json", "text_encoder/config.json",
        "text_encoder/model.safetensors", "tokenizer/chat_template.jinja", "tokenizer/tokenizer.json",
        "tokenizer/tokenizer_config.json", "transformer/config.json",
        "transformer/diffusion_pytorch_model.safetensors", "vae/config.json",
        "vae/diffusion_pytorch_model.safetensors"}
PROMPT = "a large red circle on the left on a white background"


def repo_files() -> dict:
    """The klein folder as a repo, with what no run reads: a README, an image encoder the index names but the
    family's layout does not, .bin twins of the weights, an fp16 variant of the VAE."""
    files = {p.relative_to(KLEIN).as_posix(): p.read_bytes() for p in KLEIN.rglob("*") if p.is_file()}
    index = json.loads(files["model_index.json"])
    index["image_encoder"] = ["transformers", "CLIPVisionModelWithProjection"]
    files["model_index.json"] = json.dumps(index, indent=2).encode()
    files["image_encoder/config.json"] = b"{}"
    files["image_encoder/model.safetensors"] = files["vae/config.json"]     # never fetched, so never read
    files["transformer/diffusion_pytorch_model.bin"] = b"pickle" * 100
    files["text_encoder/pytorch_model.bin"] = b"pickle" * 100
    vae = mx.load(str(KLEIN / "vae" / "diffusion_pytorch_model.safetensors"))
    with tempfile.TemporaryDirectory() as tmp:
        mx.save_safetensors(f"{tmp}/fp16.safetensors", {k: v.astype(mx.float16) for k, v in vae.items()})
        files["vae/diffusion_pytorch_model.fp16.safetensors"] = Path(f"{tmp}/fp16.safetensors").read_bytes()
    return files


class Hub(ThreadingHTTPServer):
    """The Hub's HTTP API over `files`, for any repo id under org "test" (each id its own cache entry): "test/gated*"
    answers 401 GatedRepo without the token, other orgs 404 RepoNotFound, revisions other than main and SHA 404
    RevisionNotFound. `log`: (method, path, Range header) of every request; `cut`: repo paths whose next GET
    stops halfway (a dropped connection)."""
    daemon_threads = True

    def __init__(self, files):
        super().__init__(("127.0.0.1", 0), Handler)
        self.files, self.log, self.cut = files, [], set()
        self.lock = threading.Lock()

    @property
    def url(self):
        return f"http://127.0.0.1:{self.server_address[1]}"

    def resolved(self, method):
        """The repo paths fetched with `method` on /resolve/."""
        return [path.split("/resolve/", 1)[1].split("/", 1)[1] for m, path, _ in self.log
                if m == method and "/resolve/" in path]


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def do_HEAD(self):
        self.serve(body=False)

    def do_GET(self):
        self.serve(body=True)

    def answer(self, status, payload=None, headers=(), body=True):
        data = b"" if payload is None else json.dumps(payload).encode()
        self.send_response(status)
        for k, v in headers:
            self.send_header(k, v)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if body:
            self.wfile.write(data)

    def refused(self, repo, rev):
        """The error the Hub gives for this repo and revision, or None."""
        org = repo.split("/")[0]
        if org != "test":
            return 404, "RepoNotFound"
        if repo.startswith("test/gated") and self.headers.get("Authorization") != f"Bearer {TOKEN}":
            return 401, "GatedRepo"
        if rev not in ("main", SHA):
            return 404, "RevisionNotFound"
        return None

    def serve(self, body):
        hub = self.server
        path = unquote(urlsplit(self.path).path)
        with hub.lock:
            hub.log.append((self.command, path, self.headers.get("Range")))
        api = re.fullmatch(r"/api/models/([^/]+/[^/]+)(?:/(revision|tree)/([^/]+))?", path)
        resolve = re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", path)
        if api:
            repo, kind, rev = api.group(1), api.group(2) or "revision", api.group(3) or "main"
            if (error := self.refused(repo, rev)) is not None:
                return self.answer(error[0], {"error": error[1]}, [("X-Error-Code", error[1])], body)
            if kind == "revision":
                return self.answer(200, {"id": repo, "modelId": repo, "sha": SHA, "private": False,
                                         "siblings": [{"rfilename": p} for p in sorted(hub.files)]}, body=body)
            return self.answer(200, [{"type": "file", "path": p, "size": len(d), "oid": hashlib.sha1(d).hexdigest()}
                                     for p, d in sorted(hub.files.items())], body=body)
        if not resolve:
            return self.answer(404, {"error": "not found"}, body=body)
        repo, rev, name = resolve.groups()
        headers = [("X-Repo-Commit", SHA)]
        if (error := self.refused(repo, rev)) is not None:
            return self.answer(error[0], {"error": error[1]}, [*headers, ("X-Error-Code", error[1])], body)
        if name not in hub.files:
            return self.answer(404, {"error": "EntryNotFound"}, [*headers, ("X-Error-Code", "EntryNotFound")], body)
        data = hub.files[name]
        start = int(re.fullmatch(r"bytes=(\d+)-", self.headers.get("Range", "bytes=0-")).group(1))
        self.send_response(206 if start else 200)
        for k, v in (*headers, ("ETag", f'"{hashlib.sha256(data).hexdigest()}"'), ("Accept-Ranges", "bytes"),
                     ("Content-Length", str(len(data) - start)), ("Content-Type", "application/octet-stream")):
            self.send_header(k, v)
        if start:
            self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        self.end_headers()
        if not body:
            return
        with hub.lock:
            cut = (repo, name) in hub.cut and not start
            hub.cut.discard((repo, name))
        if cut:   # 9/10 of the file (past huggingface_hub's first 10 MiB chunk), then the connection drops
            self.wfile.write(data[:len(data) * 9 // 10])
            self.wfile.flush()
            self.close_connection = True
            self.connection.shutdown(socket.SHUT_RDWR)
            return
        self.wfile.write(data[start:])


@contextmanager
def hf_environment(**env):
    """HF_* variables set for huggingface_hub (its constants module reloaded with them, and again after)."""
    with pytest.MonkeyPatch.context() as mp:
        for key, value in env.items():
            if value is None:
                mp.delenv(key, raising=False)
            else:
                mp.setenv(key, value)
        importlib.reload(constants)
        try:
            yield
        finally:
            mp.undo()
            importlib.reload(constants)


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    server = Hub(repo_files())
    threading.Thread(target=server.serve_forever, daemon=True).start()
    home = tmp_path_factory.mktemp("hf_home")
    server.home = home
    server.env = dict(HF_ENDPOINT=server.url, HF_HOME=str(home), HF_HUB_OFFLINE=None, HF_TOKEN=None,
                      HF_HUB_CACHE=None, HF_HUB_DISABLE_PROGRESS_BARS="1")
    yield server
    server.shutdown()
    server.server_close()


@contextmanager
def on(hub, **env):
    """The Hub environment (plus `env`), the server's log cleared first."""
    hub.log.clear()
    with hf_environment(**{**hub.env, **env}):
        yield


def image_of(pipe):
    return np.asarray(pipe.generate(PROMPT, seed=3, steps=2, progress_bar=False).image)


@pytest.fixture(scope="module")
def local_image():
    return image_of(mlxdiff.load(str(KLEIN)))


def one_line(excinfo) -> str:
    message = str(excinfo.value)
    assert "\n" not in message
    return message


def test_first_run_downloads_only_what_it_reads_and_draws_the_local_image(hub, local_image):
    with on(hub):
        pipe = mlxdiff.load("test/klein")
        assert set(hub.resolved("GET")) == READ                  # no README, image encoder, .bin or fp16 twin
        assert len(hub.resolved("GET")) == len(READ)               # each once
        snapshot = hub.home / "hub" / "models--test--klein" / "snapshots" / SHA
        assert {p.relative_to(snapshot).as_posix() for p in snapshot.rglob("*") if p.is_file()} == READ
        assert np.array_equal(image_of(pipe), local_image)      # bit for bit

        hub.log.clear()
        mlxdiff.load("test/klein")                                 # a second run downloads nothing
        assert hub.resolved("GET") == [] and hub.resolved("HEAD") == []
        assert [p for _, p, _ in hub.log] == ["/api/models/test/klein/revision/main"]

        hub.log.clear()
        mlxdiff.load("test/klein", revision=SHA)                   # a commit needs no look-up at all
        assert hub.log == []
    with on(hub, HF_HUB_OFFLINE="1"):                             # offline: the cache, no request
        assert mlxdiff.load("test/klein").components["transformer"].files == [
            snapshot / "transformer" / "diffusion_pytorch_model.safetensors"]
        assert hub.log == []
    with on(hub):                                                  # --no-download: the cache too
        mlxdiff.load("test/klein", download=False)
        assert hub.log == []


def test_a_replaced_component_and_a_variant_fetch_no_other_weights(hub):
    transformer = KLEIN / "transformer" / "diffusion_pytorch_model.safetensors"
    with on(hub):
        pipe = mlxdiff.load("test/replaced", transformer=str(transformer))
        fetched = set(hub.resolved("GET"))
        assert fetched == READ - {"transformer/diffusion_pytorch_model.safetensors"}   # its config still
        assert pipe.components["transformer"].files == [transformer]
        for offline in ({"HF_HUB_OFFLINE": "1"}, {}):   # the cache lacks the transformer's weights: one line
            with on(hub, **offline), pytest.raises(MlxdiffError) as e:
                mlxdiff.load("test/replaced", download=bool(offline))   # offline, or --no-download
            assert "holds only part" in one_line(e) and "hf download test/replaced" in str(e.value)
            assert hub.log == []
        hub.log.clear()
        mlxdiff.load("test/variant", variant="fp16")
        assert set(hub.resolved("GET")) == READ - {"vae/diffusion_pytorch_model.safetensors"} | {
            "vae/diffusion_pytorch_model.fp16.safetensors"}
        hub.log.clear()
        with pytest.raises(MlxdiffError) as e:     # the cache now has both VAE variants: refused, not both read
            mlxdiff.load("test/variant")
        assert "another weight variant" in one_line(e)
        shutil.rmtree(hub.home / "hub" / "models--test--variant" / "snapshots" / SHA / "vae")   # as it says
        hub.log.clear()
        mlxdiff.load("test/variant")                  # relinked from the cache's blobs: nothing downloaded again
        assert hub.resolved("GET") == [] and set(hub.resolved("HEAD")) == {
            "vae/config.json", "vae/diffusion_pytorch_model.safetensors"}
        with pytest.raises(MlxdiffError) as e:
            mlxdiff.load("test/variant", variant="fp 16")
        assert "variant=" in one_line(e)


def test_an_interrupted_download_resumes(hub):
    name = "transformer/diffusion_pytorch_model.safetensors"
    hub.cut.add(("test/cut", name))
    with on(hub):
        mlxdiff.load("test/cut")
    ranged = [r for m, p, r in hub.log if m == "GET" and p.endswith(name)]
    assert ranged[0] is None and re.fullmatch(r"bytes=\d+-", ranged[1]) and len(ranged) == 2
    cached = hub.home / "hub" / "models--test--cut" / "snapshots" / SHA / name
    assert cached.read_bytes() == hub.files[name]


def test_each_failure_is_one_line(hub, capsys, tmp_path):
    with on(hub):
        with pytest.raises(MlxdiffError) as e:
            mlxdiff.load("test/gated-model")
        assert "gated" in one_line(e) and "HF_TOKEN" in str(e.value)
        with pytest.raises(MlxdiffError) as e:
            mlxdiff.load("nobody/klein")
        assert "no such model" in one_line(e)
        with pytest.raises(MlxdiffError) as e:
            mlxdiff.load("test/klein-rev", revision="v9")
        assert "no revision 'v9'" in one_line(e)
        with pytest.raises(MlxdiffError) as e:
            mlxdiff.load(str(KLEIN), revision="main")
        assert "local path" in one_line(e)
    with on(hub, HF_TOKEN=TOKEN):                                  # HF_TOKEN opens the gated repo
        mlxdiff.load("test/gated-model")
        assert READ <= set(hub.resolved("GET"))
    with on(hub, HF_HUB_OFFLINE="1"):
        with pytest.raises(MlxdiffError) as e:
            mlxdiff.load("test/never-fetched")
        assert "HF_HUB_OFFLINE" in one_line(e)
    with socket.socket() as s:                                     # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{s.getsockname()[1]}"
    with on(hub, HF_ENDPOINT=closed):
        with pytest.raises(MlxdiffError) as e:
            mlxdiff.load("test/unreachable")
        assert "cannot reach" in one_line(e) and closed in str(e.value)
    with on(hub):                                                  # the command line: one line, exit 2
        capsys.readouterr()
        code = generate.main(["--model", "test/not-cached", "--no-download", "--no-progress",
                              "--output", str(tmp_path / "out.png")])
        err = capsys.readouterr().err.strip()
        assert code == 2 and len(err.splitlines()) == 1
        assert "hf download test/not-cached" in err and "huggingface-cli" not in err
        assert hub.log == []
        code = generate.main(["--model", "test/klein", "--revision", "v9", "--no-progress",
                              "--output", str(tmp_path / "out.png")])
        err = capsys.readouterr().err.strip()
        assert code == 2 and len(err.splitlines()) == 1 and "no revision 'v9'" in err
        assert [p for _, p, _ in hub.log] == ["/api/models/test/klein/revision/v9"]


# the fetch alone (the run's reads as the klein family gives them), in a process whose cache is a 1 MB tmpfs; a
# failure is one MlxdiffError line (the command lines exit 2 with it: test_each_failure_is_one_line)
SUBPROCESS_FULL_DISK = """
import sys
from mlxdiff.errors import MlxdiffError
from mlxdiff.loading import hub
try:
    hub.fetch("test/full-disk", hub.HubRequest(), lambda root: {"transformer": True, "vae": True, "tokenizer": False})
except MlxdiffError as e:
    sys.exit("mlxdiff: error: " + str(e))
"""


def test_a_full_disk_is_one_line(hub, tmp_path):
    """The cache on a 1 MB tmpfs (a mount namespace of its own: unshare), huggingface_hub configured by its
    environment variables as a user's would be: the transformer's 13 MB cannot fit; the write fails with ENOSPC."""
    unshare = shutil.which("unshare")
    probe = subprocess.run([unshare, "--user", "--map-root-user", "--mount", "true"], capture_output=True, timeout=30) \
        if unshare else None
    if probe is None or probe.returncode:
        pytest.skip("no unprivileged mount namespaces here (unshare) for a tiny tmpfs")
    home = tmp_path / "home"
    home.mkdir()
    script = f"mount -t tmpfs -o size=1m tmpfs {home} && exec {sys.executable} -c '{SUBPROCESS_FULL_DISK}'"
    env = {**os.environ, "HF_ENDPOINT": hub.url, "HF_HOME": str(home), "HF_HUB_DISABLE_PROGRESS_BARS": "1"}
    env.pop("HF_HUB_OFFLINE", None)
    done = subprocess.run([unshare, "--user", "--map-root-user", "--mount", "sh", "-c", script], env=env,
                          capture_output=True, text=True, timeout=120)
    lines = [line for line in done.stderr.splitlines() if line.startswith("mlxdiff: error:")]
    assert done.returncode == 1 and len(lines) == 1, done.stderr[-2000:]
    assert "no space left" in lines[0] and "HF_HOME" in lines[0], lines


def reads_of(tmp_path, index, **request):
    (tmp_path / "model_index.json").write_text(json.dumps(index))
    return hub_reads(tmp_path, LoadRequest(**request))


def test_what_a_run_reads_comes_from_the_family_layout(tmp_path):
    """hub_reads: the layout's components (a safety checker or feature extractor is never fetched), weights for the
    models only, none for a component a file replaces (the UNet family's transformer= is its unet)."""
    sd = {"_class_name": "StableDiffusionPipeline", "unet": ["diffusers", "UNet2DConditionModel"],
          "vae": ["diffusers", "AutoencoderKL"], "text_encoder": ["transformers", "CLIPTextModel"],
          "tokenizer": ["transformers", "CLIPTokenizer"], "scheduler": ["diffusers", "PNDMScheduler"],
          "safety_checker": ["stable_diffusion", "StableDiffusionSafetyChecker"],
          "feature_extractor": ["transformers", "CLIPImageProcessor"]}
    assert reads_of(tmp_path, sd) == {"unet": True, "vae": True, "text_encoder": True, "tokenizer": False,
                                      "scheduler": False}
    assert reads_of(tmp_path, sd, transformer="unet.safetensors", vae="vae.safetensors")["unet"] is False
    clip = ["transformers", "CLIPTextModelWithProjection"]
    sd3 = {"_class_name": "StableDiffusion3Pipeline", "transformer": ["diffusers", "SD3Transformer2DModel"],
           "vae": ["diffusers", "AutoencoderKL"], "text_encoder": clip, "text_encoder_2": clip,
           "text_encoder_3": ["transformers", "T5EncoderModel"], "tokenizer": ["transformers", "CLIPTokenizer"],
           "tokenizer_2": ["transformers", "CLIPTokenizer"], "tokenizer_3": ["transformers", "T5TokenizerFast"],
           "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"]}
    reads = reads_of(tmp_path, sd3, text_encoders={"t5xxl": "t5xxl.safetensors"})
    assert reads["text_encoder_3"] is False and reads["text_encoder"] is True and reads["transformer"] is True
    without_t5 = reads_of(tmp_path, {**sd3, "text_encoder_3": [None, None], "tokenizer_3": [None, None]})
    assert "text_encoder_3" not in without_t5 and "tokenizer_3" not in without_t5
    with pytest.raises(MlxdiffError) as e:        # a keyword the family does not take: refused before any download
        reads_of(tmp_path, sd, tokenizer="tok")
    assert "tokenizer=" in one_line(e)


def test_the_weights_of_one_variant_and_never_bin(tmp_path):
    sizes = {f"text_encoder/{n}": 1 for n in (
        "config.json", "model.safetensors.index.json", "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors", "model.safetensors.index.fp16.json", "model.fp16-00001-of-00002.safetensors",
        "model.fp16-00002-of-00002.safetensors", "pytorch_model.bin", "flax_model.msgpack")}
    sizes |= {"unet/config.json": 1, "unet/diffusion_pytorch_model.fp16.safetensors": 1, "README.md": 1,
              "model_index.json": 1, "unet/diffusion_pytorch_model.bin": 1, "vae/diffusion_pytorch_model.bin": 1,
              "vae/config.json": 1}
    components = {"text_encoder": True, "unet": True}
    plain = needed_files("o/r", sizes, components, None)
    assert plain == ["model_index.json", "text_encoder/config.json", "text_encoder/model-00001-of-00002.safetensors",
                     "text_encoder/model-00002-of-00002.safetensors", "text_encoder/model.safetensors.index.json",
                     "unet/config.json", "unet/diffusion_pytorch_model.fp16.safetensors"]   # its only variant
    fp16 = needed_files("o/r", sizes, components, "fp16")
    assert [f for f in fp16 if f.startswith("text_encoder/model")] == [
        "text_encoder/model.fp16-00001-of-00002.safetensors", "text_encoder/model.fp16-00002-of-00002.safetensors",
        "text_encoder/model.safetensors.index.fp16.json"]
    assert needed_files("o/r", sizes, {"vae": False}, None) == ["model_index.json", "vae/config.json"]
    with pytest.raises(MlxdiffError) as e:
        needed_files("o/r", sizes, {"vae": True}, None)
    assert "diffusion_pytorch_model.bin" in one_line(e) and "safetensors" in str(e.value)
