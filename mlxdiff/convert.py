"""python -m mlxdiff.convert SOURCE DEST [--quantize BITS | component=bits,...] [--transformer FILE]

Writes a pipeline folder in mlxdiff's own format: each component's weights as safetensors in the modules' own names
and layouts (quantized arrays included; the LLM text encoders whole, in their transformers names), and its
config.json carrying `_mlxdiff_native` and the quantization, so
that `mlxdiff.load(DEST)` maps it lazily with no conversion step. Tokenizers, scheduler and model_index.json are
copied. The folder is written under a temporary name and renamed at the end: a failed conversion never leaves a
folder that looks complete (a failed write or Ctrl-C removes it: one line, exit 2 or 130). A relative DEST goes under
weights/.
"""

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

from .cli import ArgumentParser, parse_quantize, run, write_error
from .errors import MlxdiffError


def convert(source, dest, *, quantize=None, transformer=None, progress=print) -> Path:
    import mlxdiff
    from mlx.utils import tree_flatten
    import mlx.core as mx
    from .default_model import weights_dir
    from .loading.sources import resolve_path
    from .loading.spec import NATIVE_KEY, class_name_of
    from .loading.quantize import materialize

    dest = Path(dest)
    if not dest.is_absolute() and not dest.parent.parts:
        dest = weights_dir() / dest
    if dest.exists():
        raise MlxdiffError(f"{dest}: destination already exists; choose a new name or delete it first")
    if not dest.parent.is_dir():
        what = "is not a folder" if dest.parent.exists() else "does not exist"
        raise MlxdiffError(f"{dest.parent}: destination's parent folder {what}")
    try:
        tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.partial-", dir=dest.parent))
    except OSError as e:
        raise write_error(dest, e) from None
    try:
        pipe = mlxdiff.load(source, transformer=transformer, quantize=quantize)
        src_root = resolve_path(source)
        index = {}
        if src_root.is_dir():
            index = json.loads((src_root / "model_index.json").read_text())
            for name, entry in index.items():
                if name.startswith("_") or not isinstance(entry, list) or name in pipe.components:
                    continue
                if (src_root / name).is_dir():
                    shutil.copytree(src_root / name, tmp / name)
        else:  # single file: its bundled tokenizers and default scheduler
            index = {"_class_name": "StableDiffusion3Pipeline"}
            for name, tok in pipe.tokenizers.items():
                tok.save_pretrained(str(tmp / name))
                index[name] = ["transformers", type(tok).__name__]
            (tmp / "scheduler").mkdir()
            (tmp / "scheduler" / "scheduler_config.json").write_text(json.dumps(pipe.scheduler_config))
            index["scheduler"] = ["diffusers", "FlowMatchEulerDiscreteScheduler"]
        for name, spec in pipe.components.items():
            if spec is None:
                continue
            progress(f"converting {name} ...")
            # an architecture that is read partially (the LLM encoders, up to their taps) is written whole, in the
            # stored names its sanitize reads back, so that the converted folder serves any taps
            stored_prefix = getattr(spec.arch, "STORED_PREFIX", None)
            if hasattr(spec.arch, "whole_model_config"):
                spec = spec.with_config(**spec.arch.whole_model_config(spec.config))
            model = spec.build(mx.float32)
            materialize(model)
            (tmp / name).mkdir()
            weights = {(stored_prefix or "") + k: v for k, v in tree_flatten(model.parameters())}
            try:
                mx.save_safetensors(str(tmp / name / "model.safetensors"), weights, metadata={"format": "mlxdiff"})
            except RuntimeError as e:   # MLX's write errors (disk full, file-size limit) are RuntimeErrors
                raise MlxdiffError(f"{dest}: cannot write {name}/model.safetensors ({e}); nothing was written "
                                   "there") from None
            config = {k: v for k, v in spec.config.items() if k not in ("quantization", "taps")}
            if stored_prefix is None:
                config[NATIVE_KEY] = True
            if spec.quantize:
                config["quantization"] = dict(spec.quantize)
            elif spec.config.get("quantization"):
                config["quantization"] = spec.config["quantization"]
            (tmp / name / "config.json").write_text(json.dumps(config, indent=1))
            index[name] = [(index.get(name) or ["diffusers"])[0], class_name_of(spec)]
            model.clear()
            del model, weights
            mx.clear_cache()
        index["_mlxdiff_converted_from"] = str(source)
        (tmp / "model_index.json").write_text(json.dumps(index, indent=1))
        tmp.rename(dest)
    except BaseException as e:   # Ctrl-C included: the partial folder goes, so nothing can load it later
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, OSError):
            raise write_error(dest, e) from None
        raise
    return dest


def main(argv=None) -> int:
    p = ArgumentParser(prog="python -m mlxdiff.convert", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("source")
    p.add_argument("dest")
    p.add_argument("--quantize", default=None)
    p.add_argument("--transformer", default=None)
    args = p.parse_args(argv)

    def work():
        dest = convert(args.source, args.dest, quantize=parse_quantize(args.quantize), transformer=args.transformer)
        print(f"mlxdiff: wrote {dest}")
        return 0
    return run(work, "interrupted; nothing written (the partial folder was removed)")


if __name__ == "__main__":
    sys.exit(main())
