"""What a model family is, in one record (ComfyUI's one class per family in supported_models.py; diffusers' one folder
per pipeline). Each family folder (pipelines/<family>/) defines its FAMILY; pipelines/__init__.FAMILIES finds them
(every sub-package with a FAMILY, in their `order`) and its one detect loop asks each in turn. Everything the rest of
mlxdiff needs to know of a family is a field here, so that no code outside the family folders and the model files
names a family.
"""

from dataclasses import dataclass, field
from typing import Callable

from ..errors import MlxdiffError
from ..loading.spec import ARCHITECTURES

# mlxdiff.load's keywords that say where a model's parts are; a family takes some of them (Family.keywords)
PART_KEYWORDS = ("transformer", "text_encoders", "text_encoder", "vae", "tokenizer", "prediction_type")


@dataclass
class LoadRequest:
    """What mlxdiff.load was asked for besides the model itself: the files and settings a family's readers take."""
    transformer: object = None
    text_encoders: dict | None = None
    text_encoder: object = None
    vae: object = None
    tokenizer: object = None
    prediction_type: str | None = None

    def given(self) -> list:
        """The PART_KEYWORDS that were given (text_encoders={} counts as not given)."""
        return [k for k in PART_KEYWORDS if getattr(self, k) not in (None, {})]


@dataclass(frozen=True)
class Family:
    """One model family. The readers return a loading.spec.PipelineSources whose `family` is `name`."""
    name: str                   # the key sources, pipelines and messages carry ("sd3")
    title: str                  # what users call it, in messages ("SD3.5")
    article: str                # "a" or "an", as the title is said ("an SD3.5 model")
    pipeline: type              # its pipelines.base.Pipeline subclass (hooks on the one generate template)
    layouts: dict               # model_index.json `_class_name` -> {component: the classes its entry may name
                                # (None: any; the folder's files decide, as for tokenizers)}
    read_folder: Callable       # (path, index, pipeline_class, components, request) -> PipelineSources
    keywords: dict              # load() keywords of PART_KEYWORDS it takes -> what they are, for the refusals of
                                # the families that do not take them ("SD3.5's clip_l / clip_g / t5xxl files")
    reference: str              # its diffusers reference module (footprint compare): "mlxdiff.reference.sd3"
    order: int                  # its place in pipelines.FAMILIES (rising; each family its own number, in steps of
                                # 10 so that a new one fits between): the order detect asks the families in and
                                # messages and README's table list them in; a family whose files another family's
                                # claims would also take comes before that one
    optional: frozenset = frozenset()     # components a folder may set to [null, null]
    claims_file: Callable | None = None   # (tensor names) -> bool: one file holding a whole model of this family
    claims_folder: Callable | None = None  # (folder) -> bool: a folder without model_index.json it reads
                                          # (SD's: Apple's Core ML folders)
    read_claimed_folder: Callable | None = None   # (folder, request) -> PipelineSources for one it claims
    read_file: Callable | None = None     # (path, request) -> PipelineSources for a file it claims
    file_kinds: str = ""                  # what single files it reads, for the line that refuses an unclaimed one
    part_of: Callable | None = None       # (tensor names) -> a hint when a file is only a part of this family's
                                          # model (its transformer), saying how to give it; None when it is not
    read_files_alone: Callable | None = None   # (request) -> PipelineSources from part files alone (model=None)
    instead: dict = field(default_factory=dict)   # a keyword it does not take -> what to give this family instead
    reference_dtypes: tuple = ()          # footprint compare's --reference-dtype values its reference takes
    reference_file_refusal: str = ""      # when its reference cannot run a single file: what such a file is
    files_alone_kinds: str = ""           # with read_files_alone: the transformer files it reads without a model
    read_controlnets: Callable | None = None   # (PipelineSources, [(path, scale)]) -> None: load(controlnets=)'s
                                          # ControlNets read, checked against the model and added as components
    pipelines: dict = field(default_factory=dict)   # a layout's own Pipeline subclass (model_index class ->
                                          # class; Qwen-Image's Edit folders), where it is not `pipeline`
    preview: object = None                # its latents' previews.LatentRGB (ComfyUI's factors), or (pipeline class)
                                          # -> LatentRGB; None: previews.first_channels
    control_modes: dict = field(default_factory=dict)   # a Union ControlNet's modes by name -> the number its
                                          # ControlNets take (--control-mode NAME); {}: none of them has modes

    def pipeline_for(self, pipeline_class):
        """The Pipeline class that runs a folder of this model_index class."""
        return self.pipelines.get(pipeline_class, self.pipeline)

    def latent_rgb(self, pipeline_class):
        """The preview projection of this family's pipeline class (previews.latent_preview), or None."""
        return self.preview(pipeline_class) if callable(self.preview) else self.preview

    def check_keywords(self, where, request: LoadRequest) -> None:
        """Each load() keyword this family does not take refused in one line: what the keyword is for (the family
        that takes it says) and what to give instead."""
        for keyword in request.given():
            if keyword in self.keywords:
                continue
            owners = [f for f in families() if keyword in f.keywords]
            what = "; ".join(f"{f.keywords[keyword]}" for f in owners) or "another family's"
            raise MlxdiffError(f"{keyword}=: takes {what}, but {where} is {self.article} {self.title} model; "
                               + self.instead.get(keyword, f"leave {keyword}= out"))

    def shardable(self) -> bool:
        """Whether its denoiser shards over ranks (split="tensor"): its architecture has Model.shard."""
        denoiser = self.pipeline.DENOISER
        classes = {c for layout in self.layouts.values() for c in layout[denoiser]}
        return all(hasattr(ARCHITECTURES[c].Model, "shard") for c in classes)


def identify(names, but=None) -> str | None:
    """What a family other than `but` says a file holding these tensor names is (a whole model it reads, or a part
    of one and how to give it), for a reader refusing a file it does not read; None when no family knows it."""
    others = [f for f in families() if f.name != but]
    for f in others:
        if f.claims_file is not None and f.claims_file(names):
            return f"{f.article} {f.title} single file; give it as the model"
    return next((hint for f in others if f.part_of is not None and (hint := f.part_of(names))), None)


def check_options(family, options: dict) -> None:
    """generate() keywords the family `family` (its name) does not have: another family's option (its pipeline's
    OPTIONS say which), or unknown."""
    record = family_named(family)
    title = record.title
    for name in options:
        owners = [f.title for f in families() if name in f.pipeline.OPTIONS]
        if owners:
            raise MlxdiffError(f"{name}: an option of {' and '.join(owners)} models only; this is {record.article} {title} model")
        raise MlxdiffError(f"{name}=: not an argument of generate() for {title} models")


def families() -> tuple:
    """The registry (pipelines.FAMILIES), imported late: the records are made by the family folders."""
    from . import FAMILIES  # cycle: mlxdiff.pipelines imports this module before it makes FAMILIES
    return FAMILIES


def family_named(name) -> Family:
    return next(f for f in families() if f.name == name)
