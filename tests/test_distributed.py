"""Several processes, one job (mlxdiff/distributed.py): `mlx.launch --backend ring -n 2` on localhost, this CPU.

- a data-parallel job (three seeds over two ranks): each image equal, pixel for pixel, to the single process's;
- guidance-parallel (SD3.5 and FLUX.2 klein base, CFG's two forwards on two ranks): the single process's latents,
  through the API and the CLI (`--split guidance`);
- ranks started with different arguments: refused on every rank in one line (exit 2), nothing written;
- a rank that dies: the job ends on every rank at once (mlx.launch ends the others), no hang.
(mlx.launch exits 0 whatever its ranks do and reports each rank's exit code: the tests read those lines.)
"""

import subprocess
import sys

import numpy as np
import PIL.Image
import pytest

from distributed_helpers import CHEAP, ROOT, launch
from distributed_helpers import launcher  # noqa: F401  (the fixture)

WRAPPER = """import os, runpy, sys
rank = int(os.environ.get("MLX_RANK", "0"))
{body}
sys.argv = ["generate"] + sys.argv[1:]
runpy.run_module("mlxdiff.generate", run_name="__main__", alter_sys=True)
"""


def wrapper(tmp_path, name, body) -> str:
    path = tmp_path / f"{name}.py"
    path.write_text(WRAPPER.format(body=body))
    return str(path)


def test_data_parallel_images_equal_the_single_process(launcher, tmp_path):
    (tmp_path / "single").mkdir()
    (tmp_path / "ranks").mkdir()
    seeds = ["--seed", "1", "2", "3"]
    single = subprocess.run([sys.executable, "-m", "mlxdiff.generate", *CHEAP, *seeds, "--output",
                             str(tmp_path / "single" / "x.png")], capture_output=True, text=True, timeout=300,
                            cwd=ROOT)
    assert single.returncode == 0, single.stderr[-2000:]
    ranks = launch("-m", "mlxdiff.generate", *CHEAP, *seeds, "--output", str(tmp_path / "ranks" / "x.png"))
    assert ranks.returncode == 0, ranks.stdout[-2000:] + ranks.stderr[-2000:]
    assert "rank 0 of 2: images 1, 3 of 3" in ranks.stdout and "rank 1 of 2: images 2 of 3" in ranks.stdout
    for i in range(3):
        a, b = (np.array(PIL.Image.open(tmp_path / d / f"x-{i}.png")) for d in ("single", "ranks"))
        assert np.array_equal(a, b), i


def test_ranks_with_different_arguments_are_refused(launcher, tmp_path):
    script = wrapper(tmp_path, "mismatch", 'sys.argv += ["--seed", str(5 + rank)]')
    p = launch(script, *CHEAP, "--output", str(tmp_path / "m.png"))
    out = p.stdout + p.stderr
    errors = [line for line in out.splitlines() if line.startswith("mlxdiff: error:")]
    # mlx.launch itself exits 0 and reports each rank's exit code (the rank that ends second may be stopped by it)
    assert errors and "exited with code 2" in out, out[-2000:]
    assert all("started with different arguments" in e for e in errors)
    assert "Traceback" not in p.stdout + p.stderr
    assert not list(tmp_path.glob("m*.png"))


def test_a_rank_that_dies_ends_the_job(launcher, tmp_path):
    script = wrapper(tmp_path, "dies", 'if rank == 1:\n    os._exit(3)')
    p = launch(script, *CHEAP, "--output", str(tmp_path / "k.png"), timeout=120)   # a hang fails on the timeout
    out = p.stdout + p.stderr
    assert "rank 1 exited with code 3" in out and "rank 0 exited with code" in out, out[-2000:]
    assert "Traceback" not in out and not list(tmp_path.glob("k*.png"))


GUIDED = """import numpy as np
import mlxdiff
import mlx.core as mx
group = mx.distributed.init()
pipe = mlxdiff.load({folder!r}, group=group if group.size() > 1 else None)
r = pipe.generate("a fox in the snow", negative_prompt="blurry", width=32, height=48, steps=3, seed=4,
                  guidance=3.0, progress_bar=False{extra})
if group.rank() == 0:
    np.save({out!r}, r.latents)
"""


@pytest.mark.parametrize("family", ["sd3", "klein_base"])
def test_guidance_parallel_latents_equal_the_single_process(launcher, tmp_path, family, sd3_tiny):
    """Classifier-free guidance over two ranks (mlxdiff.load(group=...)): each rank one forward, one all_gather per
    step; the latents are the single process's (within 1e-5; on this CPU they are equal)."""
    if family == "sd3":
        folder, extra = sd3_tiny[0], ""
    else:
        from twins import TAPS, build_pipeline
        folder, extra = build_pipeline("klein_base", tmp_path)[1], f", text_encoder_out_layers={tuple(TAPS)!r}"
    outs = {}
    for mode in ("single", "ranks"):
        out = tmp_path / f"{mode}.npy"
        script = tmp_path / f"{mode}.py"
        script.write_text(GUIDED.format(folder=str(folder), out=str(out), extra=extra))
        p = (subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, cwd=ROOT)
             if mode == "single" else launch(str(script)))
        assert out.exists(), p.stdout[-2000:] + p.stderr[-2000:]
        outs[mode] = np.load(out)
    assert np.abs(outs["single"] - outs["ranks"]).max() <= 1e-5


def test_cli_guidance_split(launcher, tmp_path, sd3_tiny):
    """`--split guidance` under mlx.launch: rank 0 writes the image, equal to the single process's."""
    folder = str(sd3_tiny[0])
    args = ["-m", "mlxdiff.generate", "--model", folder, "--width", "32", "--height", "48", *CHEAP, "--seed", "7"]
    single = subprocess.run([sys.executable, *args, "--output", str(tmp_path / "single.png")], capture_output=True,
                            text=True, timeout=300, cwd=ROOT)
    assert single.returncode == 0, single.stderr[-2000:]
    p = launch(*args, "--split", "guidance", "--output", str(tmp_path / "ranks.png"))
    assert "rank 1: computed its guidance forwards" in p.stdout, p.stdout[-2000:] + p.stderr[-2000:]
    assert np.array_equal(np.array(PIL.Image.open(tmp_path / "single.png")),
                          np.array(PIL.Image.open(tmp_path / "ranks.png")))


SD_GUIDED = """import numpy as np
import mlxdiff
import mlx.core as mx
group = mx.distributed.init()
pipe = mlxdiff.load({folder!r}, group=group if group.size() > 1 else None)
r = pipe.generate("a fox in the snow", negative_prompt="blurry", width=32, height=48, steps=3, guidance=3.0,
                  latents=np.load({noise!r}), progress_bar=False)
if group.rank() == 0:
    np.save({out!r}, r.latents)
    np.save({image!r}, np.asarray(r.image))
"""


def test_sdxl_guidance_parallel_matches_diffusers(launcher, tmp_path):
    """SDXL's CFG over two ranks (each rank its half of the prompt embeddings, pooled embeddings and time ids): the
    single process's latents (within 1e-5 relative), and both those of diffusers' StableDiffusionXLPipeline from the
    same noise (latents within 1e-4, image within 2 levels: tests/parity.py), whose result the prompt, the negative
    prompt and guidance each move by more than that."""
    import torch
    from diffusers import StableDiffusionXLPipeline
    import mlxdiff
    from helpers import max_rel_err
    from ldm_helpers import reference, sdxl_components, showing_moves
    from parity import IMAGE_LEVELS, LATENT_TOL, assert_inputs_matter, levels
    pipe = StableDiffusionXLPipeline(**sdxl_components())
    folder = tmp_path / "sdxl"
    pipe.save_pretrained(str(folder))
    noise = np.random.default_rng(8).standard_normal((1, 4, 12, 8)).astype(np.float32)
    np.save(tmp_path / "noise.npy", noise)
    run = lambda **kw: reference(pipe, height=48, width=32, num_inference_steps=3, latents=torch.tensor(noise), **kw)
    ref_latents, ref_image = assert_inputs_matter(showing_moves("sdxl guidance-parallel", run), dict(
        prompt="a fox in the snow", negative_prompt="blurry", guidance_scale=3.0), {
        "the prompt": {"prompt": "a blue boat on a lake"}, "the negative prompt": {"negative_prompt": None},
        "guidance": {"guidance_scale": 5.0}})
    single = mlxdiff.load(str(folder)).generate("a fox in the snow", negative_prompt="blurry", width=32, height=48,
                                                steps=3, guidance=3.0, latents=noise, progress_bar=False)
    out, image = tmp_path / "ranks.npy", tmp_path / "ranks_image.npy"
    script = tmp_path / "ranks.py"
    script.write_text(SD_GUIDED.format(folder=str(folder), noise=str(tmp_path / "noise.npy"), out=str(out),
                                       image=str(image)))
    p = launch(str(script), port=32333)
    assert out.exists(), p.stdout[-2000:] + p.stderr[-2000:]
    # one batch of two against two batches of one: the UNet's matmuls may round differently (2.6e-6 seen here)
    assert max_rel_err(np.load(out), single.latents) <= 1e-5
    for mode, (latents, picture) in {"single process": (single.latents, single.image),
                                     "two ranks": (np.load(out), np.load(image))}.items():
        err, shift = max_rel_err(latents, ref_latents), levels(picture, ref_image)
        print(f"sdxl guidance-parallel, {mode}: latents max_rel_err {err:.1e}, image {shift} levels")
        assert err <= LATENT_TOL and shift <= IMAGE_LEVELS, (mode, err, shift)
