"""What the process holds (memory.process_memory, sampled through each phase by memory.PeakSampler), checked from
outside the process: `python -m mlxdiff.footprint run` samples the CLI's RSS every 10 ms while it generates.

For a mid-size GGUF transformer in bfloat16 compute and a mid-size safetensors pipeline, each with and without
--memory-limit, on this CPU:
- the process peak that --report-memory reports (the largest over the phases) is within 5% of the outside peak;
- the process holds at most the largest phase's MLX peak plus a fixed allowance: what the same command holds
  beyond MLX's arrays for the embedded default model (15 MB of weights), i.e. the interpreter, the imports and the
  tokenizers, measured in the same test, with 15% of slack, plus LOAD_BUFFERS for a load's host buffers.
"""

import json
import mmap
import shutil
import subprocess
import sys

import numpy as np
import pytest

from mlxdiff import default_model, memory
from mlxdiff.footprint import report_peaks

MiB = 2 ** 20
# host buffers of a load that MLX does not count: numpy's copy of a GGUF tensor and its conversion chunks, the C
# heap's rounding (glibc), freed at the load's end (memory.release_host_memory); 63-76 MiB above the allowance for
# the GGUF runs below on this CPU, 7-13 MiB for the safetensors ones
LOAD_BUFFERS = 96 * MiB
# a mid-size FLUX.2 transformer that fits the embedded default's encoder and VAE: D = 1536 (12 x 128),
# 2 double + 4 single blocks: 0.25 B parameters, 0.49 GB in bfloat16, 0.15 GB in city96's Q4_K_M mix
MID = dict(patch_size=1, in_channels=32, out_channels=None, num_layers=2, num_single_layers=4, attention_head_dim=128,
           num_attention_heads=12, joint_attention_dim=192, timestep_guidance_channels=64, mlp_ratio=3.0,
           axes_dims_rope=(32, 32, 32, 32), rope_theta=2000, eps=1e-6, guidance_embeds=False)


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


@pytest.fixture(scope="module")
def mid_models(tmp_path_factory):
    """(a pipeline folder with a mid-size bf16 safetensors transformer, a mid-size Q4_K_M GGUF transformer file)."""
    import torch
    from diffusers import Flux2Transformer2DModel
    from test_gguf_models import write_city96_gguf
    from twins import flux2_to_bfl
    root = tmp_path_factory.mktemp("process_memory")
    folder = root / "mid"
    default_with_transformer(folder, MID)
    with torch.device("meta"):
        shapes = flux2_to_bfl(Flux2Transformer2DModel(**MID).state_dict(), MID)
    gguf = root / "mid-Q4_K_M.gguf"
    write_city96_gguf(gguf, shapes, "flux2", "flux", random=True)
    return folder, gguf


def sampled_generate(tmp_path, name, *args, steps=2):
    """(what it printed, the --report-memory peaks, the outside sampler's peak) for one `mlxdiff.generate` call
    (`steps` steps of the embedded default's prompt, image at tmp_path / NAME.png) sampled from outside every 10 ms."""
    out = tmp_path / f"{name}.json"
    cmd = [sys.executable, "-m", "mlxdiff.footprint", "run", "--interval", "0.01", "--json", str(out), "--",
           sys.executable, "-m", "mlxdiff.generate", "--prompt", default_model.PROMPT, "--steps", str(steps),
           "--no-progress", "--report-memory", "--output", str(tmp_path / f"{name}.png"), *args]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-2000:]
    saved = json.loads(out.read_text())
    assert saved["run"]["measured"] == ["RSS"]
    return saved["run"]["stdout"], report_peaks(saved["run"]["stdout"]), saved["summary"]["peak"]


def _run(tmp_path, name, *args, steps=2):
    """(the CLI's reported process peak, its largest MLX peak, the outside sampler's peak) for one generate call."""
    stdout, peaks, outside = sampled_generate(tmp_path, name, *args, steps=steps)
    assert "process memory: RSS, sampled through each phase" in stdout
    return max(peaks["process"].values()), max(peaks["mlx"].values()), outside


def test_reported_process_peak_matches_an_outside_sampler(mid_models, tmp_path):
    folder, gguf = mid_models
    _, tiny_mlx, tiny_outside = _run(tmp_path, "default")
    allowance = tiny_outside - tiny_mlx
    print(f"\nembedded default: {tiny_outside / MiB:.0f} MiB held, {tiny_mlx / MiB:.0f} MiB of it MLX's peak: "
          f"allowance {allowance / MiB:.0f} MiB")
    # the bf16 runs take one step: this CPU has no bf16 arithmetic (26 s a step here), and the first step holds
    # the denoise phase's peak (the weights are loaded before it, its activations are the same at every step)
    runs = {
        "gguf bf16": (["--model", str(folder), "--transformer", str(gguf), "--dtype", "bfloat16"], 1),
        "safetensors": (["--model", str(folder)], 2),
    }
    for label, (args, steps) in runs.items():
        for limit in (None, "3"):
            name = label.replace(" ", "_") + ("" if limit is None else "_limit")
            reported, mlx_peak, outside = _run(tmp_path, name, *args, *(["--memory-limit", limit] if limit else []),
                                               steps=steps)
            print(f"{label}{'' if limit is None else ', --memory-limit ' + limit}: reported {reported / MiB:.0f} "
                  f"MiB, outside {outside / MiB:.0f} MiB, MLX peak {mlx_peak / MiB:.0f} MiB, beyond MLX "
                  f"{(outside - mlx_peak) / MiB:.0f} MiB")
            assert mlx_peak > 100 * MiB                           # a mid-size model really ran
            assert abs(reported - outside) <= 0.05 * outside, (reported, outside)
            assert outside <= mlx_peak + 1.15 * allowance + LOAD_BUFFERS, (outside, mlx_peak, allowance)


def test_process_memory_readers():
    """The headline per platform: RSS on this CPU, its peak at least the reading; the sampler keeps the largest."""
    now = memory.process_memory()
    assert now["kind"] == "RSS" and now["footprint"] == now["host"] > 10 * MiB and now["host_peak"] >= now["host"]
    assert memory.process_memory(device="gpu")["kind"] == "RSS"     # no NVML here: nothing to read on a GPU
    with memory.PeakSampler(interval=0.005) as sampler:
        block = mmap.mmap(-1, 64 * MiB)    # 64 MiB of new pages (not reused heap), touched, then unmapped
        block.write(b"\1" * (64 * MiB))
        block.close()
    assert sampler.peak >= now["footprint"] + 60 * MiB and sampler.kind == "RSS"
    assert sampler.last < sampler.peak


def test_phys_footprint_reader_is_guarded():
    """The macOS reader: rusage_info_v2 as <sys/resource.h> lays it out (phys_footprint after a 16-byte uuid and
    seven uint64 fields: offset 72), and off macOS no libSystem: None, never an exception."""
    import ctypes
    assert memory._RusageInfoV2.phys_footprint.offset == 16 + 7 * 8
    assert ctypes.sizeof(memory._RusageInfoV2) == 16 + 8 * 18    # v2: 18 uint64 fields after the uuid
    if sys.platform != "darwin":
        assert memory.phys_footprint(1) is None


def test_gpu_reader_without_nvml(monkeypatch):
    """No NVML (this machine): the GPU readers say None, never a number made up."""
    assert memory.gpu_bytes(1) is None and memory.gpu_used_bytes() is None


def test_gpu_reader_with_a_fake_nvml(monkeypatch):
    """NVML's per-process list, summed over GPUs for this pid; a pid it does not list falls back to the device's
    memory in use less the baseline, and says so."""
    class Proc:
        def __init__(self, pid, used):
            self.pid, self.usedGpuMemory = pid, used

    class Info:
        used = 50 * MiB

    class FakeNvml:
        nvmlDeviceGetCount = staticmethod(lambda: 2)
        nvmlDeviceGetHandleByIndex = staticmethod(lambda i: i)
        nvmlDeviceGetComputeRunningProcesses = staticmethod(
            lambda h: [Proc(1234, (h + 1) * MiB), Proc(99, 7 * MiB)])
        nvmlDeviceGetMemoryInfo = staticmethod(lambda h: Info())

    monkeypatch.setattr(memory, "_nvml", lambda: FakeNvml)
    memory._listed_per_process.cache_clear()     # its answer is about the fake NVML, in this test only
    assert memory.gpu_bytes(1234) == 3 * MiB and memory.gpu_bytes(5) is None
    monkeypatch.setattr(memory.os, "getpid", lambda: 1234)
    assert memory.process_memory(device="gpu")["footprint"] == 3 * MiB
    monkeypatch.setattr(memory.os, "getpid", lambda: 5)
    fallback = memory.process_memory(device="gpu", gpu_baseline=60 * MiB)
    assert fallback["footprint"] == 40 * MiB and "baseline" in fallback["kind"]
    memory._listed_per_process.cache_clear()
