"""`mlxdiff.footprint compare` end to end (its main in this process, each of its runs a child process it samples),
for each family's diffusers reference: the embedded default (a Flux2KleinPipeline folder), a tiny FLUX.2-dev folder
with a GGUF transformer in city96's type mix (the published FLUX.2-dev Q4_K_M recipe on the diffusers side), a tiny
SD 1.5 folder (diffusers in float32, mlxdiff quantizing its UNet and text encoder) and a tiny SDXL folder's
sequential recipe. Plus the parts that need no model: the marker parsing (GPU allocator lines included, which only
CUDA prints), the reference chosen by family, --reference-dtype's refusals, and the CUDA table."""

import json
import sys
from pathlib import Path

import numpy as np
import pytest

from gguf_helpers import write_city96_gguf
from helpers import randomize_
from ldm_helpers import sd15_components, sdxl_components
from mlxdiff import footprint
from mlxdiff.errors import MlxdiffError
from twins import build_pipeline, flux2_to_bfl

ROOT = Path(__file__).resolve().parent.parent
DEFAULT = ROOT / "weights" / "klein-shapes"
LABELS = ("mlxdiff", "diffusers as is", "diffusers sequential")
PHASES = ("load", "encode", "denoise", "decode")


def run_compare(capsys, out, *args):
    """compare in this process (its three runs are child processes either way, sampled from outside; a child of
    its own for the command that starts them would only import mlxdiff and torch once more)."""
    capsys.readouterr()
    rc = footprint.main(["compare", *args, "--out", str(out)])
    captured = capsys.readouterr()
    assert rc == 0, captured.err[-3000:]
    print(captured.out)
    return captured.out, json.loads((out / "footprint.json").read_text())


def check_table_and_runs(stdout, data):
    lines = stdout.splitlines()
    assert lines[0].startswith("memory: ")
    if sys.platform.startswith("linux"):
        assert lines[0].startswith("memory: what each process holds, RSS, sampled from outside every")
        assert "the same ruler for every side" in lines[0]
    header = next(line for line in lines if line.startswith("| phase |"))
    for label in LABELS:
        assert f"{label} peak GB" in header
    for phase in PHASES:
        row = next(line for line in lines if line.startswith(f"| {phase} |"))
        cells = [c.strip() for c in row.strip("|").split("|")][1:]
        assert len(cells) == 3
        # mlxdiff has no load phase of its own (each model is loaded inside its phase); diffusers has all four
        assert all(c != "-" for c in (cells if phase != "load" else cells[1:])), row
    for row in ("overall peak", "steady (denoise median)", "peak ratio vs mlxdiff"):
        assert any(line.startswith(f"| {row} |") for line in lines)
    assert set(data["runs"]) == set(LABELS)
    for label, run in data["runs"].items():
        assert run["rc"] == 0 and run["samples"], label
        names = [name for name, _, _ in run["phases"]]
        assert set(names) == set(PHASES) - ({"load"} if label == "mlxdiff" else set()), (label, names)
        assert data["summaries"][label]["peak"] > 0
    assert data["runs"]["mlxdiff"]["mlx_peak"].keys() == {"encode", "denoise", "decode"}
    if sys.platform.startswith("linux"):   # every run reports its own peak RSS per phase
        for label, run in data["runs"].items():
            assert run["rss_peaks"].keys() == {name for name, _, _ in run["phases"]}, label
        mlx = data["runs"]["mlxdiff"]
        for phase, peak in mlx["mlx_peak"].items():   # on the CPU the process holds what MLX holds
            assert mlx["rss_peaks"][phase] >= peak, (phase, mlx["rss_peaks"], mlx["mlx_peak"])


def check_show(capsys, out, stdout):
    """`footprint show` prints the saved comparison's table as compare printed it (in this process: its exit codes
    and one-line refusals as a command are tests/test_bad_input_round2.py's)."""
    capsys.readouterr()
    assert footprint.main(["show", str(out / "footprint.json")]) == 0
    table = [line for line in stdout.splitlines() if line.startswith(("memory: ", "|"))]
    assert table and capsys.readouterr().out.splitlines() == table


def test_compare_embedded_default(tmp_path, capsys):
    stdout, data = run_compare(capsys, tmp_path, "--model", str(DEFAULT), "--width", "64", "--height", "64",
                               "--steps", "2")
    check_table_and_runs(stdout, data)
    check_show(capsys, tmp_path, stdout)
    assert data["runs"]["diffusers as is"]["cmd"][2] == "mlxdiff.reference.flux2"
    request = json.loads(data["runs"]["diffusers sequential"]["cmd"][3])
    assert request["mode"] == "sequential" and request["steps"] == 2 and "transformer" not in request
    assert (tmp_path / "mlxdiff.png").exists()


# D = 256 (quantized in-dims must be multiples of 256) so that city96's mix really gives Q4_K / Q5_K layers;
# joint = 3 taps x the Mistral3 twin's 48, in = 4 x the VAE twin's 5 latent channels
DEV_TRANSFORMER = dict(patch_size=1, in_channels=20, out_channels=None, num_layers=1, num_single_layers=1,
                       attention_head_dim=64, num_attention_heads=4, joint_attention_dim=144,
                       timestep_guidance_channels=32, mlp_ratio=3.0, axes_dims_rope=(16, 16, 16, 16),
                       rope_theta=2000, eps=1e-6, guidance_embeds=True)


def make_dev_gguf(root):
    """A tiny Flux2Pipeline folder (Mistral3 encoder of 6 layers) whose model_index names its taps and prompt
    length, and a GGUF of a D=256 transformer in city96's Q4_K_M type mix, written in BFL names."""
    import torch
    from diffusers import Flux2Transformer2DModel
    _, folder, _ = build_pipeline("dev", root)
    index_path = folder / "model_index.json"
    index = json.loads(index_path.read_text())
    index.update(text_encoder_out_layers=[1, 3, 4], max_sequence_length=48)   # diffusers' (10, 20, 30) > 6 layers
    index_path.write_text(json.dumps(index, indent=2))
    torch.manual_seed(0)
    twin = randomize_(Flux2Transformer2DModel(**DEV_TRANSFORMER), seed=21, scale=0.05).eval()
    twin.save_pretrained(str(folder / "transformer"))   # its config is what from_single_file reads
    state = {k: v.detach().float().numpy() for k, v in flux2_to_bfl(twin.state_dict(), DEV_TRANSFORMER).items()}
    path = root / "dev-Q4_K_M.gguf"
    types = write_city96_gguf(path, state, "flux2", "flux")
    assert {t.name for t in types.values()} >= {"Q4_K", "Q5_K"}
    return folder, path


@pytest.fixture(scope="module")
def dev_gguf(tmp_path_factory):
    return make_dev_gguf(tmp_path_factory.mktemp("dev"))


def test_compare_dev_with_gguf_transformer(dev_gguf, tmp_path, capsys):
    folder, gguf = dev_gguf
    stdout, data = run_compare(capsys, tmp_path, "--model", str(folder), "--transformer", str(gguf), "--width", "40",
                               "--height", "24", "--steps", "2")
    check_table_and_runs(stdout, data)
    runs = data["runs"]
    assert runs["mlxdiff"]["cmd"][runs["mlxdiff"]["cmd"].index("--transformer") + 1] == str(gguf)
    for label in LABELS[1:]:
        request = json.loads(runs[label]["cmd"][3])
        assert runs[label]["cmd"][2] == "mlxdiff.reference.flux2" and request["transformer"] == str(gguf)
        # diffusers really held the transformer as GGUF Q4_K / Q5_K tensors
        loaded = [line for line in runs[label]["stdout"].splitlines() if "transformer from" in line]
        assert loaded and "GGUF" in loaded[0] and "Q4_K" in loaded[0] and "Q5_K" in loaded[0], runs[label]["stdout"]


@pytest.fixture(scope="module")
def sd_folders(tmp_path_factory):
    """Tiny SD 1.5 and SDXL folders (tests/test_sd_pipeline.py's, every dimension distinct), saved by diffusers."""
    from diffusers import StableDiffusionPipeline, StableDiffusionXLPipeline
    root = tmp_path_factory.mktemp("sd")
    StableDiffusionPipeline(**sd15_components()).save_pretrained(str(root / "sd15"))
    StableDiffusionXLPipeline(**sdxl_components()).save_pretrained(str(root / "sdxl"))
    return root / "sd15", root / "sdxl"


def held(stdout):
    """{component: (dtypes, MB)} from the reference's `mlxdiff.reference: holds ...` lines (the last one per
    component)."""
    out = {}
    for line in stdout.splitlines():
        if line.startswith("mlxdiff.reference: holds "):
            for part in line.removeprefix("mlxdiff.reference: holds ").split(", "):
                name, dtypes, size, _ = part.split()
                out[name] = (set(dtypes.split("/")), float(size))
    return out


def test_compare_sd15_float32_reference(sd_folders, tmp_path, capsys):
    """SD 1.5's diffusers side (StableDiffusionPipeline as is and sequential) in float32, beside mlxdiff with its
    UNet and text encoder quantized: every side sampled by the same ruler, the table's rows, and each diffusers
    process really holding float32 weights (sequential: the encoder alone, then the UNet and VAE alone)."""
    sd15, _ = sd_folders
    stdout, data = run_compare(capsys, tmp_path, "--model", str(sd15), "--width", "40", "--height", "48", "--steps",
                               "2", "--reference-dtype", "float32", "--quantize", "unet=8,text_encoder=8")
    check_table_and_runs(stdout, data)
    check_show(capsys, tmp_path, stdout)
    runs = data["runs"]
    assert runs["mlxdiff"]["cmd"][runs["mlxdiff"]["cmd"].index("--quantize") + 1] == "unet=8,text_encoder=8"
    for label in LABELS[1:]:
        request = json.loads(runs[label]["cmd"][3])
        assert runs[label]["cmd"][2] == "mlxdiff.reference.stable_diffusion"
        assert request["dtype"] == "float32" and request["steps"] == 2 and (request["width"], request["height"]) == (
            40, 48)
        holds = held(runs[label]["stdout"])
        assert holds.keys() == {"unet", "vae", "text_encoder"}, runs[label]["stdout"]
        assert all("float32" in dtypes and "bfloat16" not in dtypes for dtypes, _ in holds.values())
    lines = [line for line in runs["diffusers sequential"]["stdout"].splitlines() if "holds" in line]
    assert len(lines) == 2 and "text_encoder" in lines[0] and "unet" not in lines[0]
    assert "text_encoder" not in lines[1] and "unet" in lines[1] and "vae" in lines[1]
    assert (tmp_path / "mlxdiff.png").exists()


def test_sdxl_sequential_reference_is_sampled_by_phase(sd_folders):
    """SDXL's sequential recipe (both encoders alone, then the UNet and VAE alone) as compare samples it."""
    _, sdxl = sd_folders
    request = {"model": str(sdxl), "width": 40, "height": 48, "steps": 2, "mode": "sequential"}
    run = footprint.sample([sys.executable, "-m", "mlxdiff.reference.stable_diffusion", json.dumps(request)],
                           interval=0.05, echo=False)
    assert run["rc"] == 0, run["stderr_tail"]
    assert [name for name, _, _ in run["phases"]] == ["encode", "load", "denoise", "decode"]
    if sys.platform.startswith("linux"):
        assert run["rss_peaks"].keys() == set(PHASES) and run["samples"]
    lines = [line for line in run["stdout"].splitlines() if "holds" in line]
    assert len(lines) == 2, run["stdout"]
    assert held(lines[0]).keys() == {"text_encoder", "text_encoder_2"}
    assert held(lines[1]).keys() == {"unet", "vae"}
    assert all(dtypes == {"bfloat16"} for dtypes, _ in held(lines[1]).values())   # the default dtype


# -- no model needed -------------------------------------------------------------------------------------------------

def test_sample_reads_phase_and_gpu_markers():
    child = ("import sys, time\n"
             "w = lambda s: print(s, file=sys.stderr, flush=True)\n"
             "w(f'MLXDIFF_PHASE denoise start {time.time():.3f}')\n"
             "b = bytearray(64 << 20); time.sleep(0.5)\n"
             "w('MLXDIFF_GPU denoise 123456789 234567890')\n"
             "w('MLXDIFF_RSS denoise 987654321')\n"
             "w(f'MLXDIFF_PHASE denoise end {time.time():.3f}')\n"
             "w('other')\n")
    run = footprint.sample([sys.executable, "-c", child], interval=0.05, echo=False)
    assert run["rc"] == 0
    assert [name for name, _, _ in run["phases"]] == ["denoise"]
    assert run["gpu"] == {"denoise": {"allocated": 123456789, "reserved": 234567890}}
    assert run["stderr_tail"] == "other\n"
    assert run["rss_peaks"] == {"denoise": 987654321}
    sampled = footprint.summarize(run)["phases"]["denoise"]["sampled"]
    assert 64 << 20 < sampled < 987654321
    assert footprint.summarize(run)["phases"]["denoise"]["peak"] == 987654321   # the larger of the two
    assert footprint.summarize(run)["peak"] == 987654321


def test_report_peaks_reads_the_table_generate_prints():
    """The compare reads MLX's and the process's peaks from the very table --report-memory prints (a hand-written
    copy of the table once hid a column change: the weights were read as the MLX peak)."""
    from mlxdiff.pipelines.report import Result
    GiB, MiB = 2 ** 30, 2 ** 20
    result = Result(image=None, latents=None, timings={"encode": 1.0, "denoise": 2.0, "decode": 0.5},
                    load_seconds={"transformer": 3.0, "vae": 0.1})
    result.memory = {"encode": {"floor": 5 * GiB, "peak": 6 * GiB, "after": 10 * MiB, "footprint_peak": 7 * GiB,
                                "footprint": 1 * GiB},
                     "denoise": {"floor": 4 * GiB, "peak": int(4.5 * GiB), "after": 20 * MiB,
                                 "footprint_peak": int(6.25 * GiB), "footprint": 1 * GiB},
                     "decode": {"floor": 160 * MiB, "peak": int(1.3 * GiB), "after": 150 * MiB}}
    result.notes = ["vae: 2 pieces of work in flight (memory to spare)"]
    assert footprint.report_peaks(result.memory_report()) == {
        "mlx": {"encode": 6 * GiB, "denoise": int(4.5 * GiB), "decode": int(1.3 * GiB)},
        "process": {"encode": 7 * GiB, "denoise": int(6.25 * GiB)}}


def test_reference_chosen_by_family(tmp_path, capsys):
    assert footprint.reference_for(str(DEFAULT)) == ("mlxdiff.reference.flux2", DEFAULT)
    for cls, module in (("StableDiffusion3Pipeline", "sd3"), ("Flux2Pipeline", "flux2")):
        (tmp_path / cls).mkdir()
        (tmp_path / cls / "model_index.json").write_text(json.dumps({"_class_name": cls}))
        assert footprint.reference_for(str(tmp_path / cls))[0] == f"mlxdiff.reference.{module}"
    from safetensors.numpy import save_file
    save_file({"model.diffusion_model.joint_blocks.0.x_block.attn.qkv.weight": np.zeros((6, 2), np.float16)},
              str(tmp_path / "sd35.safetensors"))
    assert footprint.reference_for(str(tmp_path / "sd35.safetensors"))[0] == "mlxdiff.reference.sd3"
    save_file({"model.diffusion_model.input_blocks.0.0.weight": np.zeros((4, 4, 3, 3), np.float16)},
              str(tmp_path / "sd15.safetensors"))
    assert footprint.reference_for(str(tmp_path / "sd15.safetensors"))[0] == "mlxdiff.reference.stable_diffusion"
    capsys.readouterr()
    assert footprint.main(["compare", "--model", str(tmp_path / "sd15.safetensors"), "--out", str(tmp_path / "o")]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "mlxdiff: error: sd15.safetensors: an SD 1.x / 2.x / XL single file; the diffusers reference needs a pipeline "
        "folder (pass the folder, or --mlxdiff-only)"]
    assert not (tmp_path / "o").exists()     # a refused model leaves no empty --out folder
    for cls in ("StableDiffusionPipeline", "StableDiffusionXLPipeline"):
        (tmp_path / cls).mkdir()
        (tmp_path / cls / "model_index.json").write_text(json.dumps({"_class_name": cls}))
        assert footprint.reference_for(str(tmp_path / cls))[0] == "mlxdiff.reference.stable_diffusion"
    (tmp_path / "kandinsky").mkdir()
    (tmp_path / "kandinsky" / "model_index.json").write_text(json.dumps({"_class_name": "KandinskyPipeline"}))
    with pytest.raises(MlxdiffError, match="no diffusers reference for pipeline 'KandinskyPipeline'"):
        footprint.reference_for(str(tmp_path / "kandinsky"))


def test_reference_dtype_refused_where_not_taken(tmp_path, capsys):
    """--reference-dtype: float32 or bfloat16 for the SD 1.x / SDXL reference; the other families' references run
    bfloat16 only. Refused in one line, exit 2, before any run."""
    sd = tmp_path / "sd"
    sd.mkdir()
    (sd / "model_index.json").write_text(json.dumps({"_class_name": "StableDiffusionPipeline"}))
    flux2 = "mlxdiff.reference.flux2 runs diffusers in bfloat16 only; leave it out"
    for model, value, message in ((DEFAULT, "float32", flux2), (sd, "float16", "expected one of bfloat16, float32")):
        capsys.readouterr()
        assert footprint.main(["compare", "--model", str(model), "--reference-dtype", value,
                               "--out", str(tmp_path / "out")]) == 2
        out = capsys.readouterr()
        assert out.out == "" and out.err.splitlines() == [f"mlxdiff: error: --reference-dtype {value}: {message}"]
        assert not (tmp_path / "out").exists()


def test_cuda_table_names_the_gpu_figures(tmp_path, monkeypatch, capsys):
    """What the table looks like where the reference runs print allocator lines (CUDA), without a GPU."""
    def fake_sample(cmd, interval=0.2, env=None, echo=True):
        mlx = cmd[2] == "mlxdiff.generate"
        phases = [("encode", 0.0, 1.0), ("denoise", 1.0, 2.0), ("decode", 2.0, 3.0)]
        if not mlx:
            phases = [("load", -1.0, 0.0)] + phases
        gpu = {} if mlx else {p: {"allocated": (i + 1) << 30, "reserved": (i + 2) << 30}
                              for i, (p, _, _) in enumerate(phases)}
        stdout = "encode - 1.3 MB 0.1 MB 0.26 GB 0.26 GB\ndenoise 0.05 2.00 GB 0.1 MB 0.29 GB 0.28 GB\n" if mlx else ""
        return {"cmd": cmd, "rc": 0, "samples": [(t, (1 + t) * 2 ** 28) for t in np.arange(-1, 3, 0.5)],
                "measured": ["GPU (NVML, this process)"], "phases": phases, "gpu": gpu, "stdout": stdout,
                "stderr_tail": ""}
    monkeypatch.setattr(footprint, "sample", fake_sample)
    monkeypatch.setattr(footprint, "timeline", lambda runs, path: path)
    assert footprint.main(["compare", "--model", str(DEFAULT), "--out", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("memory: what each process holds, GPU (NVML, this process), sampled from outside")
    assert "GPU rows, the breakdown: torch max_memory_allocated / max_memory_reserved" in lines[0]
    assert "| GPU load | - | 1.00 / 2.00 | 1.00 / 2.00 |" in lines
    assert "| GPU decode | - | 4.00 / 5.00 | 4.00 / 5.00 |" in lines
    assert "| GPU overall peak | - | 4.00 / 5.00 | 4.00 / 5.00 |" in lines
    assert sum(line.startswith("| GPU ") for line in lines) == 5


def test_warns_before_hours_of_bf16_on_a_cpu_without_bf16_units(tmp_path):
    """compare warns (it does not refuse) before diffusers' bf16 runs of a real-size model on an x86 CPU without
    AVX512-BF16 / AMX, where torch's bf16 matmuls run at 1-14 GFLOP/s (bench/torch_cpu_bf16.py)."""
    weights = tmp_path / "model"
    weights.mkdir()
    (weights / "w.safetensors").write_bytes(b"")
    with open(weights / "w.safetensors", "r+b") as f:
        f.truncate(3 * 1024 ** 3)                     # sparse: 3 GiB of weights without the disk space
    avx2 = "processor : 0\nflags : fpu sse2 avx avx2 fma\n"
    amx = "processor : 0\nflags : fpu sse2 avx avx2 avx512f avx512_bf16 amx_bf16 amx_tile\n"
    warning = footprint.slow_reference_warning(weights, None, avx2, torch_on_cpu=lambda: True)
    assert warning.startswith("mlxdiff: warning: ") and "3.0 GB" in warning and "--mlxdiff-only" in warning
    assert footprint.slow_reference_warning(weights, None, amx, torch_on_cpu=lambda: True) is None
    assert footprint.slow_reference_warning(weights, None, avx2, torch_on_cpu=lambda: False) is None    # torch on a GPU
    assert footprint.slow_reference_warning(weights, None, "Features : neon\n", torch_on_cpu=lambda: True) is None   # ARM
    assert footprint.slow_reference_warning(DEFAULT, None, avx2, torch_on_cpu=lambda: True) is None  # a tiny model
