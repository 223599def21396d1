"""One image per process, the whole process timed from outside: mlxdiff's CLI beside diffusers' pipeline (issue 40's
"whole process at most diffusers'" for Z-Image-Turbo), on the same random real-config folder.

    python bench/whole_process_gpu.py diffusers FOLDER [--size 1024] [--steps 8] [--guidance 0] [--negative-prompt T]
    python bench/whole_process_gpu.py mlxdiff   FOLDER [same options]     # runs `python -m mlxdiff.generate`
    python bench/whole_process_gpu.py pairs     FOLDER [--repeat 2] [same options]   # A B A B, each its own process

`diffusers`: imports, from_pretrained (bf16) onto the GPU (cuda; --device cpu for the CPU check), one image, exit;
prints one RESULT json line with its own split (import_s, load_s, image_s, step_s from the step callbacks' median
gap). `mlxdiff`: the CLI, one image. `pairs`: each side as a fresh `python3` process, the sides alternating,
process_s = wall clock from before the process starts to its exit (imports, CUDA context, loading, kernel
compilation, the image, teardown), one RESULT line per process; on CUDA each process also under one memory ruler
for both sides, nvidia-smi's memory.used every 0.1 s less the idle reading before it (smi_peak_gib; NO_SMI=1 or
no nvidia-smi: none). Z-Image-Turbo: --steps 8 --guidance 0 (Turbo's way: diffusers' guidance_scale 0 = no CFG).
A folder with only modular_model_index.json (FLUX 3: bench/make_random_models.py flux3-klein) runs as diffusers'
modular pipeline: its blocks without the prompt upsampler (the prompt as given, mlxdiff's default too), the
components loaded in bf16, the tokenizer handed over as tests/flux3_helpers.py does; step_s from the transformer's
forwards (one a step). Random weights: only time means anything.
CPU check at tiny size:
    python bench/make_random_models.py zimage-turbo-tiny --out /tmp/zt
    python bench/whole_process_gpu.py pairs /tmp/zt --size 64 --steps 2 --repeat 1 --device cpu
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

T0 = time.perf_counter()
ROOT = Path(__file__).resolve().parent.parent
PROMPT = "a photo of a fox in the snow"


class ChatTokenizer:
    """What FLUX 3's modular text encoder step calls of its AutoProcessor (`apply_chat_template`, `.tokenizer`), over
    the folder's tokenizer (tests/flux3_helpers.Processor: for a prompt of text alone the processor renders the same
    chat template)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def apply_chat_template(self, messages, **kwargs):
        return self.tokenizer.apply_chat_template(messages, **kwargs)


def modular_pipeline(folder, device):
    """A modular_model_index.json folder as diffusers' ModularPipeline (module docstring)."""
    import torch
    from diffusers import modular_pipelines
    from transformers import AutoTokenizer
    index = json.loads((Path(folder) / "modular_model_index.json").read_text())
    blocks = getattr(modular_pipelines, index["_blocks_class_name"])()
    blocks.sub_blocks.pop("prompt_upsampler", None)
    pipe = blocks.init_pipeline(folder)
    pipe.load_components(names=["text_encoder", "transformer", "vae"], torch_dtype=torch.bfloat16)
    pipe.update_components(tokenizer=ChatTokenizer(AutoTokenizer.from_pretrained(str(Path(folder) / "tokenizer"))))
    return pipe.to(device)


def diffusers_side(a):
    import torch
    import diffusers
    imported = time.perf_counter()
    modular = not (Path(a.folder) / "model_index.json").is_file()
    if modular:
        pipe = modular_pipeline(a.folder, a.device)
    else:
        index = json.loads((Path(a.folder) / "model_index.json").read_text())
        pipe = getattr(diffusers, index["_class_name"]).from_pretrained(a.folder, torch_dtype=torch.bfloat16)
        pipe = pipe.to(a.device)
    sync = torch.cuda.synchronize if a.device == "cuda" else (lambda: None)
    sync()
    loaded = time.perf_counter()
    gaps = []

    def on_step(p, i, t, kw):
        sync()
        gaps.append(time.perf_counter())
        return kw
    kw = dict(negative_prompt=a.negative_prompt) if a.negative_prompt is not None else {}
    if a.guidance is not None:
        kw["guidance_scale"] = a.guidance
    generator = torch.Generator(a.device).manual_seed(1)
    if modular:     # no step callback there: the end of each transformer forward (one a step) marks a step
        pipe.transformer.register_forward_hook(lambda module, args, out: on_step(None, None, None, None))
        image = pipe(prompt=PROMPT, width=a.size, height=a.size, num_inference_steps=a.steps, generator=generator,
                     output="images", **kw)[0]
    else:
        image = pipe(PROMPT, width=a.size, height=a.size, num_inference_steps=a.steps, generator=generator,
                     callback_on_step_end=on_step, **kw).images[0]
    sync()
    done = time.perf_counter()
    if a.output:
        image.save(a.output)
    steps = [y - x for x, y in zip(gaps, gaps[1:])]
    row = {"side": "diffusers", "import_s": imported - T0, "load_s": loaded - imported, "image_s": done - loaded,
           "step_s": statistics.median(steps) if steps else None, "in_process_s": done - T0}
    if a.device == "cuda":
        row["peak_gb"] = torch.cuda.max_memory_allocated() / 1024 ** 3
    print("RESULT" + json.dumps(row), flush=True)


def side_command(side, a):
    opts = ["--steps", str(a.steps)] + (["--guidance", str(a.guidance)] if a.guidance is not None else []) + (
        ["--negative-prompt", a.negative_prompt] if a.negative_prompt is not None else [])
    if side == "mlxdiff":
        return [sys.executable, "-m", "mlxdiff.generate", "--model", a.folder, "--prompt", PROMPT, "--width",
                str(a.size), "--height", str(a.size), "--seed", "1", "--output", a.output or "/tmp/whole_mlxdiff.png",
                *opts]
    return [sys.executable, __file__, "diffusers", a.folder, "--size", str(a.size), "--device", a.device, *opts]


def mlxdiff_side(a):
    sys.exit(subprocess.call(side_command("mlxdiff", a), cwd=ROOT))


SMI = ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"]


def smi_ruler(a):
    """Whether the outside memory ruler runs: on CUDA, with nvidia-smi there, unless NO_SMI is set."""
    return a.device == "cuda" and not os.environ.get("NO_SMI") and shutil.which("nvidia-smi") is not None


def pairs(a):
    for rep in range(1, a.repeat + 1):
        for side in ("mlxdiff", "diffusers"):
            ruler = {}
            if smi_ruler(a):
                idle = float(subprocess.run(SMI, capture_output=True, text=True).stdout.split()[0])
                sampler = subprocess.Popen(SMI + ["-lms", "100"], stdout=subprocess.PIPE, text=True)
            t = time.perf_counter()
            done = subprocess.run(side_command(side, a), cwd=ROOT, capture_output=True, text=True)
            seconds = time.perf_counter() - t
            if smi_ruler(a):
                sampler.terminate()
                used = [float(x) for x in sampler.communicate()[0].split()]
                ruler = {"smi_idle_mib": idle, "smi_peak_gib": (max(used, default=idle) - idle) / 1024}
            inner = [json.loads(line[6:]) for line in done.stdout.splitlines() if line.startswith("RESULT")]
            tail = (done.stdout + done.stderr).strip().splitlines()[-3:]
            print("RESULT" + json.dumps({"side": side, "rep": rep, "process_s": seconds, "rc": done.returncode,
                                         **ruler, **(inner[0] if inner else {"tail": tail})}), flush=True)


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("side", choices=("mlxdiff", "diffusers", "pairs"))
    p.add_argument("folder")
    p.add_argument("--size", type=int, default=1024)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--guidance", type=float, default=None)
    p.add_argument("--negative-prompt", default=None)
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="diffusers' side")
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--output", default=None)
    a = p.parse_args()
    {"diffusers": diffusers_side, "mlxdiff": mlxdiff_side, "pairs": pairs}[a.side](a)
