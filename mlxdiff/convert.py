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
import os
import shutil
import tempfile
from dataclasses import replace
from pathlib import Path

import mlxdiff
from . import backend  # noqa: F401  (OpenBLAS preload before mlx)
import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from .cli import ArgumentParser, main_exit, parse_quantize, run, write_error
from .default_model import weights_dir
from .errors import MlxdiffError
from .formats import format_of
from .formats.gguf_blocks import AFFINE, REQUANTIZED
from .formats.gguf_header import check_gguf


def convert(source, dest, *, quantize=None, transformer=None, progress=print) -> Path:
    from .loading.sources import index_file, read_json, resolve_path  # heavy: mlxdiff.loading imports MLX and the models (about 0.6 s)
    from .loading.spec import NATIVE_KEY, class_name_of  # heavy: as above
    from .pipelines.family import family_named  # heavy: as above
    from .loading.quantize import materialize  # heavy: as above

    dest = destination(dest)
    if dest.exists():
        raise MlxdiffError(f"{dest}: destination already exists; choose a new name or delete it first")
    if not dest.parent.is_dir():
        what = "is not a folder" if dest.parent.exists() else "does not exist"
        raise MlxdiffError(f"{dest.parent}: destination's parent folder {what}")
    try:
        tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.partial-", dir=dest.parent))
    except OSError as e:
        raise write_error(dest, e) from None
    try:   # mkdtemp makes it 0700; the folder gets the usual permissions, as a mkdir would give it
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o777 & ~umask)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise write_error(dest, e) from None
    try:
        pipe = mlxdiff.load(source, transformer=transformer, quantize=quantize)
        src_root = resolve_path(source)
        index = {}
        if src_root.is_dir():
            index = read_json(index_file(src_root), "model_index.json", src_root)   # or a modular one
            for name, entry in index.items():
                if name.startswith("_") or not isinstance(entry, list) or name in pipe.components:
                    continue
                if (src_root / name).is_dir():
                    shutil.copytree(src_root / name, tmp / name)
        else:  # single file: its bundled tokenizers and default scheduler
            index = {"_class_name": pipe.pipeline_class}
            for name, tok in pipe.tokenizers.items():
                tok.save_pretrained(str(tmp / name))
                index[name] = ["transformers", type(tok).__name__]
            (tmp / "scheduler").mkdir()
            (tmp / "scheduler" / "scheduler_config.json").write_text(json.dumps(pipe.scheduler_config))
            index["scheduler"] = ["diffusers", pipe.scheduler_config.get("_class_name")
                                  or family_named(pipe.family).layouts[pipe.pipeline_class]["scheduler"][0]]
        for name, spec in pipe.components.items():
            if spec is None:
                continue
            progress(f"converting {name} ...")
            beside = getattr(spec.arch, "WRITTEN_WITH", None)
            if beside:    # a part read from another component's files (a vision tower): written into its folder
                model = replace(spec, quantize=None).build()
                materialize(model)
                mx.save_safetensors(str(tmp / beside / f"{name}.safetensors"), spec.arch.stored_weights(model),
                                    metadata={"format": "mlxdiff"})
                model.clear()
                del model
                continue
            # an architecture that is read partially (the LLM encoders, up to their taps) is written whole, in the
            # stored names its sanitize reads back, so that the converted folder serves any taps
            stored_prefix = getattr(spec.arch, "STORED_PREFIX", None)
            if hasattr(spec.arch, "whole_model_config"):
                spec = spec.with_config(**spec.arch.whole_model_config(spec.config))
            # a GGUF's quantized layers in MLX's affine form, which a saved folder describes (its quantization key
            # below); the file's own raw blocks ("raw" layout) have no saved form
            from_gguf = any(format_of(f, header=False).kept_quantized for f in spec.files)
            if from_gguf:
                spec = replace(spec, gguf_layout="affine")
                if gguf_forms(spec.files):
                    progress(f"{name}: {gguf_forms(spec.files)}")
            model = spec.build()     # float32: no policy installed
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
            elif from_gguf and gguf_setting(model):
                config["quantization"] = gguf_setting(model)   # each layer's own bits are read off its arrays
            (tmp / name / "config.json").write_text(json.dumps(config, indent=1))
            # a single file's components: text encoders are transformers' classes, the rest diffusers'
            library = "transformers" if name.startswith("text_encoder") else "diffusers"
            index[name] = [(index.get(name) or [library])[0], class_name_of(spec)]
            model.clear()
            del model, weights
            mx.clear_cache()
        index["_mlxdiff_converted_from"] = str(source)
        (tmp / "model_index.json").write_text(json.dumps(index, indent=1))
        tmp.rename(dest)
    except BaseException as e:   # Ctrl-C included: the partial folder goes, so nothing can load it later (after
        shutil.rmtree(tmp, ignore_errors=True)   # the rename, tmp is gone and dest is whole)
        if isinstance(e, OSError):
            raise write_error(dest, e) from None
        raise
    return dest


def gguf_forms(files) -> str | None:
    """One line saying what convert makes of a GGUF's quantized types: a folder stores MLX's affine triplets, not
    the file's own blocks, so each type is written in its affine form (formats/gguf_blocks.py), some not exactly."""
    types = sorted({t.type_name for f in files if format_of(f, header=False).kept_quantized
                    for t in check_gguf(f).tensors if t.type_name in AFFINE or t.type_name in REQUANTIZED})
    if not types:
        return None
    forms = []
    for name in types:
        if name in REQUANTIZED:
            _, bits, group = REQUANTIZED[name]
            forms.append(f"{name} re-quantized to {bits}-bit g{group} from its decoded values (not exact)")
        else:
            _, bits, group = AFFINE[name]
            forms.append(f"{name} as {bits}-bit g{group} ({'near-exact' if name == 'Q6_K' else 'exact'})")
    return ("the GGUF's blocks are written in MLX's affine form (a folder has no form for the blocks "
            "themselves): " + ", ".join(forms))


def gguf_setting(model):
    """{"bits", "group_size"} of a model's first affine-quantized layer (a GGUF's, in the affine layout), or None:
    the mark a loader needs to make the saved layers quantized (mlx-lm's infer_quant_config reads each one's own)."""
    for _, module in model.named_modules():
        if isinstance(module, nn.QuantizedLinear):
            return {"bits": module.bits, "group_size": module.group_size}
    return None


def destination(dest) -> Path:
    """DEST as given -> the folder to write: a bare name goes under weights/; an empty name (or one that names no
    new folder: ".", "..") is refused, since it would name the weights folder itself or an existing one."""
    text = str(dest)
    if not text.strip() or Path(text).name in ("", ".", ".."):
        raise MlxdiffError(f"DEST {text!r}: names no new folder; give the name of the folder to write, e.g. "
                           "klein-native (under weights/) or /path/to/klein-native")
    dest = Path(text)
    if not dest.is_absolute() and not dest.parent.parts:
        dest = weights_dir() / dest
    return dest


def main(argv=None) -> int:
    p = ArgumentParser(prog="python -m mlxdiff.convert", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("source")
    p.add_argument("dest")
    p.add_argument("--quantize", default=None)
    p.add_argument("--transformer", default=None)
    args = p.parse_args(argv)

    new = []   # the destination, once checked to be new: a folder there after a Ctrl-C is the whole conversion

    def work():
        dest = destination(args.dest)
        if dest.exists():
            raise MlxdiffError(f"{dest}: destination already exists; choose a new name or delete it first")
        new.append(dest)
        dest = convert(args.source, new[0], quantize=parse_quantize(args.quantize), transformer=args.transformer)
        print(f"mlxdiff: wrote {dest}")
        return 0

    def interrupted():
        if new and new[0].is_dir():   # the rename (the last step) had happened
            return f"interrupted; {new[0]} was written whole"
        return "interrupted; nothing written (the partial folder was removed)"
    return run(work, interrupted)


if __name__ == "__main__":
    main_exit(main)
