"""Process-memory test pieces shared by several test modules (no test module imports another): the embedded default
with a transformer of another size, a generate call sampled from outside (tests/test_process_memory.py) and the
count of streamed blocks (tests/test_streaming.py)."""

import json
import os
import shutil
import subprocess
import sys

import mlxdiff  # noqa: F401  (OpenBLAS preload before mlx)
from mlxdiff import default_model
from mlxdiff.footprint import report_peaks
from mlxdiff.loading.streaming import StreamedBlock


MiB = 2 ** 20
# glibc keeps a freed block in its heap (in RSS) when it was below its mmap threshold, which grows with the blocks
# freed up to DEFAULT_MMAP_THRESHOLD_MAX, 32 MiB on 64-bit; memory.release_host_memory trims it at a load's end
HEAP_RETAINED = 32 * MiB


def load_buffers(config) -> int:
    """What a load holds on the host beyond MLX's count, from what the loaders do: one tensor at a time is read and
    converted through numpy (a GGUF tensor's blocks decoded, a dtype cast), so at most the largest tensor of the
    model in float32, plus the heap glibc retains after those buffers are freed (HEAP_RETAINED)."""
    import torch
    from diffusers import Flux2Transformer2DModel
    with torch.device("meta"):
        largest = max(p.numel() for p in Flux2Transformer2DModel(**config).state_dict().values())
    return 4 * largest + HEAP_RETAINED


def default_with_transformer(folder, config, scale=None):
    """The embedded default copied to `folder` with a random bf16 FLUX.2 transformer of `config` (seed 0; its
    weights times `scale` if given) in place of its own. Returns the torch transformer."""
    import torch
    from diffusers import Flux2Transformer2DModel
    shutil.copytree(default_model.folder(), folder)
    shutil.rmtree(folder / "transformer")
    torch.manual_seed(0)
    model = Flux2Transformer2DModel(**config).to(torch.bfloat16)
    if scale is not None:
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(scale)
    model.save_pretrained(str(folder / "transformer"))
    return model


def sampled_generate(tmp_path, name, *args, steps=2):
    """(what it printed, the --report-memory peaks, the outside sampler's peak) for one `mlxdiff.generate` call
    (`steps` steps of the embedded default's prompt, image at tmp_path / NAME.png) sampled from outside every 10 ms."""
    out = tmp_path / f"{name}.json"
    cmd = [sys.executable, "-m", "mlxdiff.footprint", "run", "--interval", "0.01", "--json", str(out), "--",
           sys.executable, "-m", "mlxdiff.generate", "--prompt", default_model.PROMPT, "--steps", str(steps),
           "--no-progress", "--report-memory", "--output", str(tmp_path / f"{name}.png"), *args]
    # on the CPU wherever it runs: the outside sampler and the CLI then measure the same RSS (on a GPU the CLI's
    # headline is NVML's GPU bytes, which an RSS sampler cannot see)
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env={**os.environ, "MLXDIFF_DEVICE": "cpu"})
    assert p.returncode == 0, p.stderr[-2000:]
    saved = json.loads(out.read_text())
    assert saved["run"]["measured"] == ["RSS"]
    return saved["run"]["stdout"], report_peaks(saved["run"]["stdout"]), saved["summary"]["peak"]


def streamed_count(model) -> int:
    return sum(isinstance(m, StreamedBlock) for blocks in (model.transformer_blocks, model.single_transformer_blocks)
               for m in blocks)
