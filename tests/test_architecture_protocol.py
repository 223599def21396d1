"""Every registered architecture module provides what mlxdiff/models/protocol.py lists: the required members, each
capability whole where it has one, the hooks with the parameters the loaders call them with, and the capabilities
the readers rely on for the modules they use them with."""

import importlib
import inspect
import pkgutil
import re
import types
from pathlib import Path

import pytest

import mlxdiff  # noqa: F401  (OpenBLAS preload before mlx)
import mlx.nn as nn

from mlxdiff import lora
from mlxdiff.config_checks import CheckedArgs
from mlxdiff.pipelines import FAMILIES
from mlxdiff.pipelines.family import family_named
from mlxdiff.loading.spec import ARCHITECTURES
from mlxdiff.models import clip, t5, text_llm
from mlxdiff.models import protocol as P, registry

MODULES = sorted(set(ARCHITECTURES.values()), key=lambda m: m.__name__)
IDS = [m.__name__.rsplit(".", 1)[-1] for m in MODULES]


def _accepts(fn, method, needs_self) -> bool:
    """Whether `fn` takes the arguments the loaders pass to the protocol's `method` (its parameters after `self` /
    `cls` that have no default), plus an instance first where `needs_self` (a method looked up on its class)."""
    params = list(inspect.signature(method).parameters.values())[0 if inspect.ismethod(method) else 1:]
    args = [object()] * (needs_self + sum(p.default is inspect.Parameter.empty for p in params))
    try:
        inspect.signature(fn).bind(*args)
    except TypeError:
        return False
    return True


def test_registry_is_not_empty_and_the_check_is_not_vacuous():
    assert len(MODULES) >= 7
    assert not isinstance(types.ModuleType("empty"), P.Architecture)
    assert P.protocol_members(P.Architecture) == ("CLASS_NAMES", "Model", "ModelArgs")
    assert P.protocol_members(P.ArchitectureModel) == ("sanitize",)


@pytest.mark.parametrize("arch", MODULES, ids=IDS)
def test_required_members(arch):
    assert isinstance(arch, P.Architecture), arch.__name__
    assert inspect.isclass(arch.ModelArgs) and issubclass(arch.ModelArgs, CheckedArgs)
    assert issubclass(arch.ModelArgs, P.ArchitectureArgs)
    assert inspect.isclass(arch.Model) and issubclass(arch.Model, nn.Module)
    assert issubclass(arch.Model, P.ArchitectureModel)
    assert _accepts(arch.Model.sanitize, P.ArchitectureModel.sanitize, needs_self=True)
    assert _accepts(arch.ModelArgs.from_dict, P.ArchitectureArgs.from_dict, needs_self=False)
    inspect.signature(arch.Model).bind(object())        # Model(args), as loading/build.build makes it
    for hook in P.MODEL_HOOKS:      # optional; where present, callable as the loaders call it
        for name in P.protocol_members(hook):
            if hasattr(arch.Model, name):
                assert _accepts(getattr(arch.Model, name), getattr(hook, name), needs_self=True), \
                    (arch.__name__, name)


@pytest.mark.parametrize("arch", MODULES, ids=IDS)
def test_capabilities_are_whole(arch):
    for capability, marker in P.CAPABILITIES.items():
        members = P.protocol_members(capability)
        assert marker in members
        if not hasattr(arch, marker):
            continue
        missing = [n for n in members if not hasattr(arch, n)]
        assert not missing, f"{arch.__name__} has {marker} but lacks {missing} of {capability.__name__}"
        assert isinstance(arch, capability)
        for name in members:
            method = getattr(capability, name, None)
            if callable(method):
                assert _accepts(getattr(arch, name), method, needs_self=False), (arch.__name__, name)


def test_the_readers_capabilities():
    """The modules the readers use with a capability have it: every family's denoiser is read from one original
    file and takes LoRAs (LoRADenoiser); the SD3.5 single-file encoders read their config off shapes; the FLUX.2 LLM
    encoder is read partly."""
    for family in FAMILIES:
        for layout in family.layouts.values():
            for class_name in layout[family.pipeline.DENOISER]:
                arch = ARCHITECTURES[class_name]
                assert isinstance(arch, P.OriginalFile) and isinstance(arch, P.LoRADenoiser), (family.name,
                                                                                                 arch.__name__)
                assert arch.LORA_ARCHITECTURE in {label for _, labels in lora.ARCHITECTURES for label in labels}
                assert isinstance(arch.ORIGINAL_PREFIX, str) and arch.ORIGINAL_PREFIX.endswith(".")
                assert isinstance(arch.FROM_BASE_CONFIG, tuple)
                assert all(len(rule) == 3 for rule in arch._ORIGINAL_RULES) and arch._ORIGINAL_RULES
    for arch in (clip, t5):
        assert isinstance(arch, P.ConfigFromWeights)
    for class_name in family_named("flux2").layouts["Flux2Pipeline"]["text_encoder"]:
        assert ARCHITECTURES[class_name] is text_llm
    assert isinstance(text_llm, P.PartialReader) and isinstance(text_llm.STORED_PREFIX, str)
    # the modules without a capability are read as a whole (ComponentSpec.nbytes counts every tensor)
    assert [m.__name__ for m in MODULES if isinstance(m, P.PartialReader)] == ["mlxdiff.models.text_llm"]


def test_the_registry_is_every_architecture_module():
    """models/registry finds the architectures by convention: every module of mlxdiff.models that declares
    CLASS_NAMES is registered (none dropped for lacking the rest: test_required_members holds them to it), under
    exactly those names, each name one module's; the others (shared layers, helpers) declare none."""
    package = Path(registry.__file__).parent
    modules = {importlib.import_module(f"mlxdiff.models.{info.name}") for info in pkgutil.iter_modules([str(package)])}
    declaring = {m for m in modules if hasattr(m, "CLASS_NAMES")}
    assert declaring == set(MODULES) == set(registry.MODULES)
    names = [n for m in MODULES for n in m.CLASS_NAMES]
    assert len(names) == len(set(names)) == len(ARCHITECTURES)
    assert all(ARCHITECTURES[n] is m for m in MODULES for n in m.CLASS_NAMES)
    assert all(isinstance(m.CLASS_NAMES, tuple) and m.CLASS_NAMES for m in MODULES)


def test_lora_denoisers_are_the_registered_ones():
    """lora/names.LORA_DENOISERS (the order their layer-name rows are tried in) is every registered module that takes
    LoRAs, once, in rising LORA_ORDER (each module its own); lora.ARCHITECTURES is their rows, each labelled with its
    module's architecture first."""
    takers = [m for m in MODULES if isinstance(m, P.LoRADenoiser)]
    assert len(takers) >= 9 and sorted(lora.LORA_DENOISERS, key=lambda m: m.__name__) == takers
    orders = [m.LORA_ORDER for m in lora.LORA_DENOISERS]
    assert all(isinstance(n, int) for n in orders) and orders == sorted(set(orders))
    for arch in lora.LORA_DENOISERS:
        rows = arch.LORA_ARCHITECTURE_PATTERNS
        assert isinstance(rows, tuple) and all(isinstance(p, re.Pattern) and labels[0] == arch.LORA_ARCHITECTURE
                                                for p, labels in rows), arch.__name__
    assert lora.ARCHITECTURES == tuple(row for arch in lora.LORA_DENOISERS for row in arch.LORA_ARCHITECTURE_PATTERNS)


def test_a_half_written_architecture_is_named_at_import(monkeypatch):
    """A module of mlxdiff.models that declares CLASS_NAMES without ModelArgs or Model is refused when the registry
    is built, naming the module and what it lacks, rather than left out of ARCHITECTURES unseen."""
    half = types.ModuleType("mlxdiff.models.half_written")
    half.CLASS_NAMES = ("HalfWrittenModel",)
    half.ModelArgs = object
    real_import = importlib.import_module
    monkeypatch.setattr(registry.pkgutil, "iter_modules",
                        lambda paths: [types.SimpleNamespace(name="half_written")])
    monkeypatch.setattr(registry.importlib, "import_module",
                        lambda name: half if name == "mlxdiff.models.half_written" else real_import(name))
    with pytest.raises(ImportError, match=r"^mlxdiff\.models\.half_written declares CLASS_NAMES but has no Model: "):
        registry.architecture_modules()
    del half.CLASS_NAMES                      # without CLASS_NAMES it is a helper module: left out, no error
    assert registry.architecture_modules() == ()
