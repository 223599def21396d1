"""A streamed run whose weights file changes under it (issue 45): seeded cases through the command line.

    python bench/fuzz_streamed.py --n 200 --seed 1

Case i of a seed is a function of (seed, i) alone. Each copies the embedded default model, runs `python -m
mlxdiff.generate` on it with `--memory-limit 0.012` (8 of its 9 transformer blocks read from the file at every
forward: READS reads in a 1-step run) in a child of tests/adversarial.py's fork server (a memory cap and an alarm),
and changes the transformer's file just before read AT (1 to READS, at random) by one of KINDS: truncated to a
random length, extended, bytes of its data rewritten in place, a header byte rewritten with the modification time
put back, replaced by a rename (a changed copy, or an identical one: another file all the same), deleted, or its
permissions taken away (the run then going on as user `nobody` when it runs as root, whom permissions do not
stop).
Acceptable is one outcome only: exit 2, one stderr line "mlxdiff: error: <the file>: <what changed> ...", and no
output file. Anything else (exit 0 with an image drawn from a changed file, a traceback, a hang, a crash, a
partial image) is unacceptable. The suite runs a seeded share (tests/test_bad_input_round3_features.py).
"""

import argparse
import json
import os
import random
import shutil
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from adversarial import run_cases  # noqa: E402
from mlxdiff import default_model  # noqa: E402

READS = 8
WEIGHTS = Path("transformer") / "diffusion_pytorch_model.safetensors"
# kind -> what the one line must say
KINDS = {"truncated": "was truncated from", "extended": "was extended from",
         "rewritten": "was rewritten in place (its modification time changed)",
         "header rewritten": "was rewritten in place (its header changed)",
         "replaced": "was replaced by another file", "replaced by a copy": "was replaced by another file",
         "deleted": "is gone", "permissions": "can no longer be read"}
NOBODY = 65534

# the case's code (exec'd in the fork server's child: mlxdiff.generate already imported); os._exit with main's code
CASE = r'''
import os, shutil, sys
from pathlib import Path
from mlxdiff import generate
from mlxdiff.loading import streaming
KIND, AT, SEED, WEIGHTS, ARGV, NOBODY = {kind!r}, {at!r}, {seed!r}, Path({weights!r}), {argv!r}, {nobody!r}
load, reads = streaming.BlockStream.load, []

def change():
    import random
    rng = random.Random(SEED)
    size = WEIGHTS.stat().st_size
    if KIND == "truncated":
        os.truncate(WEIGHTS, rng.randrange(size))
    elif KIND == "extended":
        with open(WEIGHTS, "ab") as f:
            f.write(bytes(rng.randrange(1, 100000)))
    elif KIND == "rewritten":
        with open(WEIGHTS, "r+b") as f:
            f.seek(rng.randrange(size // 2, size - 64))
            f.write(bytes(rng.randrange(256) for _ in range(64)))
    elif KIND == "header rewritten":
        st = WEIGHTS.stat()
        with open(WEIGHTS, "r+b") as f:
            f.seek(8 + rng.randrange(200))
            byte = f.read(1)
            f.seek(-1, 1)
            f.write(bytes([byte[0] ^ (1 << rng.randrange(8))]))
        os.utime(WEIGHTS, ns=(st.st_atime_ns, st.st_mtime_ns))
    elif KIND.startswith("replaced"):
        new = WEIGHTS.with_suffix(".new")
        shutil.copyfile(WEIGHTS, new)
        if KIND == "replaced":
            with open(new, "r+b") as f:
                f.seek(-4096, 2)
                f.write(bytes(4096))
        os.replace(new, WEIGHTS)
    elif KIND == "deleted":
        WEIGHTS.unlink()
    else:
        os.chmod(WEIGHTS, 0)
        if os.geteuid() == 0:   # root reads whatever the permissions say: the run goes on as `nobody` (here, with
            os.setgroups([])    # everything imported: the interpreter's own files may be root's alone)
            os.setgid(NOBODY)
            os.setuid(NOBODY)
    print(f"changed: {{KIND}} before read {{AT}}", flush=True)

def wrapped(self, group, block):
    reads.append(group.key)
    if len(reads) == AT:
        change()
    return load(self, group, block)
streaming.BlockStream.load = wrapped
rc = generate.main(ARGV)
sys.stdout.flush(); sys.stderr.flush()
os._exit(rc if isinstance(rc, int) else 1)
'''


def make_case(seed, i, root: Path) -> dict:
    """Case i: a fresh copy of the default model under `root` (readable by `nobody`), the change, the CLI run."""
    rng = random.Random(f"streamed-{seed}-{i}")
    kind = rng.choice(sorted(KINDS))
    at = rng.randint(1, READS)
    folder = root / f"case-{i}"
    shutil.copytree(default_model.FOLDER, folder / "model")
    out = folder / "out" / "image.png"
    out.parent.mkdir()
    for path in [folder, *folder.rglob("*")]:    # `nobody` reads the model and writes the output folder
        os.chmod(path, 0o777 if path.is_dir() else 0o644)
    argv = ["--model", str(folder / "model"), "--steps", "1", "--width", "32", "--height", "32", "--no-progress",
            "--memory-limit", "0.012", "--prompt", "a fox", "--seed", str(rng.randrange(100)), "--output", str(out)]
    code = CASE.format(kind=kind, at=at, seed=f"{seed}-{i}", weights=str(folder / "model" / WEIGHTS), argv=argv,
                       nobody=NOBODY)
    return {"api": code, "timeout": 120, "kind": kind, "at": at, "out": str(out),
            "weights": str(folder / "model" / WEIGHTS)}


def judge(case, outcome) -> str | None:
    """None when the run ended as it must (exit 2, one line naming the file and the change, no output), else why
    not."""
    lines = [line for line in outcome.stderr.splitlines() if line.strip()]
    if f"changed: {case['kind']}" not in outcome.stdout:
        return f"the change was not made (rc {outcome.rc}; {READS} reads expected)"
    if Path(case["out"]).exists():
        return f"an output file was written (rc {outcome.rc})"
    if outcome.rc != 2 or outcome.signal is not None or len(lines) != 1 or "Traceback" in outcome.stderr:
        return f"rc {outcome.rc}, signal {outcome.signal}: {outcome.stderr.strip()[-600:]}"
    line = lines[0]
    if not line.startswith(f"mlxdiff: error: {case['weights']}: ") or KINDS[case["kind"]] not in line:
        return f"the line does not name the file and what changed: {line[:300]}"
    return None


def fuzz(n, seed, workdir) -> dict:
    workdir = Path(workdir)
    os.chmod(workdir, 0o777)
    cases = [make_case(seed, i, workdir) for i in range(n)]
    started = time.perf_counter()
    outcomes = run_cases(cases, workdir)
    counts, failures = Counter(), []
    for i, (case, outcome) in enumerate(zip(cases, outcomes)):
        why = judge(case, outcome)
        counts[(case["kind"], why is None)] += 1
        if why is not None:
            failures.append({"i": i, "kind": case["kind"], "at": case["at"], "why": why})
    return {"n": n, "seed": seed, "wall_s": time.perf_counter() - started, "unacceptable": len(failures),
            "counts": {f"{kind} ({'refused' if ok else 'UNACCEPTABLE'})": c
                       for (kind, ok), c in sorted(counts.items())},
            "failures": failures}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=200)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--json", help="also write the result as JSON here")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="mlxdiff-streamed-") as work:
        result = fuzz(args.n, args.seed, work)
    print(f"streamed runs: {result['n']} cases, seed {result['seed']}, {result['wall_s']:.0f} s")
    for what, c in result["counts"].items():
        print(f"  {what}: {c}")
    for f in result["failures"][:20]:
        print(f"  #{f['i']} {f['kind']} before read {f['at']}: {f['why']}")
    print(f"unacceptable: {result['unacceptable']}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 1 if result["unacceptable"] else 0


if __name__ == "__main__":
    sys.exit(main())
