"""python -m mlxdiff.serve [--model M] [--host 127.0.0.1] [--port 8188] [--memory-limit GB] [--api-key KEY]
                          [--lora FILE ...] [--max-upload-mb MB]

Loads the model once (keep="auto": components stay loaded between requests while they fit --memory-limit, else the
machine's memory) and serves OpenAI's images API, the job API and the web page at http://HOST:PORT/ (docs/server.md).
Binding to an address other than this machine's loopback needs --api-key: requests then need
'Authorization: Bearer KEY'.
"""

from pathlib import Path

import uvicorn

from .. import default_model
from ..arguments import check_number
from ..cli import ArgumentParser, main_exit, run
from ..errors import MlxdiffError
from ..pipelines import load
from .app import MAX_UPLOAD_MB, create_app

LOOPBACK = ("127.0.0.1", "localhost", "::1")


def parse_args(argv=None):
    p = ArgumentParser(prog="python -m mlxdiff.serve", description=__doc__)
    p.add_argument("--model", help="pipeline folder, hub id (ORG/NAME: downloaded where missing), or single file (default: the "
                                    "embedded default model under weights/)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8188)
    p.add_argument("--memory-limit", type=float, default=None, metavar="GB",
                   help="cap MLX memory; components are kept loaded between requests while they fit it")
    p.add_argument("--api-key", default=None, metavar="KEY",
                   help="require 'Authorization: Bearer KEY' of every API request; needed off loopback")
    p.add_argument("--dtype", default=None, help="compute dtype, as python -m mlxdiff.generate's")
    p.add_argument("--preview-vae", default=None, metavar="FILE",
                   help="decode the event stream's previews with this tiny VAE (TAESD / TAESDXL / TAESD3 / TAEF1 / "
                        "TAEF2) instead of the latent-to-RGB projection")
    p.add_argument("--lora", action="append", default=[], metavar="FILE",
                   help="offer this LoRA file to the requests (repeatable): they choose it by the file's name without "
                        '.safetensors, at a scale: "loras": [{"name": NAME, "scale": 0.8}]')
    p.add_argument("--max-upload-mb", type=float, default=MAX_UPLOAD_MB, metavar="MB",
                   help=f"refuse (413) an upload request (image and mask) larger than this (default {MAX_UPLOAD_MB}); "
                        "a JSON request is capped at 1 MB")
    return p.parse_args(argv)


def offered_loras(pipe, files) -> dict:
    """--lora files -> {name: file}, each checked against the model now (lora.check, through load_lora) rather than
    at a request."""
    out = {}
    for file in files:
        name = Path(file).name.removesuffix(".safetensors")
        if name in out:
            raise MlxdiffError(f"--lora {file}: another --lora is named {name!r} too; rename one of the files")
        pipe.load_lora(file)
        out[name] = file
    pipe.unload_loras()
    return out


def check_binding(host, port, api_key):
    if host not in LOOPBACK and not api_key:
        raise MlxdiffError(f"--host {host}: serving beyond this machine needs --api-key KEY, so that only clients "
                           "with the key can generate; or bind 127.0.0.1")
    if not 0 < port < 65536:
        raise MlxdiffError(f"--port {port}: give a port from 1 to 65535")


def serve(args) -> int:
    check_binding(args.host, args.port, args.api_key)
    check_number("memory_limit", args.memory_limit)
    if not 0 < args.max_upload_mb <= 4096:
        raise MlxdiffError(f"--max-upload-mb {args.max_upload_mb:g}: give a size in MB from above 0 to 4096")
    model = args.model or str(default_model.folder())
    pipe = load(model, keep="auto", memory_limit=args.memory_limit, dtype=args.dtype)
    if args.preview_vae is not None:
        pipe.set_preview_vae(args.preview_vae)
    app = create_app(pipe, args.model or default_model.FOLDER.name, args.api_key, offered_loras(pipe, args.lora),
                     args.max_upload_mb)
    print(f"mlxdiff: serving {model} ({pipe.title}) at http://{args.host}:{args.port}/", flush=True)
    # Ctrl-C: a page's open event stream is closed after 5 s instead of holding the shutdown (and the running job,
    # which the lifespan cancels only once the connections are gone) until the job ends
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning", timeout_graceful_shutdown=5)
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    return run(lambda: serve(args), "interrupted; the server stopped")


if __name__ == "__main__":
    main_exit(main)
