"""One reader of VAE files (`vae=FILE`, or a VAE found beside a transformer file) for every family.

A VAE file comes in its architecture's original naming (Stability's / BFL's ldm names, Wan's for Qwen-Image's),
often under a checkpoint's prefix (`first_stage_model.`, ComfyUI's `vae.`), or in diffusers' names. What differs
per architecture is one `VaeNaming` record: how to tell its original names, how to read a config off their shapes,
the key map to diffusers' names, and what a diffusers-named file needs. The reader's steps are the same for all:
the file checked, the prefix found, another architecture's VAE refused by name, the naming told, the config
checked, and a one-line refusal that lists what it reads.
"""

from dataclasses import dataclass
from typing import Callable

from ..errors import MlxdiffError
from ..formats import check_weight_file, tensor_shapes
from ..formats.keymaps import remap
from ..models import vae, vae_flux2, vae_qwenimage
from .sources import not_a_folder
from .spec import ComponentSpec

PREFIXES = ("first_stage_model.", "vae.")   # a VAE inside a checkpoint (Stability's, ComfyUI's bundles); else none


@dataclass(frozen=True)
class VaeNaming:
    arch: object                   # the models/ module the spec builds
    reads: str                     # the namings it reads, for the refusal: "not <title> VAE in <reads>"
    is_original: Callable          # names -> whether they are the original naming
    from_original: Callable        # (names, base_config) -> config; raises MlxdiffError on a shape it cannot read
    keymap: Callable               # names -> the original -> diffusers renaming (weights -> weights)
    from_diffusers: Callable = None    # (names, base_config) -> config of a diffusers-named file, or None: not read
    other: Callable = lambda names, title: None    # another architecture's VAE: its one-line reason, else None
    what: str = None               # the refusal's subject where it is not "<title> VAE"


def read_vae_file(path, naming: VaeNaming, base_config=None, base_where=None, title="this") -> ComponentSpec:
    """The VAE in file `path` as `naming` reads it. `base_config`: the model's own VAE config (a folder's
    vae/config.json, `base_where`), for what shapes cannot give; `title`: the model it is for ("an SD3.5")."""
    path = check_weight_file(not_a_folder(path, "VAE file"), "VAE file")
    shapes = tensor_shapes(path)
    prefix = next((p for p in PREFIXES if any(n.startswith(p + "decoder.") for n in shapes)), "")
    names = {k[len(prefix):]: v for k, v in shapes.items() if k.startswith(prefix)}
    reason = naming.other(names, title)
    if reason:
        raise MlxdiffError(f"{path}: {reason}")
    check_channels(path, names, title)
    if naming.is_original(names):
        try:
            config = naming.from_original(names, base_config)
        except MlxdiffError as e:   # the inference knows tensors, not files
            raise MlxdiffError(f"{path}: {e}") from None
        where = f"{path} (config read from its tensor shapes" + (f" and {base_where})" if base_where else ")")
        naming.arch.ModelArgs.from_dict(config, where)
        return ComponentSpec("vae", naming.arch, config, [path], prefix, naming.keymap(names))
    if naming.from_diffusers is not None and "decoder.conv_in.weight" in names:
        if base_config is None:
            raise MlxdiffError(f"{path}: a diffusers-named VAE file needs its config.json; load the pipeline folder "
                               "and pass this file as vae=, or give the VAE in its original names")
        config = naming.from_diffusers(names, base_config)
        naming.arch.ModelArgs.from_dict(config, f"{path} (the model's VAE config)")
        return ComponentSpec("vae", naming.arch, config, [path], prefix)
    shown = ", ".join(sorted(names)[:4]) or "no tensors"
    raise MlxdiffError(f"{path}: not {naming.what or title + ' VAE'} in {naming.reads}; its tensors are {shown}")


def _dim(names, key, axis):
    shape = tuple(names[key].shape) if key in names else ()
    return shape[axis] if len(shape) == 4 else None


def check_channels(path, names, title) -> None:
    """A VAE's image ends, from its shapes (ldm and diffusers names share them), before anything runs: images of 3
    channels out and in (decoder.conv_out, encoder.conv_in); another count decodes into nothing a PNG holds (it
    crashed inside Pillow after the whole denoise). Its latents against the denoiser's: each family's check of its
    components together (the UNet family's check_unet_together)."""
    for key, axis, end in (("decoder.conv_out.weight", 0, "decodes to"), ("encoder.conv_in.weight", 1, "encodes")):
        channels = _dim(names, key, axis)
        if channels is not None and channels != 3:
            raise MlxdiffError(f"{path}: this VAE {end} images of {channels} channels ({key} {tuple(names[key].shape)})"
                               f", not RGB's 3; it is not a VAE for {title} model, give that model's own VAE")


def _renaming(rules):
    return lambda weights: remap(weights, rules)


def _ldm_names(names) -> bool:
    return any(n.startswith(("encoder.down.", "decoder.up.")) for n in names)


def _flux2_vae(names, title):
    return "bn.running_mean" in names and (f"a FLUX.2 VAE (it has bn.running_mean), but this is {title} model; give "
                                           "that model's own VAE")


def _autoencoder_kl_diffusers(names, base):
    """A diffusers-named AutoencoderKL: the model's config, with what the file's shapes say (its latent channels,
    whether it has the quant convs: the fp16-fixed SDXL VAE and SD3.5's differ there)."""
    latent = tuple(names["decoder.conv_in.weight"].shape)
    return {**base, "latent_channels": latent[1] if len(latent) == 4 else base["latent_channels"],
            "use_quant_conv": "quant_conv.weight" in names, "use_post_quant_conv": "post_quant_conv.weight" in names}


# SD 1.x / 2.x / XL, SD3.5, FLUX.1, Chroma, Z-Image: diffusers' AutoencoderKL (models/vae.py)
AUTOENCODER_KL = VaeNaming(
    arch=vae, reads="a naming mlxdiff reads (ldm: encoder.down.N.*, decoder.up.N.*; or diffusers')",
    is_original=_ldm_names,
    from_original=lambda names, base: vae.config_from_ldm(names, defaults=base),
    keymap=lambda names: _renaming(vae.ldm_keymap(vae.ldm_num_blocks(names))),
    from_diffusers=_autoencoder_kl_diffusers, other=_flux2_vae)


def _flux2_from_original(names, base):
    config = vae_flux2.config_from_original(names)
    config.update({k: base[k] for k in ("norm_num_groups", "batch_norm_eps", "batch_norm_momentum", "act_fn",
                                        "sample_size") if base and k in base})
    return config


def _no_latent_statistics(names, title):
    return (not {"bn.running_mean", "bn.running_var"} <= set(names) and "decoder.conv_in.weight" in names and
            "a VAE without FLUX.2's latent statistics (bn.running_mean, bn.running_var): FLUX.1's or SD3.5's ae, not "
            "FLUX.2's; give flux2-vae.safetensors / FLUX.2's ae.safetensors")


# FLUX.2: AutoencoderKLFlux2 (models/vae_flux2.py), BFL / ComfyUI names with the batch-norm latent statistics
FLUX2 = VaeNaming(
    arch=vae_flux2, reads="a naming mlxdiff reads (BFL / ComfyUI: encoder.down.N.*, decoder.up.N.*, "
                          "bn.running_mean; or diffusers' with a pipeline folder)",
    is_original=_ldm_names, from_original=_flux2_from_original,
    keymap=lambda names: _renaming(vae_flux2.original_keymap(vae.ldm_num_blocks(names))),
    from_diffusers=lambda names, base: dict(base), other=_no_latent_statistics)

# Qwen-Image: AutoencoderKLQwenImage (models/vae_qwenimage.py) in Wan's names (ComfyUI's qwen_image_vae.safetensors)
QWENIMAGE = VaeNaming(
    arch=vae_qwenimage, what="Qwen-Image's VAE",
    reads="Wan's names (encoder.downsamples.*, decoder.upsamples.*, as ComfyUI's qwen_image_vae.safetensors); a "
          "diffusers-named one needs its folder",
    is_original=vae_qwenimage.has_original_names,
    from_original=lambda names, base: vae_qwenimage.config_from_original(names),
    keymap=lambda names: vae_qwenimage.original_to_diffusers)
