"""Repeated generation: components kept loaded across generate() calls by the keep= policy, and prompts encoded
once (the embedded default model, 2 steps)."""

import dataclasses

import numpy as np
import pytest

import mlxdiff
import mlx.core as mx
from mlx.utils import tree_flatten
from mlxdiff import default_model
from mlxdiff.loading.spec import ComponentSpec

KW = dict(steps=2, seed=5, progress_bar=False)


@pytest.fixture
def builds(monkeypatch):
    """Every ComponentSpec.build call, by component name."""
    calls = []
    original = ComponentSpec.build

    def counting(self, *args, **kwargs):
        calls.append(self.name)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(ComponentSpec, "build", counting)
    return calls


def _active():
    mx.synchronize()
    mx.clear_cache()
    return mx.get_active_memory()


def test_same_prompt_is_encoded_once_and_images_match(builds):
    pipe = mlxdiff.load(str(default_model.folder()))
    first = pipe.generate(default_model.PROMPT, **KW)
    assert builds.count("text_encoder") == 1 and first.reused == []
    second = pipe.generate(default_model.PROMPT, **KW)
    assert builds.count("text_encoder") == 1          # the encoder is not even loaded again
    assert second.reused == ["conditioning"]
    assert np.array_equal(first.latents, second.latents)
    pipe.generate("a small green triangle at the top on a black background", **KW)
    assert builds.count("text_encoder") == 2          # a new prompt is encoded


def test_keep_all_reuses_every_component(builds):
    base = _active()
    plain = mlxdiff.load(str(default_model.folder())).generate(default_model.PROMPT, **KW)
    pipe = mlxdiff.load(str(default_model.folder()), keep="all")
    first = pipe.generate(default_model.PROMPT, **KW)
    held = _active() - base
    assert held >= sum(pipe.components[n].loaded_nbytes() for n in ("transformer", "vae", "text_encoder")) * 0.9
    second = pipe.generate("a large blue square on the left on a white background", **KW)
    assert set(second.reused) == {"text_encoder", "transformer", "vae"}   # the kept encoder, for the new prompt
    assert builds.count("transformer") == 2 and builds.count("vae") == 2     # plain run + the first kept run
    assert builds.count("text_encoder") == 2                                  # kept: the new prompt loads nothing
    assert np.array_equal(first.latents, plain.latents)
    pipe.release()
    assert _active() - base < 0.05 * held


def test_keep_auto_frees_when_the_budget_says_so(builds):
    base = _active()
    pipe = mlxdiff.load(str(default_model.folder()), keep="auto")
    unlimited = pipe.policy
    try:
        # 13 MB: each phase fits, the transformer (12.4 MB) with no other
        pipe.policy = dataclasses.replace(unlimited, memory_limit=int(0.013 * 2**30))
        pipe.generate(default_model.PROMPT, **KW)
        assert _active() - base < 2_000_000
        result = pipe.generate(default_model.PROMPT, **KW)
        assert "transformer" not in result.reused and builds.count("transformer") == 2
    finally:
        pipe.policy = unlimited
    result = pipe.generate(default_model.PROMPT, **KW)    # no limit: 3/4 of physical memory holds all
    result = pipe.generate(default_model.PROMPT, **KW)
    assert {"transformer", "vae"} <= set(result.reused)
    pipe.release()


def test_bad_keep_policy():
    with pytest.raises(mlxdiff.MlxdiffError, match="keep="):
        mlxdiff.load(str(default_model.folder()), keep="sometimes")


def test_blocks_compiled_only_where_memory_allows(monkeypatch):
    """memory.compile_blocks_for, as a phase decides it (memory.decide): whole compiled blocks on a GPU with room to
    spare, never for a model with a layer that decodes its weight per call (its decoded weights must stay paced one
    at a time), never on the CPU."""
    import mlx.nn as nn
    from mlxdiff import memory
    from mlxdiff.formats.gguf import RawLinear
    from mlxdiff.policy import RunPolicy
    plain = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64))
    decoding = nn.Sequential(nn.Linear(64, 64), RawLinear(256, 8, "Q4_K"))
    assert not memory.decide(RunPolicy(), plain).compile_blocks             # this CPU
    monkeypatch.setattr(memory, "in_flight_for", lambda policy: 2)           # as on a GPU with memory to spare
    monkeypatch.setattr(memory.mx, "default_device", lambda: mx.gpu)
    assert memory.decide(RunPolicy(), plain).compile_blocks
    assert not memory.decide(RunPolicy(), decoding).compile_blocks
    plain.eager_is_faster = lambda: True                                     # as FLUX.2 with its fused CUDA kernel
    assert not memory.decide(RunPolicy(), plain).compile_blocks
    del plain.eager_is_faster
    monkeypatch.setattr(memory, "in_flight_for", lambda policy: 1)           # a tight budget: the floor
    assert not memory.decide(RunPolicy(), plain).compile_blocks


@pytest.mark.parametrize("cycle", [False, True], ids=["layers freed by their last reference", "held by a cycle"])
def test_a_freed_model_is_collected_only_when_its_weights_outlive_it(cycle, monkeypatch):
    """residency.free_model runs a full collection (every live object scanned) only where emptying the model left
    its weights alive, a reference cycle holding them; either way the weights are freed."""
    import gc
    import mlx.nn as nn
    from mlxdiff.pipelines import residency
    collections, collect = [], gc.collect
    monkeypatch.setattr(gc, "collect", lambda *args: collections.append(args) or collect(*args))
    gc.disable()            # no automatic collection between the steps
    try:
        collect()
        baseline = mx.get_active_memory()
        model = nn.Sequential(nn.Linear(512, 1024), nn.Linear(1024, 256))
        mx.eval(model.parameters())
        nbytes = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
        if cycle:
            loop = {"weight": model.layers[0].weight}
            loop["loop"] = loop
            del loop
        residency.free_model(model, nbytes)
        assert len(collections) == int(cycle), collections
        # (a few bytes of MLX's own small arrays may stay: the weights are megabytes)
        assert mx.get_active_memory() < baseline + nbytes / 100, (mx.get_active_memory(), baseline, nbytes)
    finally:
        gc.enable()
