"""Core ML test pieces shared by several test modules (no test module imports another)."""

import copy
import json
import shutil
import uuid
from pathlib import Path

import coremltools as ct
import numpy as np
import torch
from coremltools.models.utils import bisect_model
from coremltools.optimize.coreml import OpPalettizerConfig, OptimizationConfig, decompress_weights, palettize_weights
from coremltools.proto import Model_pb2

from helpers import randomize_
from mlxdiff.formats import coreml


def _passes_checked_once():
    """coremltools checks its whole program after each of its ~40 graph passes (Program.validate: assertions on the
    graph's links, nothing changed), much of building the tests' packages (bench/RESULTS.md). Checked once,
    after the last pass: the packages it writes are the same bytes (tests/test_coreml.py's
    test_packages_same_with_passes_checked_once)."""
    from coremltools.converters.mil.mil.passes.pass_pipeline import PassPipelineManager
    apply = PassPipelineManager.apply_pipeline
    if getattr(apply, "checked_once", False):
        return

    def apply_pipeline(prog, pass_pipeline):
        prog.validate = lambda *args, **kwargs: None     # the instance's, over Program.validate, for the passes
        try:
            apply(prog, pass_pipeline)
        finally:
            del prog.validate
        prog.validate()
    apply_pipeline.checked_once = True
    apply_pipeline.each_pass = apply
    PassPipelineManager.apply_pipeline = staticmethod(apply_pipeline)


_passes_checked_once()


class Wrapper(torch.nn.Module):
    """What one traces: the UNet as `self.unet` (its names then start with `unet_`), returning the sample."""

    def __init__(self, unet):
        super().__init__()
        self.unet = unet

    def forward(self, x, t, c):
        return self.unet(x, t, c, return_dict=False)[0]


def save_package(mlmodel, path) -> Path:
    """mlmodel.save(path), the package then a function of the model alone (issue 45: the fuzzer's mutant k of seed s
    is the same bytes in every run): model.mlmodel re-serialized with its protobuf maps in key order (protobuf writes
    map entries in its hash table's order, which changes from process to process) and Manifest.json's item
    identifiers (random UUIDs, meaningless beyond naming the root item) made from each item's path."""
    path = Path(path)
    mlmodel.save(str(path))
    model = path / "Data" / "com.apple.CoreML" / "model.mlmodel"
    spec = Model_pb2.Model()
    spec.ParseFromString(model.read_bytes())
    model.write_bytes(spec.SerializeToString(deterministic=True))
    manifest = json.loads((path / "Manifest.json").read_text())
    entries = manifest["itemInfoEntries"]
    new_id = {old: str(uuid.uuid5(uuid.NAMESPACE_URL, entry["path"])) for old, entry in entries.items()}
    manifest["itemInfoEntries"] = {new_id[old]: entry for old, entry in entries.items()}
    manifest["rootModelIdentifier"] = new_id[manifest["rootModelIdentifier"]]
    (path / "Manifest.json").write_text(json.dumps(manifest, indent=4, sort_keys=True) + "\n")
    return path


# -- tiny models, traced and converted as coremltools' users do (tests/test_coreml.py, bench/fuzz_coreml.py) ---------

class Small(torch.nn.Module):
    """A linear stack and a conv: 2-D and 4-D weights, a layer without bias."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(16, 32)
        self.b = torch.nn.Linear(32, 8, bias=False)
        self.conv = torch.nn.Conv2d(4, 8, 3, padding=1)

    def forward(self, x, y):
        return self.b(torch.relu(self.a(x))), self.conv(y)


def small_inputs():
    g = torch.Generator().manual_seed(3)
    return torch.randn(2, 16, generator=g), torch.randn(1, 4, 6, 6, generator=g)


def small_model():
    torch.manual_seed(0)
    return randomize_(Small(), seed=1, scale=0.3).eval()


def convert_small(model, target=None):
    """Small traced and converted to an ML program (`target`: a ct.target name, None for coremltools' default)."""
    x, y = small_inputs()
    traced = torch.jit.trace(model, (x, y))
    kw = {} if target is None else dict(minimum_deployment_target=getattr(ct.target, target))
    return ct.convert(traced, inputs=[ct.TensorType(name="x", shape=x.shape), ct.TensorType(name="y", shape=y.shape)],
                      convert_to="mlprogram", **kw)


# one level (ct.convert's time grows with the op count), widths all different: resnets with shortcuts, a
# cross-attention transformer, the mid block and the embeddings
UNET = dict(sample_size=8, in_channels=4, out_channels=4, block_out_channels=(16,), norm_num_groups=8,
            layers_per_block=1, down_block_types=("CrossAttnDownBlock2D",), up_block_types=("CrossAttnUpBlock2D",),
            cross_attention_dim=20, attention_head_dim=4)


def tiny_unet(config=None):
    """A random diffusers UNet of `config` (UNET's by default)."""
    from diffusers import UNet2DConditionModel  # heavy: diffusers, for the modules that build a UNet
    torch.manual_seed(0)
    return randomize_(UNet2DConditionModel(**(config or UNET)), seed=10, scale=0.15).eval()


def palettized_unet(unet, nbits, weight_threshold):
    """The UNet traced inside Wrapper, converted (mlprogram, iOS 18) and palettized: uniform `nbits`-bit tables per
    group of 4 output channels (k-means over every layer takes coremltools ~20 s here; the op form is the same) for
    the weights of more than `weight_threshold` elements, the rest kept float16."""
    x, t, c = torch.zeros(1, 4, 8, 8), torch.tensor([10.0]), torch.zeros(1, 5, unet.config.cross_attention_dim)
    traced = torch.jit.trace(Wrapper(unet).eval(), (x, t, c), check_trace=False)
    mlmodel = ct.convert(traced, inputs=[ct.TensorType(name="x", shape=x.shape), ct.TensorType(name="t", shape=t.shape),
                                         ct.TensorType(name="c", shape=c.shape)],
                         convert_to="mlprogram", minimum_deployment_target=ct.target.iOS18)
    return palettize_weights(mlmodel, OptimizationConfig(global_config=OpPalettizerConfig(
        mode="uniform", nbits=nbits, granularity="per_grouped_channel", group_size=4,
        weight_threshold=weight_threshold)))


class Conv1x1(torch.nn.Module):
    """A Linear computed as a 1x1 convolution over [1, in, 1, tokens], its weight [out, in, 1, 1] under the Linear's
    own name: how Apple's ml-stable-diffusion converts every Linear of its UNet (its load_state_dict hook reshapes
    diffusers' weights so). Written here from that description; Apple's code is not used."""

    def __init__(self, linear):
        super().__init__()
        self.weight = torch.nn.Parameter(linear.weight.detach()[:, :, None, None].clone())
        self.bias = None if linear.bias is None else torch.nn.Parameter(linear.bias.detach().clone())

    def forward(self, x):
        lead, width = x.shape[:-1], x.shape[-1]
        y = torch.nn.functional.conv2d(x.reshape(1, -1, width).permute(0, 2, 1).reshape(1, width, 1, -1),
                                       self.weight, self.bias)
        return y.reshape(1, y.shape[1], -1).permute(0, 2, 1).reshape(*lead, y.shape[1])


class HandLayerNorm(torch.nn.Module):
    """A LayerNorm computed by hand over the channels of a [B, C, 1, tokens] tensor, (normalised + bias / weight) *
    weight, under the module's own parameter names: the form of Apple's LayerNormANE (as its source describes it),
    which the converter fuses into a layer_norm op whose gamma and beta get op-made names."""

    def __init__(self, norm):
        super().__init__()
        self.eps = norm.eps
        self.weight = torch.nn.Parameter(norm.weight.detach().clone())
        self.bias = torch.nn.Parameter(norm.bias.detach().clone())

    def forward(self, x):
        c = x.shape[-1]
        x = x.transpose(1, 2).unsqueeze(2)
        centred = x - x.mean(dim=1, keepdim=True)
        out = centred * ((centred * centred).mean(dim=1, keepdim=True) + self.eps).rsqrt()
        out = (out + (self.bias / self.weight).view(1, c, 1, 1)) * self.weight.view(1, c, 1, 1)
        return out.squeeze(2).transpose(1, 2)


class AppleStyle(torch.nn.Module):
    """The UNet traced itself (no wrapper: names without a prefix), its Linears as Conv1x1, its LayerNorms by hand."""

    def __init__(self, unet):
        super().__init__()
        self.model = copy.deepcopy(unet)
        for name, module in list(self.model.named_modules()):
            for child_name, child in list(module.named_children()):
                if isinstance(child, torch.nn.Linear):
                    setattr(module, child_name, Conv1x1(child))
                elif isinstance(child, torch.nn.LayerNorm):
                    setattr(module, child_name, HandLayerNorm(child))

    def forward(self, x, t, c):
        return self.model(x, t, c, return_dict=False)[0]


# -- the packages' weights as coremltools reads them: what diffusers runs in the parity tests ---------------------

def decompressed(mlmodel) -> dict:
    """coremltools' decompress_weights: {const name: value} of the decompressed program (its const ops; read from
    the program, as get_weights_metadata trips over the text encoder's list-input ops)."""
    program = decompress_weights(mlmodel)._mil_program
    return {op.outputs[0].name: np.asarray(op.outputs[0].val) for op in program.functions["main"].operations
            if op.op_type == "const"}


def as_read(package, model, coreml_models) -> dict:
    """`model`'s state dict as the package holds it: each weight found by mlxdiff's name mapping (formats/coreml),
    its value coremltools' own (decompress_weights of the MLModel each program came from, in coreml.parts' order),
    checked equal bit for bit to mlxdiff's decode and close to the module's own weight (float16 as ct.convert
    stores it; a fused LayerNorm's beta is recomputed by the converter, so not always the module's rounding)."""
    sd = {k: v for k, v in model.state_dict().items() if not k.endswith("position_ids")}
    renamed = {("text_model." + k if type(model).__name__ == "CLIPTextModel" and not k.startswith("text_model.")
                else k): k for k in sd}
    targets = {n: tuple(sd[k].shape) for n, k in renamed.items()}
    out = {}
    for part, mlmodel in zip(coreml.parts(package), coreml_models):
        found = coreml._mapped(part, {k: v for k, v in targets.items() if renamed[k] not in out}, None)
        palettized = any(isinstance(v, coreml.LutWeight) for v, _ in found.values())
        ref = decompressed(mlmodel) if palettized else {}
        for n, (value, const) in found.items():
            k = renamed[n]
            if isinstance(value, coreml.LutWeight):
                theirs = ref[const]
                assert np.array_equal(value.dense(), theirs), n
            else:     # stored as ct.convert stores it: the module's float16, or a value the converter fused
                theirs = np.asarray(value)
                assert np.allclose(theirs.astype(np.float32).reshape(sd[k].shape), sd[k].numpy(), rtol=2e-3,
                                   atol=2e-4), n
            out[k] = torch.from_numpy(np.ascontiguousarray(theirs.astype(np.float32).reshape(sd[k].shape)))
    assert set(out) == set(sd)
    return out


# -- Apple's folder: what ml-stable-diffusion's torch2coreml.py writes, made here with coremltools as it calls it ----

# a tiny SD 1.5 whose sizes follow the released model's rules that a folder without configs is read by (norm groups
# 32, 8 heads a level, CLIP's 64-wide heads): widths all differ (UNet 32 / 64, text 64 wide over 77 positions)
APPLE_UNET = dict(sample_size=12, in_channels=4, out_channels=4, block_out_channels=(32, 64), layers_per_block=1,
                  down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
                  up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), cross_attention_dim=64, attention_head_dim=8,
                  norm_num_groups=32)
APPLE_VAE = dict(block_out_channels=(32, 64), layers_per_block=1, latent_channels=4, norm_num_groups=32,
                 down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2)
APPLE_CLIP = dict(vocab_size=49408, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=1,
                  max_position_embeddings=77, hidden_act="quick_gelu", eos_token_id=49407, bos_token_id=49406,
                  pad_token_id=1)
LATENT = (12, 10)      # the shapes the packages are traced at (Apple's: the model's sample size, batch 2 for CFG)


class TextEncoderWrapper(torch.nn.Module):
    """torch2coreml.convert_text_encoder's wrapper: the encoder as `self.text_encoder`, its tuple output."""

    def __init__(self, text_encoder):
        super().__init__()
        self.text_encoder = text_encoder

    def forward(self, input_ids):
        return self.text_encoder(input_ids, return_dict=False)


class VAEDecoderWrapper(torch.nn.Module):
    """convert_vae_decoder's wrapper: post_quant_conv then the decoder."""

    def __init__(self, vae):
        super().__init__()
        self.post_quant_conv, self.decoder = vae.post_quant_conv, vae.decoder

    def forward(self, z):
        return self.decoder(self.post_quant_conv(z))


class VAEEncoderWrapper(torch.nn.Module):
    """convert_vae_encoder's wrapper: the encoder then quant_conv."""

    def __init__(self, vae):
        super().__init__()
        self.quant_conv, self.encoder = vae.quant_conv, vae.encoder

    def forward(self, x):
        return self.quant_conv(self.encoder(x))


def convert(module, inputs: dict, outputs, target=None, precision=None):
    """torch.jit.trace + ct.convert as torch2coreml._convert_to_coreml calls it: mlprogram, named float32
    inputs and outputs, its deployment target (iOS 16 by default), its compute precision (float16 unless
    `precision`: --xl-version's VAE is ct.precision.FLOAT32)."""
    traced = torch.jit.trace(module.eval(), tuple(inputs.values()), check_trace=False)
    return ct.convert(traced, convert_to="mlprogram", minimum_deployment_target=target or ct.target.iOS16,
                      compute_precision=precision or ct.precision.FLOAT16,
                      inputs=[ct.TensorType(name=n, shape=v.shape, dtype=np.float32) for n, v in inputs.items()],
                      outputs=[ct.TensorType(name=n, dtype=np.float32) for n in outputs])


def apple_twins(seed=0):
    """(unet, text_encoder, vae) torch twins of APPLE_*, random."""
    from diffusers import AutoencoderKL, UNet2DConditionModel  # heavy: diffusers, for the modules that build twins
    from transformers import CLIPTextConfig, CLIPTextModel  # heavy: transformers, likewise
    torch.manual_seed(seed)
    return (randomize_(UNet2DConditionModel(**APPLE_UNET).eval(), seed=1, scale=0.1),
            randomize_(CLIPTextModel(CLIPTextConfig(**APPLE_CLIP)).eval(), seed=3, scale=0.1),
            randomize_(AutoencoderKL(**APPLE_VAE).eval(), seed=2, scale=0.1))


def write_apple_folder(root, unet, text_encoder, vae, vocab, nbits=6, chunk=True):
    """Apple's folder under `root`: packages/ (TextEncoder, UnetChunk1 + UnetChunk2 (coremltools' bisect_model, as
    chunk_mlprogram.py calls it), VAEDecoder, VAEEncoder), the UNet and the text encoder palettized (`nbits`-bit
    k-means, as the converter's --quantize-nbits), the whole Unet.mlpackage kept in root/whole/, and the tokenizer's
    vocab.json / merges.txt (from the folder `vocab`) in compiled/ (where Apple's repositories keep them); with
    chunk=False (torch2coreml.py without --chunk-unet) the whole Unet.mlpackage in packages/ instead of the chunks.
    Returns {name: MLModel} of what it wrote (the UNet before chunking)."""
    root = Path(root)
    packages, compiled, whole = root / "packages", root / "compiled", root / "whole"
    for d in (packages, compiled, whole):
        d.mkdir(parents=True)
    h, w = LATENT
    models = {
        "TextEncoder": convert(TextEncoderWrapper(text_encoder), {"input_ids": torch.zeros(1, 77, dtype=torch.int32)},
                               ("last_hidden_state", "pooled_outputs")),
        "VAEDecoder": convert(VAEDecoderWrapper(vae), {"z": torch.zeros(1, 4, h, w)}, ("image",)),
        "VAEEncoder": convert(VAEEncoderWrapper(vae), {"x": torch.zeros(1, 3, 2 * h, 2 * w)}, ("latent",)),
    }
    width = unet.config.cross_attention_dim
    unet_model = convert(AppleStyle(unet), {"sample": torch.zeros(2, 4, h, w), "timestep": torch.tensor([10.0] * 2),
                                            "encoder_hidden_states": torch.zeros(2, 77, width)}, ("noise_pred",))
    # torch2coreml's --quantize-nbits: k-means tables for the UNet and the text encoder, the embedding (gather) not
    palettizing = OptimizationConfig(global_config=OpPalettizerConfig(mode="kmeans", nbits=nbits),
                                     op_type_configs={"gather": None})
    models["Unet"] = palettize_weights(unet_model, palettizing)
    models["TextEncoder"] = palettize_weights(models["TextEncoder"], palettizing)
    for name, model in models.items():
        model.save(str((whole if name == "Unet" and chunk else packages) / f"{name}.mlpackage"))
    if chunk:
        bisect_model(str(whole / "Unet.mlpackage"), str(root / "bisect"), check_output_correctness=False)
        for i in (1, 2):
            shutil.move(str(root / "bisect" / f"Unet_chunk{i}.mlpackage"), str(packages / f"UnetChunk{i}.mlpackage"))
    for name in ("vocab.json", "merges.txt"):
        shutil.copy(Path(vocab) / name, compiled / name)
    return models


# -- SDXL as torch2coreml.py --xl-version converts it ------------------------------------------------------------------

# a tiny SDXL whose sizes follow the released model's rules that a folder without configs is read by (64-wide heads,
# the first level without attention, transformer depths rising, six time ids): widths all differ (UNet 32 / 128,
# text 64 (CLIP-L's place) + 128 (OpenCLIP bigG's, projected to 96), so a 192-wide text, time ids 8 wide)
APPLE_XL_UNET = dict(sample_size=12, in_channels=4, out_channels=4, block_out_channels=(32, 128), layers_per_block=1,
                     down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
                     up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"), cross_attention_dim=192,
                     attention_head_dim=(1, 2), transformer_layers_per_block=(1, 2), use_linear_projection=True,
                     addition_embed_type="text_time", addition_time_embed_dim=8,
                     projection_class_embeddings_input_dim=96 + 6 * 8, norm_num_groups=32)
APPLE_XL_CLIP_2 = dict(vocab_size=49408, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                       num_attention_heads=2, max_position_embeddings=77, hidden_act="gelu", projection_dim=96,
                       eos_token_id=49407, bos_token_id=49406, pad_token_id=1)


class AppleStyleXL(AppleStyle):
    """UNet2DConditionModelXL as torch2coreml traces it: the added conditioning as two more inputs, time_ids
    [batch, 6] and text_embeds [batch, pooled]."""

    def forward(self, x, t, c, time_ids, text_embeds):
        return self.model(x, t, c, added_cond_kwargs={"time_ids": time_ids, "text_embeds": text_embeds},
                          return_dict=False)[0]


class TextEncoderXLWrapper(torch.nn.Module):
    """convert_text_encoder's wrapper with --xl-version (with_hidden_states_for_layer=-2): the penultimate hidden
    states, and the pool (CLIPTextModelWithProjection's text_embeds, CLIPTextModel's pooler_output)."""

    def __init__(self, text_encoder):
        super().__init__()
        self.text_encoder = text_encoder

    def forward(self, input_ids):
        output = self.text_encoder(input_ids, output_hidden_states=True)
        pooled = output.text_embeds if "text_embeds" in output else output.pooler_output
        return output.hidden_states[-2], pooled


def apple_xl_twins(seed=0):
    """(unet, text_encoder, text_encoder_2, vae) torch twins of the tiny SDXL, random."""
    from diffusers import AutoencoderKL, UNet2DConditionModel  # heavy: diffusers, for the modules that build twins
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection  # heavy, likewise
    torch.manual_seed(seed)
    return (randomize_(UNet2DConditionModel(**APPLE_XL_UNET).eval(), seed=5, scale=0.1),
            randomize_(CLIPTextModel(CLIPTextConfig(**APPLE_CLIP)).eval(), seed=6, scale=0.1),
            randomize_(CLIPTextModelWithProjection(CLIPTextConfig(**APPLE_XL_CLIP_2)).eval(), seed=7, scale=0.1),
            randomize_(AutoencoderKL(**APPLE_VAE).eval(), seed=8, scale=0.3))     # the image moves with the latents


# mixed_bit_compression_apply.py's recipes: {module: nbits}, nbits of NBITS ([1, 2, 4, 6, 8]) or 16 (kept float16),
# each weight matched to its module and palettized by k-means with its own nbits. PALETTIZE_MIN_SIZE (1e5 elements)
# is lowered to this for the tiny model, so that most layers get a palette (above its biases, 1024 at most, as
# the real threshold is above the real ones).
MIXED_BIT_MIN_SIZE = 2048
# every width the recipes allow, in the recipe's order of weights, largest first: k-means' time grows with the
# weight's size times its table's length, so the largest weights get the shortest tables and the 8-bit ones are the
# smallest (float16 third: the largest, palettized, keep the UNet's bytes well under float16's)
MIXED_NBITS = (1, 2, 16, 4, 6, 8)


def mixed_bit_recipe(unet) -> dict:
    """A recipe as mixed_bit_compression_pre_analysis writes one, over the UNet's layers with a weight of at least
    MIXED_BIT_MIN_SIZE elements: the layers by size, largest first, split into len(MIXED_NBITS) runs of (nearly)
    equal length given MIXED_NBITS's widths in turn, so every width Apple allows occurs."""
    sizes = {n[:-len(".weight")]: p.numel() for n, p in unet.named_parameters()
             if n.endswith(".weight") and p.dim() > 1 and p.numel() >= MIXED_BIT_MIN_SIZE}
    names = sorted(sizes, key=lambda name: -sizes[name])       # stable: layers of one size in the model's order
    assert len(names) >= len(MIXED_NBITS)
    return {name: MIXED_NBITS[i * len(MIXED_NBITS) // len(names)] for i, name in enumerate(names)}


def apply_mixed_bit_recipe(mlmodel, unet, recipe):
    """mixed_bit_compression_apply.main: each weight op matched to its module by the hash that script uses (its
    first float16 value plus its size; the nearest wins, so two layers of one shape may trade widths, as there),
    then palettize_weights with one OpPalettizerConfig per op name. Returns (the MLModel, {op name: the nbits it
    was given, 16 for float16})."""
    import coremltools.optimize.coreml as cto

    def tensor_hash(tensor):
        return float(tensor.ravel()[0]) + float(np.prod(tensor.shape))

    params = dict(unet.named_parameters())
    hashed = {tensor_hash(params[name + ".weight"].detach().numpy().astype(np.float16)): nbits
              for name, nbits in recipe.items()}
    hashes = np.array(list(hashed))
    configs, applied = {}, {}
    for name, metadata in cto.get_weights_metadata(mlmodel, weight_threshold=MIXED_BIT_MIN_SIZE).items():
        distance = np.abs(hashes - tensor_hash(metadata.val))
        assert distance.min() < 0.01, name
        applied[name] = nbits = hashed[hashes[distance.argmin()]]
        if nbits != 16:
            configs[name] = cto.OpPalettizerConfig(mode="kmeans", nbits=nbits, weight_threshold=MIXED_BIT_MIN_SIZE)
    return cto.palettize_weights(mlmodel, cto.OptimizationConfig(op_name_configs=configs)), applied


def write_apple_xl_folder(root, unet, text_encoder, text_encoder_2, vae, vocab, nbits=6):
    """Apple's SDXL folder under `root`, as torch2coreml.py --xl-version writes it: packages/ (TextEncoder and
    TextEncoder2 (penultimate hidden states and the pool), UnetChunk1 + UnetChunk2 of the UNet with its time_ids
    and text_embeds inputs, VAEDecoder and VAEEncoder converted in float32 as --xl-version does), the encoders
    palettized `nbits`-bit (--quantize-nbits), the UNet by a mixed-bit recipe (mixed_bit_recipe); the whole
    Unet.mlpackage in root/whole/; vocab.json / merges.txt in compiled/. Returns ({name: MLModel}, {the UNet's
    weight op name: the nbits the recipe gave it})."""
    root = Path(root)
    packages, compiled, whole = root / "packages", root / "compiled", root / "whole"
    for d in (packages, compiled, whole):
        d.mkdir(parents=True)
    h, w = LATENT
    ids = {"input_ids": torch.zeros(1, 77, dtype=torch.int32)}
    models = {
        "TextEncoder": convert(TextEncoderXLWrapper(text_encoder), ids, ("hidden_embeds", "pooled_outputs")),
        "TextEncoder2": convert(TextEncoderXLWrapper(text_encoder_2), ids, ("hidden_embeds", "pooled_outputs")),
        "VAEDecoder": convert(VAEDecoderWrapper(vae), {"z": torch.zeros(1, 4, h, w)}, ("image",),
                              precision=ct.precision.FLOAT32),
        "VAEEncoder": convert(VAEEncoderWrapper(vae), {"x": torch.zeros(1, 3, 2 * h, 2 * w)}, ("latent",),
                              precision=ct.precision.FLOAT32),
    }
    width, pooled = unet.config.cross_attention_dim, text_encoder_2.config.projection_dim
    sizes = [2.0 * h, 2.0 * w, 0, 0, 2.0 * h, 2.0 * w]       # original size, crop, target size (the pixels')
    unet_model = convert(AppleStyleXL(unet), {"sample": torch.zeros(2, 4, h, w), "timestep": torch.tensor([10.0] * 2),
                                              "encoder_hidden_states": torch.zeros(2, 77, width),
                                              "time_ids": torch.tensor([sizes] * 2),
                                              "text_embeds": torch.zeros(2, pooled)}, ("noise_pred",))
    palettizing = OptimizationConfig(global_config=OpPalettizerConfig(mode="kmeans", nbits=nbits),
                                     op_type_configs={"gather": None})
    models["Unet"], applied = apply_mixed_bit_recipe(unet_model, unet, mixed_bit_recipe(unet))
    for name in ("TextEncoder", "TextEncoder2"):
        models[name] = palettize_weights(models[name], palettizing)
    for name, model in models.items():
        model.save(str((whole if name == "Unet" else packages) / f"{name}.mlpackage"))
    bisect_model(str(whole / "Unet.mlpackage"), str(root / "bisect"), check_output_correctness=False)
    for i in (1, 2):
        shutil.move(str(root / "bisect" / f"Unet_chunk{i}.mlpackage"), str(packages / f"UnetChunk{i}.mlpackage"))
    for name in ("vocab.json", "merges.txt"):
        shutil.copy(Path(vocab) / name, compiled / name)
    return models, applied
