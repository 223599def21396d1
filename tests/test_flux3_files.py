"""mlxdiff's FLUX 3 base pipeline (Flux3ModularPipeline: classifier-free guidance against "") against diffusers'
Flux3AutoBlocks (the prompt upsampler popped) on the same injected noise, the prompt and the guidance shown to move
its output; then, on the same folder, the transformer as a Q8_0 GGUF in diffusers' names (transformer=FILE) and a
LoRA in diffusers / PEFT names (loras=), each against the modular pipeline with the same weights / the same LoRA.
Latents within 1e-4, images within 2 levels (tests/parity.py). Last, quantize=8 and mlxdiff.convert of the folder."""

import numpy as np
import pytest
import torch

import mlxdiff
from mlxdiff.convert import convert
from flux3_helpers import H, NOISE, OTHER, PROMPT, STEPS, TAPS, TRANSFORMER, W, check, reference, save_folder
from gguf_helpers import dequantized, write_q8_0_gguf
from parity import LATENT_TOL, assert_inputs_matter, rel_diff
import fixture_guard


@pytest.fixture(autouse=True)
def _shared_fixtures_unchanged(request):
    """The module's shared fixtures are left as built (fixture_guard)."""
    yield from fixture_guard.unchanged(request, ["tiny", "plain"])


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return {"base": save_folder("base", tmp_path_factory.mktemp("flux3_base"))}


@pytest.fixture(scope="module")
def plain(tiny):
    """The modular pipeline's run of PROMPT at its default guidance (3.5): what a GGUF or a LoRA must move."""
    return reference(tiny["base"][1], prompt=PROMPT)


def pipeline_with(pipe, transformer):
    """A modular pipeline of `pipe`'s blocks (the prompt upsampler popped) and components, `transformer` in place
    of its own (the fixture's pipeline stays as built)."""
    blocks = type(pipe.blocks)()
    blocks.sub_blocks.pop("prompt_upsampler")
    out = blocks.init_pipeline()
    out.update_components(**{n: getattr(pipe, n) for n in ("vae", "text_encoder", "tokenizer", "guider")},
                          transformer=transformer)
    return out


def test_base_matches_diffusers(tiny):
    from diffusers.guiders import ClassifierFreeGuidance
    folder, pipe = tiny["base"]
    ours_pipe = mlxdiff.load(str(folder), keep="all")
    assert not ours_pipe.is_distilled and ours_pipe.defaults() == {"steps": 50, "guidance": 3.5}
    runs = {}

    def run_reference(guidance, **kw):
        guided = pipeline_with(pipe, pipe.transformer)
        guided.update_components(guider=ClassifierFreeGuidance(guidance_scale=guidance))
        runs[kw["prompt"], guidance] = out = reference(guided, **kw)
        return out
    assert_inputs_matter(run_reference, dict(prompt=PROMPT, guidance=3.5),
                         {"the prompt": dict(prompt=OTHER), "the guidance": dict(guidance=5.0)})
    # the other prompt, and the first at the other guidance: a dropped prompt or a wrong CFG formula cannot match
    for prompt, guidance in ((OTHER, 3.5), (PROMPT, 5.0)):
        check(ours_pipe.generate(prompt, width=W, height=H, steps=STEPS, guidance=guidance, latents=NOISE,
                                 text_encoder_out_layers=TAPS, progress_bar=False), runs[prompt, guidance])



def test_gguf_transformer_matches_diffusers(tiny, plain, tmp_path):
    """transformer=FILE: a Q8_0 GGUF in diffusers' names (the blocks' 2-D weights Q8_0, the rest F32), against the
    modular pipeline with the file's weights dequantized by gguf-py."""
    from diffusers import Flux3Transformer2DModel
    folder, pipe = tiny["base"]
    state = {k: v.detach().clone() for k, v in pipe.transformer.state_dict().items()}
    path = tmp_path / "flux3-q8_0.gguf"
    quantized = write_q8_0_gguf(path, state, "flux3", lambda name: "blocks." in name)
    assert quantized
    twin = Flux3Transformer2DModel(**TRANSFORMER)
    twin.load_state_dict({k: torch.from_numpy(v) for k, v in dequantized(path).items()})
    want = reference(pipeline_with(pipe, twin.eval()), prompt=PROMPT)
    ours = mlxdiff.load(str(folder), transformer=str(path)).generate(
        PROMPT, width=W, height=H, steps=STEPS, latents=NOISE, text_encoder_out_layers=TAPS, progress_bar=False)
    check(ours, want)
    assert rel_diff(want[0], plain[0]) > LATENT_TOL     # the quantization shows


def peft_lora(path, transformer, targets, rank=4, alpha=8.0, seed=9):
    """A random PEFT LoRA on `targets` added to `transformer` (in place) and saved as diffusers'
    Flux3ModularPipeline.save_lora_weights writes it (its LoraConfig in lora_adapter_metadata)."""
    from diffusers.modular_pipelines import Flux3ModularPipeline
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, init_lora_weights=False)
    transformer.add_adapter(config)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in transformer.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    state = {k: v.detach().clone().contiguous() for k, v in get_peft_model_state_dict(transformer).items()}
    Flux3ModularPipeline.save_lora_weights(str(path.parent), transformer_lora_layers=state, weight_name=path.name,
                                           transformer_lora_adapter_metadata=config.to_dict())
    return path, transformer.eval()


def test_lora_matches_diffusers(tiny, plain, tmp_path):
    """A LoRA in diffusers / PEFT names on attention and feed-forward layers of every kind of block, added to
    mlxdiff's pipeline and, through PEFT, to a copy of diffusers' transformer."""
    import copy
    folder, pipe = tiny["base"]
    targets = ["to_q", "to_v", "linear_in", "to_out.0"]
    path, adapted = peft_lora(tmp_path / "flux3_lora.safetensors", copy.deepcopy(pipe.transformer), targets)
    want = reference(pipeline_with(pipe, adapted), prompt=PROMPT)
    assert rel_diff(want[0], plain[0]) > LATENT_TOL      # the LoRA shows
    ours = mlxdiff.load(str(folder), loras=[str(path)]).generate(
        PROMPT, width=W, height=H, steps=STEPS, latents=NOISE, text_encoder_out_layers=TAPS, progress_bar=False)
    check(ours, want)


def test_quantized_and_converted(tiny, tmp_path):
    """quantize=8 while loading moves the latents a little (the 64-wide twin's blocks quantize); mlxdiff.convert of
    the modular folder (its modular_model_index.json read, a model_index.json written) gives the same run back."""
    folder, _ = tiny["base"]
    run = dict(width=W, height=H, steps=1, latents=NOISE, text_encoder_out_layers=TAPS, progress_bar=False)
    plain_run = mlxdiff.load(str(folder)).generate(PROMPT, **run)
    quantized = mlxdiff.load(str(folder), quantize=8).generate(PROMPT, **run)
    assert 0 < rel_diff(quantized.latents, plain_run.latents) < 0.05
    dest = convert(str(folder), tmp_path / "flux3-q8", quantize=8, progress=lambda *_: None)
    assert (dest / "model_index.json").is_file()
    again = mlxdiff.load(str(dest)).generate(PROMPT, **run)
    assert np.array_equal(again.latents, quantized.latents)
