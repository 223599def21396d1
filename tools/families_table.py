"""Write README's Families table from mlxdiff.pipelines.FAMILIES (tests/test_families.py checks it):
    python tools/families_table.py        (rewrites the block between the families markers in README.md)"""

from pathlib import Path

from mlxdiff.pipelines import FAMILIES

README = Path(__file__).resolve().parents[1] / "README.md"
START, END = "<!-- families:", "<!-- /families -->"


def table() -> str:
    rows = ["| Family | diffusers pipeline folders (model_index.json `_class_name`) | original files it reads as the model |",
            "|---|---|---|"]
    for family in FAMILIES:
        files = family.file_kinds or (f"from its files alone: {family.files_alone_kinds}"
                                      if family.files_alone_kinds else "-")
        rows.append(f"| {family.title} | {', '.join(f'`{c}`' for c in family.layouts)} | {files} |")
    return "\n".join(rows)


def main():
    text = README.read_text()
    head, rest = text.split(START, 1)
    marker, _ = rest.split("\n", 1)
    _, tail = rest.split(END, 1)
    README.write_text(f"{head}{START}{marker}\n{table()}\n{END}{tail}")


if __name__ == "__main__":
    main()
