"""Issue 38's promise, "someone new adds a family by adding a folder": a copy of the mlxdiff package with only new
files added (a model file, models/toy.py, and a family folder, pipelines/toy/) finds the new architecture by the
registry (models/registry.py: loading/spec.ARCHITECTURES, lora's LORA_DENOISERS and its layer-name rows) and the new
family by pipelines.FAMILIES, each in the place its own LORA_ORDER / Family.order gives, and load() / identify read
the family's folder and file; every file of the package is left as it is. The copy runs in a fresh interpreter, so
nothing of this process's registry is reused."""

import filecmp
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

import mlxdiff
from mlxdiff import lora
from mlxdiff.loading.spec import ARCHITECTURES
from mlxdiff.pipelines import FAMILIES

PACKAGE = Path(mlxdiff.__file__).parent

# the new family's files, and nothing else: an architecture (the protocol's Architecture and LoRADenoiser) ...
TOY_MODEL = '''
"""A toy denoiser: one Linear."""
import re
from dataclasses import dataclass

import mlx.nn as nn

from ..config_checks import CheckedArgs, between

CLASS_NAMES = ("ToyTransformer2DModel",)


@dataclass
class ModelArgs(CheckedArgs):
    dim: int = 4

    WHAT = "Toy config"
    LIMITS = {"dim": between(1, 64)}


class Model(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.args = args
        self.proj = nn.Linear(args.dim, args.dim)

    def __call__(self, x):
        return self.proj(x)

    def sanitize(self, weights):
        return weights


LORA_NAME = "Toy transformer"
LORA_ARCHITECTURE = "Toy"
LORA_ORDER = 55        # between FLUX.2's (50) and SD3's (60)
LORA_ARCHITECTURE_PATTERNS = ((re.compile(r"(^|[._])toy_proj([._]|$)"), (LORA_ARCHITECTURE,)),)


def lora_original_rules(args):
    return []
'''
# ... its pipeline on the template ...
TOY_PIPELINE = '''
from ..base import Pipeline


class ToyPipeline(Pipeline):
    family = "toy"
'''
# ... and its record, with a folder reader and a single-file reader
TOY_FAMILY = '''
from ...loading.sources import folder_component
from ...loading.spec import ComponentSpec, PipelineSources
from ...models import toy
from ..family import Family
from .pipeline import ToyPipeline


def read_folder(path, index, pipeline_class, components, request):
    specs = {"transformer": folder_component(path, "transformer", components["transformer"])}
    return PipelineSources("toy", pipeline_class, specs, {}, {})


def read_file(path, request):
    spec = ComponentSpec("transformer", toy, {"dim": 4}, [path], prefix="toy_")
    return PipelineSources("toy", "ToyPipeline", {"transformer": spec}, {}, {})


FAMILY = Family(
    name="toy", title="Toy", article="a", pipeline=ToyPipeline,
    layouts={"ToyPipeline": {"transformer": toy.CLASS_NAMES}},
    read_folder=read_folder,
    keywords={"transformer": "a file replacing the denoiser"},
    reference="mlxdiff.reference.toy",
    order=45,          # between Krea 2's (40) and FLUX.2's (50)
    claims_file=lambda names: any(n.startswith("toy_proj.") for n in names),
    read_file=read_file,
    file_kinds="Toy files (toy_proj.*)",
)
'''
NEW_FILES = {"models/toy.py": TOY_MODEL, "pipelines/toy/pipeline.py": TOY_PIPELINE,
             "pipelines/toy/__init__.py": TOY_FAMILY}

# run in the copy: what the registries found and what load() / identify made of the family's folder and file
CHECK = '''
import json, sys
from pathlib import Path
import numpy as np
import mlxdiff
from mlxdiff import lora
from mlxdiff.errors import MlxdiffError
from mlxdiff.loading.spec import ARCHITECTURES
from mlxdiff.models import registry
from mlxdiff.pipelines import FAMILIES, family_of_file
from mlxdiff.pipelines.family import identify
from mlxdiff.formats import tensor_shapes

folder, single, other = (Path(p) for p in sys.argv[1:4])
found = {"package": mlxdiff.__file__, "architectures": {k: v.__name__ for k, v in ARCHITECTURES.items()},
         "registry_is_spec": registry.ARCHITECTURES is ARCHITECTURES,
         "lora_denoisers": [m.__name__ for m in lora.LORA_DENOISERS],
         "lora_labels": [list(labels) for _, labels in lora.ARCHITECTURES],
         "families": [f.name for f in FAMILIES]}
pipe = mlxdiff.load(str(folder))
spec = pipe.components["transformer"]
found["folder"] = [type(pipe).__name__, pipe.family, spec.arch.__name__,
                   np.array(spec.build().proj.weight).tolist()]
found["file"] = [family_of_file(single).name, type(mlxdiff.load(str(single))).__name__,
                 identify(list(tensor_shapes(single)))]
try:
    mlxdiff.load(str(other))
except MlxdiffError as e:
    found["unclaimed"] = str(e)
print(json.dumps(found))
'''


def _copy_with_the_family(tmp_path) -> Path:
    root = tmp_path / "copy"
    shutil.copytree(PACKAGE, root / "mlxdiff", ignore=shutil.ignore_patterns("__pycache__"))
    for name, source in NEW_FILES.items():
        path = root / "mlxdiff" / name
        assert not path.exists(), name       # new files only
        path.parent.mkdir(exist_ok=True)
        path.write_text(textwrap.dedent(source).lstrip())
    return root


def _unchanged(original: Path, copy: Path) -> list:
    """The package's files that differ in (or are missing from) the copy, walking every folder."""
    comparison = filecmp.dircmp(original, copy, ignore=["__pycache__"])
    bad = [str(original / n) for n in comparison.left_only + comparison.diff_files + comparison.funny_files]
    _, mismatch, errors = filecmp.cmpfiles(original, copy, comparison.common_files, shallow=False)
    bad += [str(original / n) for n in mismatch + errors]
    for name in comparison.common_dirs:
        bad += _unchanged(original / name, copy / name)
    return bad


def _new_files(original: Path, copy: Path) -> set:
    return {p.relative_to(copy).as_posix() for p in copy.rglob("*") if p.is_file() and "__pycache__" not in p.parts
            and not (original / p.relative_to(copy)).exists()}


def test_a_new_family_is_its_folder(tmp_path):
    root = _copy_with_the_family(tmp_path)
    assert _unchanged(PACKAGE, root / "mlxdiff") == []
    assert _new_files(PACKAGE, root / "mlxdiff") == set(NEW_FILES)

    weight = np.arange(16, dtype=np.float32).reshape(4, 4) / 16
    folder = tmp_path / "toy-model"
    (folder / "transformer").mkdir(parents=True)
    (folder / "model_index.json").write_text(json.dumps(
        {"_class_name": "ToyPipeline", "transformer": ["diffusers", "ToyTransformer2DModel"]}))
    (folder / "transformer" / "config.json").write_text(json.dumps({"dim": 4}))
    save_file({"proj.weight": weight, "proj.bias": np.zeros(4, np.float32)},
              str(folder / "transformer" / "diffusion_pytorch_model.safetensors"))
    single = tmp_path / "toy.safetensors"
    save_file({"toy_proj.weight": weight, "toy_proj.bias": np.zeros(4, np.float32)}, str(single))
    other = tmp_path / "other.safetensors"
    save_file({"encoder.layer.0.weight": np.zeros((2, 2), np.float32)}, str(other))

    run = subprocess.run([sys.executable, "-c", CHECK, str(folder), str(single), str(other)], cwd=tmp_path,
                         capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": str(root)})
    assert run.returncode == 0, run.stderr[-3000:]
    found = json.loads(run.stdout.strip().splitlines()[-1])
    assert Path(found["package"]).parent == root / "mlxdiff"

    # the architecture: registered under its class name, beside every one this package has
    assert found["architectures"] == {**{k: v.__name__ for k, v in ARCHITECTURES.items()},
                                      "ToyTransformer2DModel": "mlxdiff.models.toy"}
    assert found["registry_is_spec"]
    # its LoRA rows in the place LORA_ORDER 55 gives: right after FLUX.2's, the others' order as this package's
    denoisers = [m.__name__ for m in lora.LORA_DENOISERS]
    at = denoisers.index("mlxdiff.models.flux2") + 1
    assert found["lora_denoisers"] == denoisers[:at] + ["mlxdiff.models.toy"] + denoisers[at:]
    labels = [list(labels) for _, labels in lora.ARCHITECTURES]
    after = max(i for i, row in enumerate(labels) if row[0] == "FLUX.2") + 1
    assert found["lora_labels"] == labels[:after] + [["Toy"]] + labels[after:]
    # the family: in the place order 45 gives, before FLUX.2's
    families = [f.name for f in FAMILIES]
    at = families.index("flux2")
    assert found["families"] == families[:at] + ["toy"] + families[at:]

    # load() reads its folder through its record and the registry's architecture (the weights are the folder's) ...
    assert found["folder"] == ["ToyPipeline", "toy", "mlxdiff.models.toy", weight.tolist()]
    # ... and its single file, which identify names for the other families' readers
    assert found["file"] == ["toy", "ToyPipeline", "a Toy single file; give it as the model"]
    # an unclaimed file's refusal lists what the new family reads too
    assert "Toy files (toy_proj.*)" in found["unclaimed"] and "\n" not in found["unclaimed"]
