"""Issue 38 item 5: an import inside a function only breaks a real cycle or defers a heavy or optional dependency,
and says which on its line; the CLI's front door stays free of torch, transformers and diffusers."""

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
