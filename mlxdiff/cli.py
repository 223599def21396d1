"""What the command-line tools share: one-line parse errors, the error and Ctrl-C wrapper, parsing of options that
the API takes as values (then checked by arguments.py, as the API checks them), and writing files: checked before
any work, written atomically, a failure in one line. Light on imports, so that a mistake is refused at once."""

import argparse
import os
import re
import sys
import tempfile
from pathlib import Path

from .arguments import TEXT_ENCODER_NAMES, check_loras, check_quantize, quantize_word
from .backend import kernel_build_errors
from .errors import MlxdiffError


class ArgumentParser(argparse.ArgumentParser):
    """argparse whose mistakes read as every other user mistake: one `mlxdiff: error: ...` line on stderr and exit
    code 2 (argparse's own prints a usage block first). Subparsers inherit the class.

    A value that starts with '-' then a digit ("-8,0,0,0", "-1e3", "-2.5") is a value, never an option: argparse
    takes only plain negative numbers so and would refuse `--outpaint -8,0,0,0` as "expected one argument" instead
    of the option's own check naming the negative edge. No mlxdiff option starts with a digit."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._negative_number_matcher = re.compile(r"^-\.?\d")   # argparse's own hook (Python 3.13 widens it too)

    def error(self, message):
        self.exit(2, f"mlxdiff: error: {message}\n")


def run(work, interrupted="interrupted") -> int:
    """work() -> exit code, with a user mistake as one line and 2, Ctrl-C as one line and 130. `interrupted`: the
    line's text, or a function that says it (what was written by then). The work's output is flushed inside the
    guard, so that a Ctrl-C in the moment it ends is still this one line (saying that the work had finished), not a
    traceback at interpreter shutdown; main_exit then keeps the shutdown itself from being interrupted."""
    from .policy import from_switches  # light CLI: keeps `import mlxdiff.generate`'s module set
    finished = False
    streams = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = (PipeSafe(s) if s is not None and not isinstance(s, PipeSafe) else s for s in streams)
    try:
        from_switches()     # every MLXDIFF_* switch checked before any work
        with kernel_build_errors():     # outside a pipeline's phases too (their own say the same)
            code = work()
        finished = True
        flush_output()
        return code
    except MlxdiffError as e:
        print("mlxdiff: error: " + " ".join(str(e).splitlines()), file=sys.stderr)   # one line, whatever it says
        return 2
    except KeyboardInterrupt:
        what = interrupted() if callable(interrupted) else interrupted
        if finished:   # the work had returned: what it wrote is whole
            detail = what.removeprefix("interrupted").lstrip("; ")
            what = "interrupted as the command finished; its work was done" + (f" ({detail})" if detail else "")
        print(f"mlxdiff: {what}", file=sys.stderr)
        return 130
    finally:
        sys.stdout, sys.stderr = streams


def _to_devnull(stream) -> None:
    """Point a stream whose reader has gone away at /dev/null: what is still buffered, and what comes, is dropped."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, stream.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):   # a stream without a file descriptor
        pass


class PipeSafe:
    """A command's stdout or stderr inside run(): when its reader goes away (`... | head -1`), the stream goes to
    /dev/null and the command goes on: the images are the work, what it prints on the way is not (a BrokenPipeError
    raised from a print would otherwise end the run with a traceback and no image)."""

    def __init__(self, stream):
        self._stream = stream

    def write(self, text):
        try:
            return self._stream.write(text)
        except BrokenPipeError:
            _to_devnull(self._stream)
            return len(text)

    def flush(self):
        try:
            self._stream.flush()
        except BrokenPipeError:
            _to_devnull(self._stream)
            try:
                self._stream.flush()
            except (BrokenPipeError, OSError, ValueError):
                pass

    def __getattr__(self, name):
        return getattr(self._stream, name)


def flush_output() -> None:
    """Flush stdout and stderr now (inside run()'s guard, not at interpreter shutdown). A reader of the output that
    has gone away (`| head`) takes nothing more: the stream is pointed at /dev/null, so that the shutdown's own
    flush does not print a BrokenPipeError traceback either."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BrokenPipeError:
            _to_devnull(stream)


def main_exit(main):
    """`if __name__ == "__main__": main_exit(main)`: sys.exit(main()) with Ctrl-C handled outside run()'s guard
    too. A Ctrl-C before the work (while the arguments are parsed, the modules imported) or in the moment after it
    is one line and 130; once main() has returned, SIGINT is ignored, so that the interpreter's shutdown (flushing
    the streams, atexit hooks, joining threads) is never cut short by a traceback or by death from the signal."""
    import signal  # light CLI: keeps `import mlxdiff.generate`'s module set
    code, returned = 130, False
    try:
        try:
            code = main()
            returned = True
        finally:
            signal.signal(signal.SIGINT, signal.SIG_IGN)
    except KeyboardInterrupt:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        print("mlxdiff: interrupted" + ("; the command had finished" if returned else ""), file=sys.stderr)
        code = 130
    sys.exit(code)


def parse_quantize(text):
    """"4" -> 4; "transformer=4,text_encoder_3=8" -> {"transformer": 4, "text_encoder_3": 8}; "unet=p6:g16" -> {"unet":
    "p6:g16"} (palettized: arguments.quantize_setting); checked as the API
    checks quantize= (a component named twice is refused, not overridden)."""
    if text is None:
        return None
    try:
        if "=" not in text:
            return check_quantize(quantize_word(text))
        value = {}
        for item in text.split(","):
            name, bits = (part.strip() for part in item.split("="))
            if not name:
                raise ValueError
            if name in value:
                raise MlxdiffError(f"--quantize {text!r}: {name} is given twice; give each component once")
            value[name] = quantize_word(bits)
    except ValueError:
        raise MlxdiffError(f"--quantize {text!r}: expected bits (e.g. 4) or component=bits pairs "
                           "(e.g. transformer=4,text_encoder_3=8, or palettized unet=p6)") from None
    return check_quantize(value)


def parse_text_encoders(values, takers=None):
    """--text-encoder values -> (text_encoder, text_encoders): "FILE" is one encoder file (load's text_encoder=);
    "NAME=FILE" (NAME: clip_l, clip_g or t5xxl; the option may repeat) the named ones (text_encoders=). `takers`:
    those two keywords -> the titles of the families that take each (the caller's registry), for the refusals. Which
    family takes which is checked by load."""
    takers = takers or {}

    def of(keyword, words):   # " for SD3.5, FLUX.1 or Chroma models", or nothing when the caller did not say
        *others, last = takers.get(keyword) or ("",)
        return f" {words} {', '.join(others) + ' or ' if others else ''}{last} models" if last else ""

    single, named = None, {}
    for value in values or []:
        name, sep, file = value.partition("=")
        if sep and "/" not in name and os.sep not in name:
            if name not in TEXT_ENCODER_NAMES:
                pairs = ", ".join(f"{n}=FILE" for n in TEXT_ENCODER_NAMES)
                raise MlxdiffError(f"--text-encoder {value!r}: {name!r} is not an encoder name"
                                   f"{of('text_encoders', 'of')}; use {pairs} (or one FILE{of('text_encoder', 'for')})")
            if name in named:
                raise MlxdiffError(f"--text-encoder: {name} is given twice; give each encoder once")
            named[name] = file
        elif single is not None:
            raise MlxdiffError(f"--text-encoder {value!r}: a second encoder file (after {single!r}); give one FILE"
                               f"{of('text_encoder', 'for')}")
        else:
            single = value
    if single is not None and named:
        raise MlxdiffError(f"--text-encoder: give either one FILE{of('text_encoder', 'for')} or NAME=FILE pairs"
                           f"{of('text_encoders', 'for')}, not both")
    return single, named or None


def parse_loras(values):
    """--lora values ("FILE" or "FILE:SCALE", repeatable) -> [(file, scale)], checked as the API checks loras=
    (arguments.check_loras); a FILE whose name holds a colon is taken whole when it exists."""
    if not values:
        return None
    out = []
    for value in values:
        file, sep, tail = value.rpartition(":")
        if not sep or (os.path.exists(value) and not os.path.exists(file)):
            file, scale = value, 1.0
        else:
            try:
                scale = float(tail)
            except ValueError:
                raise MlxdiffError(f"--lora {value!r}: SCALE {tail!r} is not a number; give FILE or FILE:SCALE, "
                                   "e.g. style.safetensors:0.8") from None
        if not file:
            raise MlxdiffError(f"--lora {value!r}: no file before the colon; give FILE or FILE:SCALE")
        try:
            out += check_loras([(file, scale)])
        except MlxdiffError as e:
            raise MlxdiffError(f"--lora {value!r}: {e}") from None
    return out


def parse_layers(text):
    """"7,8,9" -> [7, 8, 9] (the range is the pipeline's check)."""
    if text is None:
        return None
    try:
        return [int(x) for x in text.split(",")]
    except ValueError:
        raise MlxdiffError(f"--skip-guidance-layers {text!r}: expected layer indices such as 7,8,9") from None


def parse_control_mode(value: str, modes: dict):
    """--control-mode NAME_OR_INT -> the mode's number (its range is the ControlNet's, checked once it is read), or
    None for "none" (the mode of a ControlNet that is no Union one, beside one that is). `modes`: the Union
    ControlNets' names -> numbers (the caller's registry: Family.control_modes); a later name for a number that an
    earlier one has is an alias, left out of the refusal's list."""
    name = value.strip().lower().replace("_", "-").replace(" ", "-")
    if name == "none":
        return None
    if name in modes:
        return modes[name]
    if name.isdigit() and len(name) <= 5:
        return int(name)
    first = {}
    for mode, number in modes.items():
        first.setdefault(number, mode)
    raise MlxdiffError(f"--control-mode {value!r}: not a Union ControlNet mode; give one of "
                       + ", ".join(f"{mode} ({number})" for number, mode in first.items())
                       + ", a mode number, or none for a ControlNet that is no Union one")


# -- writing ---------------------------------------------------------------------------------------------------------

def write_error(path, error: OSError) -> MlxdiffError:
    """A failed write (disk full, file-size limit, read-only place) as one line."""
    return MlxdiffError(f"{path}: cannot write ({error.strerror or error}); nothing was written there")


def check_writable(path, option="--output", example="out.png") -> Path:
    """Fail before any work if the output cannot be written. The folder is probed by creating a file in it: its
    permission bits do not stop root, and /proc or a read-only mount refuse only the real thing. `example`: the
    file name suggested when a folder is given."""
    path = Path(path)
    parent = path.parent
    if path.is_dir():
        raise MlxdiffError(f"{path}: output path is a folder; give a file name such as {path / example}")
    if path.exists() and not path.is_file():   # os.replace would put a regular file in place of /dev/null
        raise MlxdiffError(f"{path}: output is not a regular file (a device, pipe or socket); give a file name")
    if not parent.is_dir():
        what = "is not a folder" if parent.exists() else "does not exist; create it first"
        raise MlxdiffError(f"{path}: output folder {parent} {what}")
    if path.exists() and not os.access(path, os.W_OK):
        raise MlxdiffError(f"{path}: output is not writable; choose another {option}")
    try:
        fd, probe = tempfile.mkstemp(prefix=".mlxdiff-", suffix=".png", dir=parent)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise MlxdiffError(f"{path}: output is not writable ({e.strerror or e}); choose another {option}") from None
    return path


def check_png_name(path) -> Path:
    """An output whose suffix names another image format (out.jpg, out.webp) would get PNG bytes under that name:
    refused in one line. Other names (out.png, out, out.img) take the PNG as they are."""
    from PIL import Image  # heavy: PIL, kept out of `import mlxdiff.generate`
    path = Path(path)
    kind = Image.registered_extensions().get(path.suffix.lower())
    if kind is not None and kind != "PNG":
        raise MlxdiffError(f"{path}: mlxdiff writes PNG files (the generation parameters go in their text chunks), "
                           f"not {kind}; name the output {path.with_suffix('.png').name}")
    return path


def save_png(image, path, parameters: dict) -> Path:
    """Write atomically (temp file + rename), so a failure (disk full, file-size limit) never leaves a partial PNG;
    it is one MlxdiffError line."""
    from PIL.PngImagePlugin import PngInfo  # heavy: as PIL above
    path = check_writable(path)
    info = PngInfo()
    info.add_text("parameters", "; ".join(f"{k}: {v}" for k, v in parameters.items()))
    for k, v in parameters.items():
        info.add_text(f"mlxdiff:{k}", str(v))
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(prefix=".mlxdiff-", suffix=".png", dir=path.parent)
        with os.fdopen(fd, "wb") as f:
            image.save(f, format="PNG", pnginfo=info)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes 0600; an image should get the usual permissions
        os.replace(tmp, path)
    except BaseException as e:
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)
        if isinstance(e, OSError):
            raise write_error(path, e) from None
        raise
    return path
