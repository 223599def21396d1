"""bench/mutation_check.py's planted breakages still apply to the current source: each old text occurs exactly once
in its file and differs from the new one, and the test files meant to catch it exist. (The mutated suites themselves
run only from the bench tool, never here: minutes per mutant.)"""

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("mutation_check", ROOT / "bench" / "mutation_check.py")
mutation_check = importlib.util.module_from_spec(spec)
sys.modules.setdefault("mutation_check", mutation_check)     # dataclasses look their module up there
spec.loader.exec_module(mutation_check)


@pytest.mark.parametrize("mutation", mutation_check.MUTATIONS, ids=lambda m: m.id)
def test_mutation_applies_to_the_source(mutation):
    assert mutation_check.check_applies(mutation) is None, mutation_check.check_applies(mutation)
    assert mutation.tests and all(t.startswith("tests/test_") for t in mutation.tests)
    mutated = (ROOT / mutation.file).read_text().replace(mutation.old, mutation.new)
    compile(mutated, mutation.file, "exec")      # still Python: a mutant that fails to import proves nothing


def test_ids_are_unique_and_edits_one_line():
    ids = [m.id for m in mutation_check.MUTATIONS]
    assert len(ids) == len(set(ids))
    assert all("\n" not in m.old and "\n" not in m.new for m in mutation_check.MUTATIONS)


def test_copy_imports_its_own_mlxdiff(tmp_path):
    """The copy a mutant runs in imports the copy's mlxdiff, not the editable install of this tree."""
    files = [f for f in mutation_check.tree_files(ROOT) if f.startswith("mlxdiff/")]
    copy = mutation_check.copy_tree(ROOT, files, tmp_path)
    assert Path(mutation_check.imported_from(copy)).resolve() == (copy / "mlxdiff" / "__init__.py").resolve()
