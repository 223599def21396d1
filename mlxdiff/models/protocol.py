"""What an architecture module (mlxdiff.models.<x>) provides to the loaders: written down as Protocols.

The loaders take a module, not a class: a ComponentSpec's `arch` is the module itself. models/registry.py finds them
by convention: every module of this package that meets `Architecture` is one (none is listed by hand), and
ARCHITECTURES maps the diffusers' / transformers' class names it reads (CLASS_NAMES) to it. What every one must have is
`Architecture`; the rest are hooks the loaders look for with getattr / hasattr, each a capability of its own
Protocol below, with who calls it and what it returns. Nothing here is called: this is the checklist, and
tests/test_architecture_protocol.py holds every registered module to it.

Adding an architecture (a family's models; the family itself is a folder, pipelines/<family>/: ARCHITECTURE.md's
"How to add a family"), the checklist:
1. `ModelArgs`: a config_checks.CheckedArgs dataclass (`from_dict(config, where)` checks types, LIMITS, RULES).
2. `Model(args)`: an mlx.nn.Module that keeps `args`, with `sanitize(weights)`; `quant_predicate(path, module)`
   when some layers must stay in full precision; `eager_is_faster()` if its eager blocks beat compiled ones;
   `resident_blocks()` if it reads a block outside that block's call (streaming must keep it resident);
   `activation_bytes(dtype)` if its activations are known small (a streamed plan keeps only that free).
3. `CLASS_NAMES`: the diffusers / transformers class names it reads, which registers it (models/registry.py finds
   the module by them; the family's components name them in its Family.layouts).
4. Then the hooks of the capabilities it has: a denoiser read from one original file (`OriginalFile`) and its
   LoRAs (`LoRADenoiser`, whose `LORA_ORDER` places its layer-name rows among the others'), an encoder whose config a
   single file's shapes give (`ConfigFromWeights`), an encoder read only partly (`PartialReader`).
Each capability is all or nothing: a module with its marker (CAPABILITIES) has all of its members (the test
checks this). Family-specific readers call some functions by name (vae.config_from_ldm, vae_flux2's
config_from_original and original_keymap, text_llm.config_from_file, t5.from_gguf, clip.sd3_clip_l_extras); those
are no generic hooks.
Layers say one thing of themselves: `decodes_per_call = True` (formats/quantized.DecodingLinear) keeps
memory.compile_blocks_for from compiling a model's blocks whole.
"""

from typing import Protocol, runtime_checkable


@runtime_checkable
class ArchitectureArgs(Protocol):
    """An architecture's typed config (`ModelArgs`, a config_checks.CheckedArgs dataclass)."""

    @classmethod
    def from_dict(cls, params: dict, where=None) -> "ArchitectureArgs":
        """ComponentSpec.args, loading/build.build and every reader (a config.json, a config read off shapes): the
        checked config; an MlxdiffError naming `where` otherwise."""
        ...


@runtime_checkable
class ArchitectureModel(Protocol):
    """What loading/build.build needs of `Model(args)` (an mlx.nn.Module, which also keeps `args`: lora/ reads
    `model.args`)."""

    def sanitize(self, weights: dict) -> dict:
        """loading/build.build: the file's tensors, in diffusers' / transformers' names (already remapped from any
        other naming) -> the module's own names and layouts, for a strict load_weights. Not called for
        mlxdiff's own checkpoints (spec.NATIVE_KEY in the config), saved after it."""
        ...


@runtime_checkable
class QuantRule(Protocol):
    """Optional on `Model`: which layers quantize=... may quantize."""

    def quant_predicate(self, path: str, module) -> bool:
        """loading/quantize.quantizable (quantize while loading): False keeps that Linear in full precision (its
        width must also be a multiple of the group size). Absent: every such Linear is quantized."""
        ...


@runtime_checkable
class EagerPreference(Protocol):
    """Optional on `Model`."""

    def eager_is_faster(self) -> bool:
        """memory.compile_blocks_for: True keeps the blocks eager (FLUX.2 with its fused CUDA norm+RoPE kernel).
        Absent: False."""
        ...


@runtime_checkable
class ResidentBlocks(Protocol):
    """Optional on `Model`."""

    def resident_blocks(self) -> tuple:
        """loading/streaming.plan: the paths of blocks the model reads outside their own call (T5: block 0's
        relative attention bias, read before the loop), which are never streamed. Absent: none."""
        ...


@runtime_checkable
class KnownActivations(Protocol):
    """Optional on `Model`."""

    def activation_bytes(self, compute_dtype) -> int:
        """loading/streaming.plan: the most its forward holds in activations at its largest input (a text encoder at
        its longest prompt), so that a streamed plan keeps that much free instead of half the budget. Absent: half
        the budget (at most streaming.RESERVE_BYTES)."""
        ...


@runtime_checkable
class Architecture(Protocol):
    """Required of every module in models/registry.ARCHITECTURES (and what makes a module one)."""

    ModelArgs: type[ArchitectureArgs]
    """The typed config: `ModelArgs.from_dict(config, where)` (ArchitectureArgs)."""
    Model: type[ArchitectureModel]
    """`Model(ModelArgs)`: the mlx.nn.Module loading/build.build makes and loads (ArchitectureModel; optionally
    QuantRule, EagerPreference, ResidentBlocks, KnownActivations)."""
    CLASS_NAMES: tuple
    """models/registry: the diffusers / transformers class names (model_index.json / config.json) this module reads,
    its keys in ARCHITECTURES; the first is what mlxdiff.convert saves a component as (loading/spec.class_name_of)."""


@runtime_checkable
class OriginalFile(Protocol):
    """A denoiser read from one file in its original (SAI / BFL) names: loading/sources.transformer_from_file
    (transformer=FILE, single files, FLUX.2 from files alone)."""

    ORIGINAL_PREFIX: str
    """transformer_from_file: the key prefix a full checkpoint puts before the original names
    ("model.diffusion_model."), stripped when the file has it."""
    FROM_BASE_CONFIG: tuple
    """transformer_from_file: config keys the shapes cannot give, taken from the pipeline folder's config when one
    is given."""

    def is_original(self, names) -> bool:
        """transformer_from_file (and a family's Family.part_of, to tell the families apart): whether these tensor
        names are the original naming rather than diffusers'."""
        ...

    def config_from_original(self, shapes: dict) -> dict:
        """transformer_from_file: {original name: shape} (prefix stripped) -> the config dict (an MlxdiffError if
        the shapes are not this architecture's)."""
        ...

    def original_to_diffusers(self, weights: dict) -> dict:
        """ComponentSpec.keymap of such a file: {original name: tensor} -> diffusers' names (what sanitize reads)."""
        ...


@runtime_checkable
class LoRADenoiser(Protocol):
    """A denoiser LoRAs apply to (lora/): what it is called and how original-named LoRA layers reach it."""

    LORA_NAME: str
    """lora.plan's messages: what the denoiser is ("SD3.5 transformer", "SD 1.x / SDXL UNet")."""
    LORA_ARCHITECTURE: str
    """lora.plan: its label in lora.ARCHITECTURES (the layer names that tell a LoRA's architecture), so that a LoRA
    for another one is refused by name."""
    LORA_ARCHITECTURE_PATTERNS: tuple
    """lora.ARCHITECTURES' rows it brings: ((compiled pattern, labels), ...), a pattern searched in each LoRA layer
    name and the labels (LORA_ARCHITECTURE, and any other architecture that has those names too) of the models the
    names fit. () when another's names tell its LoRAs (Chroma's are FLUX.1's)."""
    LORA_ORDER: int
    """models/registry.LORA_DENOISERS: its place among the LoRA denoisers (rising; each its own number), the order
    their LORA_ARCHITECTURE_PATTERNS rows are tried in (the first row a layer name matches says which architectures it
    fits, so a row of names several architectures share comes after each one's own) and lora's messages list them
    in."""

    def lora_original_rules(self, args) -> list:
        """lora.names._original_rules: the compiled (pattern, target, transform) rules of the original names for a model
        of `args` (formats/keymaps compile_rules), through which original-named LoRA keys reach mlxdiff's layers. A
        module may also have LORA_UNMAPPED, (a pattern of original names its rules cannot map, why), for the line
        that refuses them."""
        ...


@runtime_checkable
class ConfigFromWeights(Protocol):
    """An SD3.5 text encoder read from one file (loading/component_files.text_encoder_file: clip_l, clip_g,
    t5xxl)."""

    def config_from_weights(self, weights: dict) -> dict:
        """text_encoder_file: {name: tensor or shape} -> the config dict the shapes give (the rest: defaults)."""
        ...


@runtime_checkable
class PartialReader(Protocol):
    """An encoder read only partly (the FLUX.2 LLM encoders, up to their deepest tap)."""

    STORED_PREFIX: str
    """mlxdiff.convert: the prefix of the stored names it writes the whole model under (no NATIVE_KEY then: the
    converted folder is read back through sanitize, for any taps)."""

    def reads_stored(self, name: str, args) -> bool:
        """ComponentSpec.nbytes / loaded_nbytes: whether a stored tensor is one the model reads (for `args`), so
        that only those count toward its size."""
        ...

    def check_config(self, config: dict, where) -> None:
        """ComponentSpec.build: checks the final config (taps included) before building; raises an MlxdiffError
        naming `where`."""
        ...

    def whole_model_config(self, config: dict) -> dict:
        """mlxdiff.convert: the config changes that build every layer (what a converted folder holds)."""
        ...


# capability -> the member whose presence says a module has it (what the loaders look for first); a module with
# it has every member of the capability (tests/test_architecture_protocol.py)
CAPABILITIES = {OriginalFile: "is_original", LoRADenoiser: "lora_original_rules",
                ConfigFromWeights: "config_from_weights", PartialReader: "reads_stored"}
MODEL_HOOKS = (QuantRule, EagerPreference, ResidentBlocks, KnownActivations)     # optional methods of `Model`


def protocol_members(protocol) -> tuple:
    """The member names a Protocol lists (its annotations and methods, not typing's own)."""
    names = set(getattr(protocol, "__annotations__", {}))
    names |= {k for k, v in vars(protocol).items() if callable(v) or isinstance(v, classmethod)}
    return tuple(sorted(n for n in names if not (n.startswith("__") and n.endswith("__"))
                        and n not in ("_is_protocol", "_is_runtime_protocol")))
