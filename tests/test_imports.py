"""Issue 38 item 5: an import inside a function only breaks a real cycle or defers a heavy or optional dependency,
and says which on its line; the CLI's front door stays free of torch, transformers and diffusers. Issue 47 item 7: no
test module imports another (shared pieces live in the tests' helper modules)."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "mlxdiff"


def in_function_imports(path: Path) -> list:
    """(line number, source lines) of each Import / ImportFrom inside a function of the file."""
    text = path.read_text(encoding="utf-8")
    lines = text.splitlines()
    found = {}
    for function in ast.walk(ast.parse(text, str(path))):
        if isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for node in ast.walk(function):
                if isinstance(node, (ast.Import, ast.ImportFrom)):
                    found[node.lineno] = lines[node.lineno - 1:node.end_lineno]
    return sorted(found.items())


def unexplained(path: Path) -> list:
    """The in-function imports of `path` with no `#` comment on any of their lines."""
    return [f"{path.relative_to(PACKAGE.parent)}:{number}: {source[0].strip()}"
            for number, source in in_function_imports(path) if not any("#" in line for line in source)]


FILES = sorted(p.relative_to(PACKAGE).as_posix() for p in PACKAGE.rglob("*.py"))


def test_the_walk_finds_in_function_imports():
    # the checker itself: a function's import is found, a module-level one is not
    sample = PACKAGE / "__init__.py"
    assert any("pipelines" in source[0] for _, source in in_function_imports(sample))
    assert all(source[0].startswith((" ", "\t")) for _, source in in_function_imports(sample))


@pytest.mark.parametrize("name", FILES)
def test_in_function_imports_say_why(name):
    assert unexplained(PACKAGE / name) == []


def test_cli_front_door_imports_no_heavy_dependency():
    code = ("import sys, mlxdiff.generate; "
            "print(sorted(m for m in ('torch', 'transformers', 'diffusers', 'numpy', 'PIL') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=PACKAGE.parent).stdout
    assert out.strip() == "[]"


# -- no test module imports another (issue 47) -------------------------------------------------------------------

TESTS = Path(__file__).resolve().parent
BENCH = TESTS.parent / "bench"


def _is_test_module(name: str) -> bool:
    """test_x or tests.test_x (the same file under its package name), or conftest: pytest loads tests/conftest.py as
    tests.conftest, so `from conftest import ...` runs the file a second time as another module."""
    parts = name.split(".")
    if parts[0] == "tests":
        parts = parts[1:]
    return bool(parts) and (parts[0].startswith("test_") or parts[0] == "conftest")


def _imports_by_name(func) -> bool:
    """importlib.import_module(...), import_module(...) or __import__(...)."""
    name = getattr(func, "attr", None) or getattr(func, "id", None)
    return name in ("import_module", "__import__")


def imports_of_test_modules(text: str) -> list:
    """(line number, module) of each import of a test module or conftest (`import test_x`, `from test_x import ...`,
    `from tests import test_x`, `from . import test_x`, or importlib.import_module / __import__ of a literal
    "test_x") anywhere in the source."""
    found = []
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if _is_test_module(a.name)]
        elif isinstance(node, ast.ImportFrom):
            if node.module and _is_test_module(node.module):
                found.append((node.lineno, node.module))
            elif node.module in (None, "tests"):      # the module is one of the names
                found += [(node.lineno, a.name) for a in node.names if _is_test_module(a.name)]
        elif isinstance(node, ast.Call) and _imports_by_name(node.func) and node.args:
            name = node.args[0].value if isinstance(node.args[0], ast.Constant) else None
            if isinstance(name, str) and _is_test_module(name):
                found.append((node.lineno, name))
    return found


def test_the_walk_finds_imports_of_test_modules():
    sample = ("import os\nimport test_a\nfrom test_b import x\nfrom helpers import y\n"
              "def f():\n    from test_c import z  # late\n    importlib.import_module('test_d')\n"
              "from conftest import ASSETS\nimport tests.test_e\nfrom tests import test_f, helpers\n"
              "from . import test_g\nfrom .test_h import w\nfrom tests.twins import v\nimport tests\n")
    assert [m for _, m in sorted(imports_of_test_modules(sample))] == [
        "test_a", "test_b", "test_c", "test_d", "conftest", "tests.test_e", "test_f", "test_g", "test_h"]


@pytest.mark.parametrize("name", sorted(p.name for p in TESTS.glob("*.py")))
def test_no_test_module_imports_another(name):
    """A test or helper module takes shared pieces from the helper modules (helpers.py, twins.py, parity.py,
    ldm_helpers.py, gguf_helpers.py, lora_helpers.py, flux1_helpers.py, sd3_helpers.py, ...), never from another
    test module or conftest.py: that import runs the other module's definitions and heavy imports, and couples files
    that pytest-xdist's loadfile runs on different workers. No file is exempt."""
    found = imports_of_test_modules((TESTS / name).read_text(encoding="utf-8"))
    assert found == [], f"{name} imports test modules: {found}; move the shared pieces into a helper module"


def test_no_bench_script_imports_a_test_module():
    """bench/ scripts that put tests/ on sys.path take its helper modules, not a test module's internals (a renamed
    function there broke bench/gguf_cpu.py unseen)."""
    found = {p.name: imports_of_test_modules(p.read_text(encoding="utf-8")) for p in sorted(BENCH.glob("*.py"))}
    assert {name: f for name, f in found.items() if f} == {}
