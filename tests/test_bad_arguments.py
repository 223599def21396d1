"""Every bad argument is refused in one line (issue 13): tables of CLI and API mistakes, each run in its own forked
child under a memory cap and a timeout (tests/adversarial.py). Each must end as a user mistake ends (exit 2, one
`mlxdiff:` line on stderr, no traceback; Ctrl-C: exit 130, one line), name what was wrong, and leave no output
file, temp file or partial folder behind. Generate cases refuse before any weights are read wherever they can.
SD3.5-only checks (skip-layer range) are in test_cli.py, beside the tiny SD3 folder it builds anyway."""

import os
import stat
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from adversarial import refused, run_cases  # noqa: E402

from mlxdiff import default_model  # noqa: E402

MODEL = str(default_model.FOLDER)
CHEAP = ["--model", MODEL, "--steps", "1", "--width", "16", "--height", "16", "--no-progress"]
PNG_RUN = ["--model", MODEL, "--steps", "1", "--width", "64", "--height", "64", "--no-progress"]


def gen(*argv):
    return {"cli": "mlxdiff.generate", "argv": [*CHEAP, "--output", "{out}", *argv]}


def via_main(module, argv, prelude=""):
    """An "api" case that runs a command's main() after `prelude` (resource limits, a patched function) and exits
    with its code."""
    return {"api": f"{prelude}\nimport importlib, os, sys\nrc = importlib.import_module({module!r}).main({argv!r})\n"
                   "sys.stdout.flush(); sys.stderr.flush(); os._exit(rc)\n"}


API = ("import numpy as np\nimport mlxdiff\n"
       f"pipe = mlxdiff.load({MODEL!r})\nKW = dict(steps=1, width=16, height=16, progress_bar=False)\n")


def api(source):
    return {"api": API + source}


# the finding each case covers -> (case, what the one line must name)
CLI = {
    # zero is not "the default"; sizes and steps bounded up front
    "width 0": (gen("--width", "0"), "width=0"),
    "height 0": (gen("--height", "0"), "height=0"),
    "steps 0": (gen("--steps", "0"), "steps=0"),
    "width 100000": (gen("--width", "100000"), "width=100000"),
    "steps 1e9": (gen("--steps", "1000000000"), "steps=1000000000"),
    "width not a multiple": (gen("--width", "20"), "multiple"),
    # guidance finite and >= 0
    "guidance nan": (gen("--guidance", "nan"), "guidance=nan"),
    "guidance -inf": (gen("--guidance=-inf"), "guidance=-inf"),
    "guidance inf": (gen("--guidance", "inf"), "guidance=inf"),
    "guidance -1": (gen("--guidance", "-1"), "guidance=-1"),
    # seeds 0 .. 2^64-1
    "seed -1": (gen("--seed", "-1"), "seed=-1"),
    "seed 2^64": (gen("--seed", str(2 ** 64)), f"seed={2 ** 64}"),
    "seed 2^70": (gen("--seed", str(2 ** 70)), f"seed={2 ** 70}"),
    "seeds past 2^64-1": (gen("--seed", str(2 ** 64 - 1), "--num-images", "2"), f"seed={2 ** 64}"),
    "num-images 0": (gen("--num-images", "0"), "num_images=0"),
    "num-images vs seeds": (gen("--seed", "1", "2", "--num-images", "3"), "--num-images 3"),
    # FLUX.2's files: a missing VAE file; no --model: the transformer must be a BFL-named file, with its companions
    "vae missing": (gen("--vae", "{tmp}/no-such-vae.safetensors"), "no-such-vae.safetensors"),
    "vae a folder": (gen("--vae", "{tmp}"), "is a folder"),
    "files: diffusers-named transformer": (
        {"cli": "mlxdiff.generate", "argv": ["--transformer", f"{MODEL}/transformer/diffusion_pytorch_model.safetensors",
                                             "--steps", "1", "--no-progress", "--output", "{out}"]}, "BFL / ComfyUI"),
    # argv bytes that are not UTF-8 arrive as lone surrogates
    "non-UTF-8 prompt": (gen("--prompt", "a red \udcff circle"), "UTF-8"),
    "non-UTF-8 negative prompt": (gen("--negative-prompt", "\udce9"), "UTF-8"),
    "prompt and prompts file": (gen("--prompt", "a", "--prompts-file", "x.txt"), "one of them"),
    # memory limits finite, positive, below 2 x physical memory
    "memory-limit nan": (gen("--memory-limit", "nan"), "memory_limit=nan"),
    "memory-limit inf": (gen("--memory-limit", "inf"), "memory_limit=inf"),
    "memory-limit 1e300": (gen("--memory-limit", "1e300"), "memory_limit=1e+300"),
    "memory-limit 0": (gen("--memory-limit", "0"), "memory_limit=0"),
    # options the family has
    "skip layers on FLUX.2": (gen("--skip-guidance-layers", "7,8"), "SD3.5"),
    "skip layers not numbers": (gen("--skip-guidance-layers", "7,x"), "--skip-guidance-layers"),
    # quantize: no duplicates, supported bits, known components
    "quantize twice": (gen("--quantize", "transformer=8,transformer=4"), "twice"),
    "quantize 7 bits": (gen("--quantize", "7"), "7-bit"),
    "quantize 2 bits": (gen("--quantize", "transformer=2"), "2-bit"),
    "quantize unknown component": (gen("--quantize", "unet=4"), "unknown component 'unet'"),
    "quantize empty value": (gen("--quantize", "transformer="), "expected bits"),
    "dtype": (gen("--dtype", "float64"), "float64"),
    "keep": (gen("--keep", "sometimes"), "--keep"),
    # argparse's own mistakes: one line too
    "parse: not an int": (gen("--width", "abc"), "--width"),
    "parse: unknown option": (gen("--bogus"), "--bogus"),
    "parse: missing value": (gen("--seed"), "--seed"),
    "parse: convert needs DEST": ({"cli": "mlxdiff.convert", "argv": [MODEL]}, "dest"),
    "parse: footprint subcommand": ({"cli": "mlxdiff.footprint", "argv": ["sample"]}, "sample"),
    # outputs
    "output /dev/null": (gen("--output", "/dev/null"), "regular file"),
    "output folder is a file": (gen("--output", "{tmp}/a-file/out.png"), "not a folder"),
    "output under /proc": (gen("--output", "/proc/mlxdiff-out.png"), "not writable"),
    "output folder missing": (gen("--output", "{tmp}/missing/out.png"), "does not exist"),
    "output named as a JPEG": (gen("--output", "{tmp}/out.jpg"), "writes PNG files"),
    "output named as a WebP": (gen("--output", "{tmp}/out.WEBP"), "not WEBP"),
    # disk full / file-size limit midway through the PNG (after a whole 1-step run): one line, no partial PNG. The
    # same run goes first without the limit: mlx-cpu builds its fused kernels into files under the temp folder,
    # which the limit would stop on a machine whose kernel cache is still empty (the case below)
    "png write fails midway": (via_main("mlxdiff.generate", PNG_RUN + ["--output", "{out}"],
        f"import importlib\nimportlib.import_module('mlxdiff.generate').main({PNG_RUN + ['--output', '{tmp}/warm-up.png']!r})"
        "\nimport resource; resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))"), "File too large"),
    # the temp folder where mlx-cpu builds its kernels: missing, or its writes failing (an empty kernel cache, so
    # that the build runs)
    "temp folder missing": (via_main("mlxdiff.generate", PNG_RUN + ["--output", "{out}"],
                                     "import os; os.environ['TMPDIR'] = '/proc/mlxdiff-no-such-folder'"),
                            "the temp folder does not exist"),
    "kernel build write fails": (via_main("mlxdiff.generate", PNG_RUN + ["--output", "{out}"],
        "import os, resource, tempfile; os.environ['TMPDIR'] = tempfile.mkdtemp(dir='{tmp}')"
        "\nresource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))"), "file-size limit"),
    # convert: read-only / full destination, bad arguments
    "convert into /proc": ({"cli": "mlxdiff.convert", "argv": [MODEL, "/proc/mlxdiff-native"]}, "cannot write"),
    "convert into a file's folder": ({"cli": "mlxdiff.convert", "argv": [MODEL, "{tmp}/a-file/native"]},
                                     "not a folder"),
    "convert quantize 9": ({"cli": "mlxdiff.convert", "argv": [MODEL, "{tmp}/q9", "--quantize", "9"]}, "9-bit"),
    "convert disk full": (via_main("mlxdiff.convert", [MODEL, "{tmp}/full-native"],
                                   "import resource; resource.setrlimit(resource.RLIMIT_FSIZE, (65536, 65536))"),
                          "cannot write"),
    # footprint: its writes and its command
    "footprint json under /proc": ({"cli": "mlxdiff.footprint", "argv": ["run", "--json", "/proc/f.json", "--",
                                                                         "true"]}, "--json"),
    "footprint out under /proc": ({"cli": "mlxdiff.footprint", "argv": ["compare", "--out", "/proc/fp-out"]},
                                  "cannot write"),
    "footprint no such command": ({"cli": "mlxdiff.footprint", "argv": ["run", "--", "/nonexistent/cmd"]},
                                  "cannot run"),
    "footprint interval 0": ({"cli": "mlxdiff.footprint", "argv": ["run", "--interval", "0", "--", "true"]},
                             "interval=0"),
    "footprint show no file": ({"cli": "mlxdiff.footprint", "argv": ["show", "/nonexistent/footprint.json"]},
                               "not a footprint.json"),
    "footprint show not its json": ({"cli": "mlxdiff.footprint", "argv": ["show", MODEL + "/model_index.json"]},
                                    "not a footprint.json"),
}

APIS = {
    "steps=2.5": (api("pipe.generate('a', **{**KW, 'steps': 2.5})"), "steps=2.5"),
    "steps=0": (api("pipe.generate('a', **{**KW, 'steps': 0})"), "steps=0"),
    "width=0": (api("pipe.generate('a', **{**KW, 'width': 0})"), "width=0"),
    "seed=-1": (api("pipe.generate('a', seed=-1, **KW)"), "seed=-1"),
    "seed=2**64": (api("pipe.generate('a', seed=2**64, **KW)"), "seed="),
    "seed=1.5": (api("pipe.generate('a', seed=1.5, **KW)"), "seed=1.5"),
    "guidance=inf": (api("pipe.generate('a', guidance=float('inf'), **KW)"), "guidance=inf"),
    "guidance=True": (api("pipe.generate('a', guidance=True, **KW)"), "guidance=True"),
    "NaN latents": (api("pipe.generate('a', latents=np.full((1, 32, 2, 2), np.nan), **KW)"), "NaN"),
    "latents of strings": (api("pipe.generate('a', latents=np.array([['x']]), **KW)"), "latents"),
    "generate([])": (api("pipe.generate([], **KW)"), "prompt=[]"),
    "generate(5)": (api("pipe.generate(5, **KW)"), "prompt=5"),
    "temp folder missing": (api("import os; os.environ['TMPDIR'] = '/proc/mlxdiff-no-such-folder'\n"
                                "pipe.generate('a', **KW)"), "the temp folder does not exist"),
    "prompt list of non-str": (api("pipe.generate(['a', None], **KW)"), "prompt=None"),
    "no prompt": (api("pipe.generate(**KW)"), "give a prompt"),
    "surrogate prompt": (api("pipe.generate('\\udcff', **KW)"), "UTF-8"),
    "skip layers on FLUX.2": (api("pipe.generate('a', skip_guidance_layers=[1], **KW)"), "SD3.5"),
    "unknown generate argument": (api("pipe.generate('a', stpes=3, **KW)"), "stpes"),
    "quantize='4'": (api("mlxdiff.load(%r, quantize='4')" % MODEL), "quantize='4'"),
    "quantize={t: '4'}": (api("mlxdiff.load(%r, quantize={'transformer': '4'})" % MODEL), "'4'"),
    "quantize={t: True}": (api("mlxdiff.load(%r, quantize={'transformer': True})" % MODEL), "True"),
    "quantize={t: 4, group 48}": (api("mlxdiff.load(%r, quantize={'transformer': {'bits': 4, 'group_size': 48}})"
                                      % MODEL), "group size 48"),
    "transformer=5": (api("mlxdiff.load(%r, transformer=5)" % MODEL), "transformer=5"),
    "load(None)": (api("mlxdiff.load(None)"), "model=None"),
    "vae=5": (api("mlxdiff.load(%r, vae=5)" % MODEL), "vae=5"),
    "tokenizer=b''": (api("mlxdiff.load(%r, tokenizer=b'')" % MODEL), "tokenizer=b''"),
    "tokenizer not a folder": (api("mlxdiff.load(%r, tokenizer='{tmp}/a-file')" % MODEL), "tokenizer folder"),
    "load('')": (api("mlxdiff.load('')"), "model=''"),
    "text_encoders with a folder": (api("mlxdiff.load(%r, text_encoders={'t5xxl': 't5.safetensors'})" % MODEL),
                                    "single-file"),
    "text_encoders unknown name": (api("mlxdiff.load(%r, text_encoders={'t6': 'x'})" % MODEL), "clip_l"),
    "unknown load argument": (api("mlxdiff.load(%r, dtpye='float16')" % MODEL), "dtpye"),
    "keep=": (api("mlxdiff.load(%r, keep='most')" % MODEL), "keep='most'"),
    "memory limit nan": (api("mlxdiff.load(%r, memory_limit=float('nan'))" % MODEL), "memory_limit=nan"),
    "memory limit 1e300": (api("mlxdiff.load(%r, memory_limit=1e300)" % MODEL), "memory_limit=1e+300"),
    "memory limit '4'": (api("mlxdiff.load(%r, memory_limit='4')" % MODEL), "memory_limit='4'"),
    "SD3 option on FLUX.2": (api("pipe.generate('a', clip_skip=1, **KW)"), "clip_skip"),
    # Ctrl-C: one line, 130 (checked apart: not exit 2)
    "generate interrupted": (via_main("mlxdiff.generate", CHEAP + ["--output", "{out}"],
                                      "import signal, mlxdiff.pipelines.flux2 as f\n"
                                      "f.Flux2Pipeline.encode_prompt = lambda *a, **k: signal.raise_signal(2)"),
                             "interrupted"),
    "convert interrupted": (via_main("mlxdiff.convert", [MODEL, "{tmp}/cut-native"],
                                     "import signal, mlx.core as mx\nsave = mx.save_safetensors\n"
                                     "def cut(*a, **k):\n    save(*a, **k)\n    signal.raise_signal(signal.SIGINT)\n"
                                     "mx.save_safetensors = cut"), "interrupted"),
}


def _fill(case, **values):
    """{out} and {tmp} in a case's argv or source -> this case's own output path and the shared folder."""
    def fill(text):
        for k, v in values.items():
            text = text.replace("{" + k + "}", str(v))
        return text
    if "argv" in case:
        return {**case, "argv": [fill(a) for a in case["argv"]]}
    return {**case, "api": fill(case["api"])}


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bad-arguments")
    (tmp / "a-file").write_text("a regular file where a folder is expected")
    dev_null = os.stat("/dev/null")
    table = {**{f"cli: {k}": v for k, v in CLI.items()}, **{f"api: {k}": v for k, v in APIS.items()}}
    outs = {name: tmp / f"case-{i}.png" for i, name in enumerate(table)}
    cases = [_fill(case, out=outs[name], tmp=tmp) for name, (case, _) in table.items()]
    results = dict(zip(table, run_cases(cases, tmp)))
    assert os.stat("/dev/null").st_rdev == dev_null.st_rdev and stat.S_ISCHR(os.stat("/dev/null").st_mode)
    return tmp, table, outs, results


def _one_line(outcome):
    return [line for line in outcome.stderr.splitlines() if line.strip()][0]


@pytest.mark.parametrize("name", [f"cli: {k}" for k in CLI] + [f"api: {k}" for k in APIS])
def test_refused_in_one_line(outcomes, name):
    tmp, table, outs, results = outcomes
    outcome, needle = results[name], table[name][1]
    if name.endswith("interrupted"):
        lines = [line for line in outcome.stderr.splitlines() if line.strip()]
        assert outcome.rc == 130 and len(lines) == 1 and lines[0].startswith("mlxdiff: interrupted"), \
            outcome.describe()
    else:
        assert refused(outcome), outcome.describe()
        assert _one_line(outcome).startswith("mlxdiff: error: "), outcome.describe()
    assert needle in _one_line(outcome), (needle, outcome.describe())
    assert not outs[name].exists()
    leftovers = [p.name for p in tmp.iterdir() if p.name.startswith(".") or p.name.endswith("-native")
                 or p.name.startswith(outs[name].stem)]
    assert not leftovers, leftovers


def test_cli_and_api_say_the_same(outcomes):
    """One checker: the API's message is the CLI's."""
    _, _, _, results = outcomes
    for cli, api_ in (("steps 0", "steps=0"), ("width 0", "width=0"), ("seed -1", "seed=-1"),
                      ("guidance inf", "guidance=inf"), ("memory-limit nan", "memory limit nan"),
                      ("skip layers on FLUX.2", "skip layers on FLUX.2")):
        assert _one_line(results[f"cli: {cli}"]) == _one_line(results[f"api: {api_}"])


def test_bad_device_setting_in_one_line(tmp_path):
    """MLXDIFF_DEVICE acts when mlxdiff is imported; a bad value is still one line and exit 2 (the command's switch
    check, policy.from_switches), nothing written."""
    import subprocess
    out = tmp_path / "x.png"
    p = subprocess.run([sys.executable, "-m", "mlxdiff.generate", *CHEAP, "--output", str(out)], capture_output=True,
                       text=True, timeout=300, env={**os.environ, "MLXDIFF_DEVICE": "tpu"})
    lines = [line for line in p.stderr.splitlines() if line.strip()]
    assert p.returncode == 2 and len(lines) == 1 and "MLXDIFF_DEVICE='tpu'" in lines[0], p.stderr
    assert not out.exists()
