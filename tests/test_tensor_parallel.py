"""Tensor-parallel transformers over mx.distributed (mlxdiff/distributed.py, Model.shard of models/flux2.py and
models/mmdit.py): `mlx.launch --backend ring -n 2` on localhost, this CPU, against the single process.

- FLUX.2 klein (safetensors, quantized while loading, and a GGUF kept as raw blocks or, as on CUDA, as MLX affine
  layers) and SD3.5 (MMDiT-X, dual attention): the latents of a
  2-rank run within 1e-5 of the single process's and its image within 1 level; each rank's transformer holds half
  of the blocks' parameter bytes (exactly) and about half of the whole transformer's;
- the CLI's `--split tensor`: rank 0 writes the image, within 1 level of the single process's;
- heads that two ranks do not divide: refused on every rank in one line (exit 2), nothing written.
The tiny fixtures of tests/conftest.py and tests/twins.py have 3 heads, which two ranks do not split: the pipelines
here are the same with a 4-head transformer.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import PIL.Image
import pytest

from distributed_helpers import CHEAP, ROOT, launcher  # noqa: F401  (the fixture)
from distributed_helpers import launch as launch_ranks


def launch(*argv, **kw):
    """test_distributed's launch on ports of this file's own (pytest-xdist may run both files at once)."""
    return launch_ranks(*argv, port=33323, **kw)

RUN = """import json, sys
from dataclasses import replace
import numpy as np
import mlxdiff  # before mlx: OpenBLAS takes over mlx-cpu's BLAS (mlxdiff/backend.py)
import mlx.core as mx
from mlx.utils import tree_flatten
from mlxdiff.pipelines import load
from mlxdiff.loading.quantize import materialize
from mlxdiff.loading.spec import ComponentSpec
from mlxdiff.policy import installed
group = mx.distributed.init()
n, rank = group.size(), group.rank()
out = sys.argv[1]


def rchar():
    return int(next(l.split()[1] for l in open("/proc/self/io") if l.startswith("rchar")))


def unwrapped(path):
    # a SummedLinear holds its split layer as .layer (models/sharding.py): the unsharded model's name
    head, _, leaf = path.rpartition(".")
    return head[:-len(".layer")] + "." + leaf if head.endswith(".layer") else path


def case(name, folder, load_extra, gguf_layout=None, **run):
    pipe = load(folder, group=group if n > 1 else None, split="tensor" if n > 1 else None, **load_extra)
    if gguf_layout:     # the GGUF as another backend keeps it (CUDA: affine), on this CPU
        pipe.components["transformer"] = replace(pipe.components["transformer"], gguf_layout=gguf_layout)
    r = pipe.generate(progress_bar=False, **run)
    np.save(f"{{out}}/{{name}}-latents-{{n}}-{{rank}}.npy", r.latents)
    r.image.save(f"{{out}}/{{name}}-image-{{n}}-{{rank}}.png")
    held = {{}}
    for part in ("transformer", "text_encoder", "text_encoder_2", "text_encoder_3"):
        spec = pipe.components.get(part)
        if spec is None:
            continue
        if "text_encoder_out_layers" in run and part == "text_encoder":     # the taps the run built it with
            spec = spec.with_config(taps=list(run["text_encoder_out_layers"]))
        before = rchar()
        with installed(pipe.policy):     # the build's compute dtype: the pipeline's
            model = spec.build()
        materialize(model)
        read = rchar() - before
        params = tree_flatten(model.parameters())
        # what stays whole on each rank: the arrays shaped as in the unsharded model (built lazily; nothing read)
        with installed(pipe.policy):
            full = dict(tree_flatten(ComponentSpec.build(spec, check=False).parameters()))
        whole = sum(v.nbytes for k, v in params if full[unwrapped(k)].shape == v.shape)
        held[part] = {{"total": sum(v.nbytes for _, v in params), "whole": whole, "read": read,
                      "stored": spec.nbytes(), "estimate": spec.loaded_nbytes(compute_dtype=pipe.dtype),
                      "split": type(spec).__name__ == "TensorParallelSpec",
                      "layers": sorted({{type(m).__name__ for _, m in model.named_modules()}})}}
        del model
    json.dump(held, open(f"{{out}}/{{name}}-bytes-{{n}}-{{rank}}.json", "w"))


flux = dict(prompt="a fox in the snow", width={W}, height={H}, steps=3, seed=4, text_encoder_out_layers={taps!r})
case("flux2", {flux2!r}, {{}}, **flux)
case("flux2_q4", {flux2!r}, dict(quantize={{"transformer": {{"bits": 4, "group_size": 32}}}}, matmul="qmm"), **flux)
case("flux2_gguf", {flux2_gguf!r}, dict(transformer={gguf!r}), **flux)
case("flux2_gguf_affine", {flux2_gguf!r}, dict(transformer={gguf!r}), gguf_layout="affine", **flux)
case("sd3", {sd3!r}, {{}}, prompt="a fox in the snow", width=32, height=48, steps=3, seed=4)
case("flux1", {flux1!r}, {{}}, prompt="a fox in the snow", width=24, height=40, steps=2, seed=4)
if n == 1:     # what the CLI test's command makes
    r = load({sd3!r}).generate("a red circle on a blue background", width=32, height=48, steps=2, seed=7,
                                progress_bar=False)
    r.image.save(f"{{out}}/cli-single.png")
"""

CASES = ("flux2", "flux2_q4", "flux2_gguf", "flux2_gguf_affine", "sd3", "flux1")


def flux2_klein(root):
    """twins' klein (distilled: one forward per step) with a 4-head transformer (mlp_ratio 3: the single blocks'
    fused [q; k; v; gate; up] splits on exact fractions)."""
    from diffusers import Flux2Transformer2DModel
    from twins import build_pipeline, randomize_
    folder = build_pipeline("klein_distilled", root)[1]
    model = Flux2Transformer2DModel(
        patch_size=1, in_channels=20, out_channels=None, num_layers=2, num_single_layers=2, attention_head_dim=16,
        num_attention_heads=4, joint_attention_dim=3 * 40, timestep_guidance_channels=32, mlp_ratio=3.0,
        axes_dims_rope=(4, 4, 4, 4), rope_theta=2000, eps=1e-6, guidance_embeds=False)
    randomize_(model, seed=13, scale=0.15).eval().save_pretrained(str(folder / "transformer"))
    return folder


def flux2_klein_gguf(root):
    """twins' klein with a 512-wide transformer written as a city96-style GGUF (Q4_K / Q5_K blocks, random valid
    ones: 1 rank against 2 is the comparison), which the CPU keeps as raw blocks (RawLinear): every split cuts the
    rows or the 256-value blocks of a row (attention 512 = 2 x 256 columns per rank, feed-forward 1536 = 3 x 256).
    Returns (the folder, whose transformer config is that model's, the GGUF file)."""
    from diffusers import Flux2Transformer2DModel
    from gguf_helpers import torch_state, write_city96_gguf
    from twins import build_pipeline, flux2_to_bfl
    folder = build_pipeline("klein_distilled", root)[1]
    config = dict(patch_size=1, in_channels=20, out_channels=None, num_layers=1, num_single_layers=1,
                  attention_head_dim=128, num_attention_heads=4, joint_attention_dim=3 * 40,
                  timestep_guidance_channels=32, mlp_ratio=3.0, axes_dims_rope=(32, 32, 32, 32), rope_theta=2000,
                  eps=1e-6, guidance_embeds=False)
    model = Flux2Transformer2DModel(**config)
    model.save_config(str(folder / "transformer"))
    path = root / "klein-Q4_K_M.gguf"
    types = write_city96_gguf(path, flux2_to_bfl(torch_state(model), config), "flux2", "flux", random=True, seed=5)
    assert sum(t.name.endswith("_K") for t in types.values()) >= 8, types
    return folder, path


def sd35(root):
    """conftest's tiny SD3.5 (dual attention in block 0) with a 4-head transformer."""
    from sd3_helpers import sd3_tiny_components
    from diffusers import SD3Transformer2DModel, StableDiffusion3Pipeline
    import torch
    parts = sd3_tiny_components()
    torch.manual_seed(3)
    parts["transformer"] = SD3Transformer2DModel(
        sample_size=16, patch_size=2, in_channels=16, num_layers=3, attention_head_dim=8, num_attention_heads=4,
        joint_attention_dim=96, caption_projection_dim=32, pooled_projection_dim=64, out_channels=16,
        pos_embed_max_size=20, dual_attention_layers=(0,), qk_norm="rms_norm")
    folder = root / "sd35"
    StableDiffusion3Pipeline(**parts).save_pretrained(str(folder))
    return folder


def flux1_dev(root):
    """test_flux1_pipeline's tiny dev folder with a 4-head transformer (its T5 has 3 heads: it stays whole)."""
    from diffusers import FluxPipeline, FluxTransformer2DModel
    from flux1_helpers import LATENT, flux1_components
    from twins import randomize_
    parts = flux1_components("dev", seed=5)
    parts["transformer"] = randomize_(FluxTransformer2DModel(
        patch_size=1, in_channels=4 * LATENT, num_layers=2, num_single_layers=2, attention_head_dim=16,
        num_attention_heads=4, joint_attention_dim=44, pooled_projection_dim=36, guidance_embeds=True,
        axes_dims_rope=(4, 6, 6)), seed=14, scale=0.15).eval()
    folder = root / "flux1"
    FluxPipeline(**parts).save_pretrained(str(folder))
    return folder


@pytest.fixture(scope="module")
def runs(tmp_path_factory, launcher):
    """Every case as one process and as two ranks (one script each, to start as few processes as possible):
    (folder of the outputs, the pipeline folders)."""
    from twins import H, TAPS, W
    root = tmp_path_factory.mktemp("tensor_parallel")
    folders = {"flux2": flux2_klein(root / "klein"), "sd3": sd35(root), "flux1": flux1_dev(root)}
    folders["flux2_gguf"], gguf = flux2_klein_gguf(root / "klein_gguf")
    script = root / "run.py"
    script.write_text(RUN.format(flux2=str(folders["flux2"]), sd3=str(folders["sd3"]), flux1=str(folders["flux1"]),
                                 W=W, H=H, taps=tuple(TAPS),
                                 flux2_gguf=str(folders["flux2_gguf"]), gguf=str(gguf)))
    out = root / "out"
    out.mkdir()
    single = subprocess.run([sys.executable, str(script), str(out)], capture_output=True, text=True, timeout=300,
                            cwd=ROOT)
    assert single.returncode == 0, single.stderr[-3000:]
    ranks = launch(str(script), str(out))
    assert (out / "sd3-bytes-2-1.json").exists(), ranks.stdout[-3000:] + ranks.stderr[-3000:]
    return out, folders


def outputs(out, name, n, rank):
    return (np.load(out / f"{name}-latents-{n}-{rank}.npy"),
            np.array(PIL.Image.open(out / f"{name}-image-{n}-{rank}.png")).astype(int),
            json.loads((out / f"{name}-bytes-{n}-{rank}.json").read_text()))


@pytest.mark.parametrize("name", CASES)
def test_two_ranks_equal_the_single_process_each_holding_half(runs, name):
    """Latents within 1e-5 and the image within 1 level of the single process's, on both ranks; each rank holds
    exactly half of every array it splits (the transformer's, and FLUX.2's text encoder's), the rest (embedders, position table, output layers, q/k norms, output
    biases) whole: 0.53 of the whole tiny FLUX.2 (0.58 with 4-bit blocks, 0.62 for the tiny SD3.5 whose position
    table is a tenth of it; a real model's whole part is about 1%), and the memory budget counts that share. Each
    rank still reads the whole file: mx.load's lazy arrays are read whole, then sliced."""
    out, _ = runs
    latents, image, whole_held = outputs(out, name, 1, 0)
    for rank in (0, 1):
        rank_latents, rank_image, held = outputs(out, name, 2, rank)
        assert np.abs(rank_latents - latents).max() <= 1e-5
        assert np.abs(rank_image - image).max() <= 1
        # FLUX.2's Qwen3 / Mistral text encoder splits too (models/text_llm.py), and SD3.5's T5 (models/t5.py);
        # SD3.5's CLIPs stay whole
        parts = ("transformer", "text_encoder") if name.startswith("flux2") else ("transformer",) \
            if name == "flux1" else ("transformer", "text_encoder_3")
        assert [p for p in held if held[p]["split"]] == list(parts)
        for part in parts:
            share, whole = held[part], whole_held[part]
            assert (share["total"] - share["whole"]) * 2 == whole["total"] - share["whole"]   # split: exactly half
            if name.startswith("flux2_gguf") and part == "transformer":
                # the file's blocks kept as they are (this CPU's choice), or as MLX affine layers (CUDA's)
                # (mlx.nn's Quantized*Linear sharded layers)
                kept = "Quantized" if name.endswith("affine") else "RawLinear"
                assert all(any(kept in layer for layer in held_["layers"]) for held_ in (share, whole)), \
                    (share["layers"], whole["layers"])
                # a GGUF is mapped (mmap: no read() to count), and its estimate is the whole model's: a bound
                assert share["estimate"] >= share["total"]
            else:
                assert share["read"] >= whole["stored"]   # MLX reads whole tensors to slice them (mx.load's arrays)
                assert share["estimate"] == share["total"]
        if name == "flux2":   # blocks are most of it (tiny SD3.5: its whole 20 x 20 position table is not)
            assert held["transformer"]["total"] <= 0.54 * whole_held["transformer"]["total"]


def test_cli_tensor_split(runs, tmp_path):
    """`--split tensor` under mlx.launch: each rank says what it holds and, with --report-memory, prints its own
    memory table; rank 0 writes the image, within 1 level of the single process's (made by the API with the same
    settings), rank 1 writes nothing."""
    out, folders = runs
    p = launch("-m", "mlxdiff.generate", "--model", str(folders["sd3"]), "--width", "32", "--height", "48", *CHEAP,
               "--seed", "7", "--split", "tensor", "--report-memory", "--output", str(tmp_path / "tp.png"))
    said = p.stdout + p.stderr
    assert "rank 1: computed its share of the transformer; rank 0 wrote the images" in said, said[-3000:]
    assert said.count("process memory:") == 2 and "rank 1:\nphase" in said, said[-3000:]   # both ranks' tables
    assert ("rank 0 of 2: 1/2 of the transformer's heads and feed-forward widths (and of text_encoder_3), every image"
            in said)
    assert [f.name for f in tmp_path.glob("*.png")] == ["tp.png"]
    ranks = np.array(PIL.Image.open(tmp_path / "tp.png")).astype(int)
    assert np.abs(ranks - np.array(PIL.Image.open(out / "cli-single.png")).astype(int)).max() <= 1


def test_heads_that_the_ranks_do_not_divide_are_refused(launcher, tmp_path, sd3_tiny):
    """conftest's tiny SD3.5 has 3 heads: two ranks refuse it in one line each, when it is loaded, nothing written."""
    p = launch("-m", "mlxdiff.generate", "--model", str(sd3_tiny[0]), *CHEAP, "--split", "tensor", "--output",
               str(tmp_path / "x.png"))
    out = p.stdout + p.stderr
    errors = [line for line in out.splitlines() if line.startswith("mlxdiff: error:")]
    assert errors and "exited with code 2" in out, out[-2000:]
    assert all("SD3 transformer: num_attention_heads: 3 heads do not split over 2 ranks" in e for e in errors)
    assert "Traceback" not in out and not list(tmp_path.glob("*.png"))


class _Rank:
    """A stand-in group (size, rank) for splitting one layer without processes."""

    def __init__(self, n, rank):
        self.n, self.r = n, rank

    def size(self):
        return self.n

    def rank(self):
        return self.r


@pytest.mark.parametrize("form", ["Q4_K", "Q8_0", "fp8"])
@pytest.mark.parametrize("n", [2, 4])
def test_compact_layers_split_on_their_blocks(form, n):
    """A GGUF raw-block layer and a float8 layer split by output rows (a fused [a; b] layer: each part on its own)
    and by input columns (cut on the type's block boundaries, [a | b] parts too): the ranks' rows side by side, and
    the sum of the ranks' partial products plus the bias once, equal the whole layer's output, and each rank keeps
    the compact form."""
    import mlx.core as mx
    from gguf import GGMLQuantizationType as T
    from gguf_helpers import random_blocks
    from mlxdiff.formats.fp8 import Fp8Linear
    from mlxdiff.formats.gguf import RawLinear
    from mlxdiff.models.sharding import SummedLinear, shard_layer
    rng = np.random.default_rng(0)
    out_dims, in_dims = 48, 2048 if form == "Q4_K" else 256      # columns: 2 parts, each n blocks wide at least
    if form == "fp8":
        layer = Fp8Linear(in_dims, out_dims, bias=True)
        layer.weight = mx.array(rng.integers(0, 0x7F, size=(out_dims, in_dims), dtype=np.uint8))
        layer.weight_scale = mx.array(rng.uniform(0.5, 2, out_dims).astype(np.float32))
    else:
        layer = RawLinear(in_dims, out_dims, form, bias=True)
        layer.weight = mx.array(random_blocks(getattr(T, form), out_dims, in_dims, rng, scale=0.05))
    layer.bias = mx.array(rng.standard_normal(out_dims).astype(np.float32))
    x = mx.array(rng.standard_normal((3, in_dims)).astype(np.float32))
    whole = layer(x)
    rows_at, cols_at = out_dims // 3, in_dims // 2
    shares = [shard_layer(layer, "all-to-sharded", _Rank(n, r), "w", boundaries=(rows_at,)) for r in range(n)]
    assert all(type(s) is type(layer) for s in shares)
    ys = [s(x) for s in shares]
    parts = [np.split(np.array(y), [rows_at // n]) for y in (ys[r].T for r in range(n))]
    rows = np.concatenate([p[0] for p in parts] + [p[1] for p in parts]).T     # part a of every rank, then b
    assert np.abs(rows - np.array(whole)).max() <= 1e-5 * np.abs(np.array(whole)).max()
    summed = [shard_layer(layer, "sharded-to-all", _Rank(n, r), "w", boundaries=(cols_at,)) for r in range(n)]
    assert all(isinstance(s, SummedLinear) and type(s.layer) is type(layer) for s in summed)
    step_a, step_b = cols_at // n, (in_dims - cols_at) // n
    total = sum(s.layer(mx.concatenate([x[:, r * step_a:(r + 1) * step_a],
                                        x[:, cols_at + r * step_b:cols_at + (r + 1) * step_b]], axis=1))
                for r, s in enumerate(summed)) + summed[0].bias
    assert np.abs(np.array(total) - np.array(whole)).max() <= 1e-4 * np.abs(np.array(whole)).max()


def test_compact_columns_off_the_block_boundary_are_refused():
    from mlxdiff.errors import MlxdiffError
    from mlxdiff.formats.gguf import RawLinear
    from mlxdiff.models.sharding import shard_layer
    layer = RawLinear(512, 16, "Q4_K")
    with pytest.raises(MlxdiffError, match=r"input columns in parts of \[512\], which 4 ranks x its block of 256 "):
        shard_layer(layer, "sharded-to-all", _Rank(4, 0), "blocks.0.to_out")
