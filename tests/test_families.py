"""The family registry (issue 38): every record in mlxdiff.pipelines.FAMILIES is complete and conforms (its folder's
pipeline, layouts of registered architectures that meet the protocol, readers paired with the words that describe
them, load() keywords and generate() options derived from it, a diffusers reference that runs), and no code outside
the family folders and the model files names a family."""

import ast
import importlib
import inspect
import re
from pathlib import Path

import pytest

import mlxdiff  # noqa: F401  (OpenBLAS preload before mlx)
from mlxdiff.errors import MlxdiffError
from mlxdiff.loading.spec import ARCHITECTURES
from mlxdiff.models import protocol as P
from mlxdiff.pipelines import FAMILIES, by_pipeline_class, detect
from mlxdiff.pipelines.base import Pipeline
from mlxdiff.pipelines.family import PART_KEYWORDS, LoadRequest, check_options, family_named

PACKAGE = Path(mlxdiff.__file__).parent
IDS = [f.name for f in FAMILIES]
# what a layout may name that is no model: tokenizers (None: any class) and schedulers (their classes' names)
NOT_MODELS = ("tokenizer", "scheduler", "processor")   # processor: QwenImage21Pipeline's tokenizer


def test_names_and_classes_are_unique():
    assert len({f.name for f in FAMILIES}) == len(FAMILIES)
    assert len({f.title for f in FAMILIES}) == len(FAMILIES)
    classes = [cls for f in FAMILIES for cls in f.layouts]
    assert len(classes) == len(set(classes)) == len(by_pipeline_class())
    assert all(by_pipeline_class()[cls] is f for f in FAMILIES for cls in f.layouts)
    # FAMILIES (found by convention: pipelines.family_records) is in each record's own order, one number each
    orders = [f.order for f in FAMILIES]
    assert all(isinstance(n, int) for n in orders) and orders == sorted(set(orders))


@pytest.mark.parametrize("family", FAMILIES, ids=IDS)
def test_record_is_complete(family):
    assert family.name and family.title and family.article in ("a", "an")
    assert issubclass(family.pipeline, Pipeline) and family.pipeline.family == family.name
    assert family_named(family.name) is family
    # the folder: the record, its pipeline and its readers are one package under pipelines/
    folder = PACKAGE / "pipelines" / Path(inspect.getfile(family.pipeline)).parent.name
    assert Path(inspect.getfile(family.pipeline)).parent == folder and (folder / "__init__.py").is_file()
    for reader in (family.read_folder, family.read_file, family.read_files_alone, family.part_of):
        if reader is not None:
            assert Path(inspect.getfile(reader)).parent == folder, reader
    # readers come with the words that describe them in the refusals
    assert (family.claims_file is None) == (family.read_file is None) == (not family.file_kinds)
    assert (family.read_files_alone is None) == (not family.files_alone_kinds)
    assert family.read_files_alone is None or family.part_of is not None   # files alone are told by the part
    assert set(family.keywords) <= set(PART_KEYWORDS) and "transformer" in family.keywords
    assert set(family.instead) <= set(PART_KEYWORDS) - set(family.keywords)
    assert all(isinstance(v, str) and v for v in (*family.keywords.values(), *family.instead.values()))


@pytest.mark.parametrize("family", FAMILIES, ids=IDS)
def test_layouts_name_registered_architectures(family):
    denoiser = family.pipeline.DENOISER
    assert family.layouts
    for cls, layout in family.layouts.items():
        assert denoiser in layout and "vae" in layout, cls
        assert family.optional <= set(layout) | {n for other in family.layouts.values() for n in other}
        for component, allowed in layout.items():
            if component.startswith(NOT_MODELS):
                continue
            assert allowed, (cls, component)
            for class_name in allowed:
                arch = ARCHITECTURES[class_name]
                assert isinstance(arch, P.Architecture), (cls, component, class_name)
        for class_name in layout[denoiser]:      # the denoiser is read from original files and takes LoRAs
            arch = ARCHITECTURES[class_name]
            assert isinstance(arch, P.OriginalFile) and isinstance(arch, P.LoRADenoiser), class_name
    assert family.shardable() in (True, False)


@pytest.mark.parametrize("family", FAMILIES, ids=IDS)
def test_keywords_it_does_not_take_are_refused(family):
    """Each load() keyword another family takes is refused for this one in one line: what the keyword is for and
    what this family takes instead."""
    for keyword in PART_KEYWORDS:
        if keyword in family.keywords:
            continue
        assert any(keyword in f.keywords for f in FAMILIES), keyword     # every keyword has an owner
        value = {"text_encoders": {"clip_l": "x.safetensors"}, "prediction_type": "epsilon"}.get(keyword, "x")
        with pytest.raises(MlxdiffError) as e:
            family.check_keywords("MODEL", LoadRequest(**{keyword: value}))
        message = str(e.value)
        assert "\n" not in message and message.startswith(f"{keyword}=: ") and family.title in message, message
        assert family.instead.get(keyword, f"leave {keyword}= out") in message


@pytest.mark.parametrize("family", FAMILIES, ids=IDS)
def test_options_are_derived_from_the_pipelines(family):
    """generate()'s family options come from each pipeline's OPTIONS: another family's is refused naming the
    families that have it, an unknown one as not an argument."""
    for option in {o for f in FAMILIES for o in f.pipeline.OPTIONS} - set(family.pipeline.OPTIONS):
        owners = [f.title for f in FAMILIES if option in f.pipeline.OPTIONS]
        with pytest.raises(MlxdiffError, match=f"^{option}: an option of {' and '.join(owners)} models only; this "
                                                f"is {family.article} {family.title} model$".replace(".", r"\.")):
            check_options(family.name, {option: 1})
    with pytest.raises(MlxdiffError, match=f"not an argument of generate\\(\\) for {family.title}"):
        check_options(family.name, {"no_such_option": 1})


@pytest.mark.parametrize("family", FAMILIES, ids=IDS)
def test_reference_runs(family):
    """Its diffusers reference (footprint compare, the parity tests) is a module that runs as `python -m` with a
    `run`; --reference-dtype values are dtypes diffusers takes."""
    module = importlib.import_module(family.reference)
    assert callable(module.run) and 'if __name__ == "__main__"' in Path(module.__file__).read_text()
    assert set(family.reference_dtypes) <= {"bfloat16", "float32", "float16"}


def test_unclaimed_file_is_one_line_listing_what_each_family_reads(tmp_path):
    from safetensors.numpy import save_file
    import numpy as np
    save_file({"encoder.layer.0.weight": np.zeros((2, 2), np.float32)}, str(tmp_path / "other.safetensors"))
    with pytest.raises(MlxdiffError) as e:
        detect(str(tmp_path / "other.safetensors"), LoadRequest())
    message = str(e.value)
    assert "\n" not in message and "other.safetensors" in message
    for family in FAMILIES:
        assert not family.file_kinds or family.file_kinds in message


def _literals(path):
    """Every str constant in a module that is not documentation: not a docstring, not an argparse `help=` text (what
    an option is for may say which families take it)."""
    tree = ast.parse(path.read_text())
    docs = {id(node.body[0].value) for node in ast.walk(tree)
            if isinstance(node, (ast.Module, ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef))
            and node.body and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
    docs |= {id(n) for node in ast.walk(tree) if isinstance(node, ast.keyword) and node.arg == "help"
             for n in ast.walk(node.value)}
    return [(n.lineno, n.value) for n in ast.walk(tree)
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docs]


# what names a family besides its record's name (a whole word), title and pipeline classes: its variants, its
# models' names and the spellings messages use
FAMILY_WORDS = ("SDXL", "SD 1.", "SD 2.", "SD3", "stable_diffusion", "klein", "Kontext", "schnell", "FLUX", "Chroma",
                "Krea", "Z-Image", "Qwen-Image")

# The literals outside the family folders, the model files and the references that do name a family, each with why
# (the audit of issue 38's "Done when"): {file: [(pieces, why)]}: every such literal holds one of its file's pieces,
# and every piece is still used. "left:" marks a debt: it should come from the registry (the closing note lists them).
NAMED_BY_FAMILY = ("a model file or format named after the family that made it (as diffusers names the class), "
                   "shared by the families that read it")
NAMING_ALLOWED = {
    "loading/spec.py": [
        (("as an SD 1.x / SDXL UNet only",), "a Core ML package is SD's UNet: the only diffusion models Apple's "
                                            "converter makes (the format's own fact, formats/table.COREML)")],
    "formats/__init__.py": [
        (("as an SD 1.x / SDXL UNet",), "a Core ML package is SD's UNet (formats/table.COREML's only_as)")],
    "loading/component_files.py": [
        (("flux1*vae*", "flux_ae*"), "FLUX.1's ae.safetensors names: " + NAMED_BY_FAMILY),
        (("FLUX.2-dev's tokenizer/",), "where Mistral-Small-3.1's tokenizer is found: FLUX.2-dev's folder")],
    "loading/vae_files.py": [
        (("a FLUX.2 VAE", "FLUX.2's latent statistics", "Qwen-Image's VAE"),
         "a VaeNaming record's words for its VAE architecture: " + NAMED_BY_FAMILY)],
    "pipelines/previews.py": [
        (("TAESDXL",), "the tiny VAEs' own names (madebyollin's TAESD, TAESDXL, TAESD3, TAEF1, TAEF2)")],
    "default_model.py": [
        (("klein-shapes",), "the embedded default model's folder: a model, not code deciding by family")],
    "convert.py": [(("e.g. klein-native",), "an example folder name in a message")],
    "loading/sources.py": [(("e.g. black-forest-labs/",), "an example hub id in a message")],
    "ldm_schedulers.py": [
        (("SD's",), "a discrete-time scheduler's usual values, said as the model they come from")],
    "tokenizers.py": [
        (("as FLUX.2-dev's tokenizer/",), "where Mistral-Small-3.x's tokenizer is found: FLUX.2-dev's folder (as "
                                         "in loading/component_files)")],
}


def _names_a_family():
    words = {f.title for f in FAMILIES} | {cls for f in FAMILIES for cls in f.layouts} | set(FAMILY_WORDS)
    return re.compile("|".join(map(re.escape, sorted(words, key=len, reverse=True)))
                      + r"|\b(?:" + "|".join(f.name for f in FAMILIES) + r")\b", re.IGNORECASE)


def test_no_code_outside_the_family_folders_names_a_family():
    """A family's name, title, pipeline classes and variants appear as literals only in its folder, the model files
    and the references (the diffusers side); elsewhere code asks the registry, or NAMING_ALLOWED says why not."""
    pattern = _names_a_family()
    folders = {Path(inspect.getfile(f.pipeline)).parent for f in FAMILIES}
    allowed = folders | {PACKAGE / "models", PACKAGE / "reference"}
    found, used = [], set()
    for path in sorted(PACKAGE.rglob("*.py")):
        if any(a == path.parent or a in path.parents for a in allowed):
            continue
        where = path.relative_to(PACKAGE).as_posix()
        for line, value in _literals(path):
            if not pattern.search(value):
                continue
            pieces = [p for pieces, _ in NAMING_ALLOWED.get(where, ()) for p in pieces if p in value]
            used.update((where, p) for p in pieces)
            if not pieces:
                found.append(f"{where}:{line}: {value!r}")
    assert not found, found
    stale = [(where, p) for where, entries in NAMING_ALLOWED.items() for pieces, _ in entries for p in pieces
             if (where, p) not in used]
    assert not stale, f"NAMING_ALLOWED pieces no literal holds any more (take them out): {stale}"


# a family derived from another, as its diffusers pipeline is: Chroma's pipeline is FLUX.1's with T5 alone and no
# guidance embedder (diffusers' ChromaPipeline is "Copied from" FluxPipeline throughout)
DERIVED_FROM = {"chroma": {"flux1"}}


def test_family_folders_import_no_other_family():
    """What several families share lives outside their folders (loading/, pipelines/ shared modules), so a family is
    its folder: none imports another's, except a family derived from it (DERIVED_FROM)."""
    folders = {Path(inspect.getfile(f.pipeline)).parent.name for f in FAMILIES}
    found = []
    for name in sorted(folders):
        for path in sorted((PACKAGE / "pipelines" / name).glob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ImportFrom) and node.level == 2 and node.module:
                    other = node.module.split(".")[0]
                    if other in folders and other != name and other not in DERIVED_FROM.get(name, ()):
                        found.append(f"{path.relative_to(PACKAGE)}:{node.lineno}: from ..{node.module}")
    assert not found, found


def test_readme_family_table_is_the_registry():
    """README's Families table is FAMILIES: one row per family, its title, its pipeline classes, the files it reads."""
    from pathlib import Path
    text = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    block = text.split("<!-- families:", 1)[1].split("<!-- /families -->", 1)[0]
    rows = [line for line in block.splitlines() if line.startswith("| ") and not line.startswith("| Family")]
    assert len(rows) == len(FAMILIES)
    for family, row in zip(FAMILIES, rows):
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert cells[0] == family.title
        assert cells[1] == ", ".join(f"`{c}`" for c in family.layouts)
        expected = family.file_kinds or (f"from its files alone: {family.files_alone_kinds}"
                                         if family.files_alone_kinds else "-")
        assert cells[2] == expected


def test_prediction_type_with_a_folder_says_what_it_is_for(tmp_path):
    """detect's refusal of prediction_type= for a folder is its owners' words (Family.keywords), not a title of its
    own."""
    owners = [f for f in FAMILIES if "prediction_type" in f.keywords]
    assert owners
    with pytest.raises(MlxdiffError) as e:
        detect(str(tmp_path), LoadRequest(prediction_type="epsilon"))
    message = str(e.value)
    assert "\n" not in message and message.startswith("prediction_type=: ") and str(tmp_path) in message
    assert all(f.keywords["prediction_type"] in message for f in owners), message
