"""Does the suite catch a broken pipeline? (issue 47, item 6)

Each MUTATION below is a deliberate one-line breakage of mlxdiff's source that a user would see as a wrong image
(CFG's two predictions swapped, the negative prompt ignored, a sampler step changed, a LoRA scale squared, ...),
with the test files whose claims cover it. For each, this tool copies the working tree (git's tracked files plus
the untracked ones it does not ignore: no .venv, no .git, no weights) to a temp dir, applies the edit there and runs

    python -m pytest -o addopts= -ra --tb=line -q -x -n 0 -p no:cacheprovider <tests>

in the copy, with PYTHONPATH at the copy (the copy's mlxdiff is checked to be the one imported). A mutation the
tests fail on is caught (the first failing test is named); one they pass is MISSED. Each distinct test set is first
run once unmutated: it must pass, else the check of its mutations is void (reported, and the exit status is 1).

    python bench/mutation_check.py                 # every mutation, one at a time; a markdown table on stdout
    python bench/mutation_check.py --list          # the mutations and their tests
    python bench/mutation_check.py --only sd-cfg-swap --only sd3-cfg-swap -j 2

Exit status 0 only when every mutation was caught (and every baseline passed). It runs the named test files whole,
so it takes minutes per mutant on a 2-core machine: it is a bench tool, not part of the suite (tests/
test_mutation_check.py only checks that each edit still applies to the current source).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Mutation:
    id: str
    file: str          # relative to the repository root
    old: str           # must occur exactly once in the file
    new: str
    tests: tuple       # test files expected to catch it, run in this order (-x: the first failure ends the run)
    what: str


SD_TESTS = ("tests/test_sd_pipeline.py",)
MUTATIONS = (
    # classifier-free guidance with its two predictions swapped: uncond + g (cond - uncond) -> cond + g (uncond - cond)
    Mutation("sd-cfg-swap", "mlxdiff/pipelines/stable_diffusion/pipeline.py",
             "return uncond + run.guidance * (cond - uncond)",
             "return cond + run.guidance * (uncond - cond)",
             SD_TESTS, "SD / SDXL CFG: cond and uncond swapped"),
    Mutation("sd3-cfg-swap", "mlxdiff/pipelines/sd3/pipeline.py",
             "v = v_uncond + run.guidance * (v_cond - v_uncond)",
             "v = v_cond + run.guidance * (v_uncond - v_cond)",
             ("tests/test_sd3_pipeline.py",), "SD3 CFG: cond and uncond swapped"),
    Mutation("flux1-true-cfg-swap", "mlxdiff/pipelines/flux1/pipeline.py",
             'return v_neg + run.options["true_cfg_scale"] * (v - v_neg)',
             'return v + run.options["true_cfg_scale"] * (v_neg - v)',
             ("tests/test_flux1_pipeline.py",), "FLUX.1 true CFG: cond and negative swapped"),
    Mutation("chroma-cfg-swap", "mlxdiff/pipelines/chroma/pipeline.py",
             "return v_neg + run.guidance * (v - v_neg)",
             "return v + run.guidance * (v_neg - v)",
             ("tests/test_chroma_pipeline.py",), "Chroma CFG: cond and negative swapped"),
    Mutation("zimage-cfg-swap", "mlxdiff/pipelines/zimage/pipeline.py",
             "return -(pos + run.guidance * (pos - neg))",
             "return -(neg + run.guidance * (neg - pos))",
             ("tests/test_zimage_pipeline.py",), "Z-Image CFG: cond and negative swapped"),
    Mutation("qwenimage-cfg-swap", "mlxdiff/pipelines/qwenimage/pipeline.py",
             'comb = neg + run.state["true_cfg_scale"] * (pos - neg)',
             'comb = pos + run.state["true_cfg_scale"] * (neg - pos)',
             ("tests/test_qwenimage_pipeline.py",), "Qwen-Image true CFG: cond and negative swapped"),
    # the negative prompt dropped: "" encoded in its place
    Mutation("sd-negative-ignored", "mlxdiff/pipelines/stable_diffusion/pipeline.py",
             "ne, negative_pooled = self._encode_with(index, negatives, None, truncated)",
             'ne, negative_pooled = self._encode_with(index, [""] * batch, None, truncated)',
             SD_TESTS, "SD / SDXL: the negative prompt ignored (\"\" encoded)"),
    Mutation("sd3-negative-ignored", "mlxdiff/pipelines/sd3/pipeline.py",
             'neg = as_list(negative_prompt or "", None)',
             'neg = as_list("", None)',
             ("tests/test_sd3_pipeline.py",), "SD3: the negative prompt ignored (\"\" encoded)"),
    # sampler steps
    Mutation("dpmpp-2m-first-order", "mlxdiff/ldm_schedulers.py",
             "return x_next - 0.5 * (alpha_t * (np.exp(-h) - 1.0)) * (1.0 / r) * (x0 - previous)",
             "return x_next",
             SD_TESTS + ("tests/test_ldm_schedulers.py",), "DPM++ 2M: the second-order term dropped"),
    Mutation("euler-a-noise-scale", "mlxdiff/ldm_schedulers.py",
             "return x + noise.astype(mx.float32) * sigma_up",
             "return x + noise.astype(mx.float32) * sigma_next",
             SD_TESTS + ("tests/test_ldm_schedulers.py",), "Euler ancestral: noise scaled by sigma_next, not sigma_up"),
    Mutation("flow-euler-dt-sign", "mlxdiff/schedulers.py",
             "dt = mx.array(float(np.float32(sigma_next) - np.float32(sigma)), dtype=model_output.dtype)",
             "dt = mx.array(float(np.float32(sigma) - np.float32(sigma_next)), dtype=model_output.dtype)",
             ("tests/test_sd3_pipeline.py", "tests/test_scheduler.py"), "flow-match Euler: dt's sign flipped"),
    # LoRA: the user's scale squared (unchanged at 1.0, wrong at any other scale)
    Mutation("lora-scale-squared", "mlxdiff/lora/apply.py",
             "s = scale * _scale(path, slot, config, target, rank)",
             "s = scale * scale * _scale(path, slot, config, target, rank)",
             ("tests/test_lora.py", "tests/test_lora_unet.py"), "LoRA: the user's scale squared"),
    # FLUX.1-dev's embedded guidance fed its default whatever the user asks
    Mutation("flux1-guidance-constant", "mlxdiff/pipelines/flux1/pipeline.py",
             "guidance=mx.full((run.batch,), run.guidance, dtype=mx.float32)",
             "guidance=mx.full((run.batch,), 3.5, dtype=mx.float32)",
             ("tests/test_flux1_pipeline.py",), "FLUX.1-dev: embedded guidance a constant 3.5"),
    # SDXL's added time ids with original_size and target_size swapped
    Mutation("sdxl-micro-cond-swap", "mlxdiff/pipelines/stable_diffusion/pipeline.py",
             'ids = (*(o["original_size"] or size), *(o["crops_coords_top_left"] or (0, 0)), '
             '*(o["target_size"] or size))',
             'ids = (*(o["target_size"] or size), *(o["crops_coords_top_left"] or (0, 0)), '
             '*(o["original_size"] or size))',
             SD_TESTS, "SDXL micro-conditioning: original_size and target_size swapped"),
)


def check_applies(mutation: Mutation, root: Path = ROOT) -> str | None:
    """None if the mutation applies to `root`'s source (its old text found exactly once, its tests present), else
    why not."""
    path = root / mutation.file
    if not path.is_file():
        return f"{mutation.file} does not exist"
    count = path.read_text().count(mutation.old)
    if count != 1:
        return f"{mutation.file}: its old text occurs {count} times (must be exactly once)"
    if mutation.new == mutation.old:
        return "its new text equals its old text"
    missing = [t for t in mutation.tests if not (root / t).is_file()]
    return f"test files missing: {missing}" if missing else None


def tree_files(root: Path) -> list:
    """The working tree as git sees it: tracked files and untracked ones not ignored (present on disk)."""
    out = subprocess.run(["git", "-C", str(root), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                         check=True, capture_output=True).stdout.decode()
    return sorted({f for f in out.split("\0") if f and (root / f).is_file()})


def copy_tree(root: Path, files: list, into: Path) -> Path:
    """`files` of `root` copied to into/<root's name>; the siblings the tests read through the repository's parent
    (../shared: tokenizer fixtures) linked beside it, so paths relative to the tree resolve as in the original."""
    dest = into / root.name
    for f in files:
        target = dest / f
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(root / f, target)
    link_siblings(root, into)
    return dest


def link_siblings(root: Path, into: Path):
    shared = root.parent / "shared"
    if shared.is_dir() and not (into / "shared").exists():
        (into / "shared").symlink_to(shared)


def clone(snapshot: Path, into: Path) -> Path:
    """A copy of the snapshot (copy_tree's result) for one run: every run sees the same tree, whatever is edited in
    the working tree meanwhile."""
    dest = into / snapshot.name
    shutil.copytree(snapshot, dest, symlinks=True)
    link_siblings(ROOT, into)
    return dest


def environment(copy: Path) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(copy) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    return env


def imported_from(copy: Path) -> str:
    """Where `import mlxdiff` resolves in the copy's environment (must be inside the copy, not the editable
    install of the original tree)."""
    out = subprocess.run([sys.executable, "-c", "import mlxdiff; print(mlxdiff.__file__)"], cwd=copy,
                         env=environment(copy), capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"import mlxdiff failed in {copy}: {out.stderr.strip().splitlines()[-1:]}")
    return out.stdout.strip()


RUNNING = set()     # the pytest processes in flight: stopped (their whole session) if the check is interrupted


def stop(proc):
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


FIRST_FAILURE = re.compile(r"^(FAILED|ERROR) (\S+)", re.MULTILINE)


def run_tests(copy: Path, tests: tuple, timeout: float) -> dict:
    """pytest on `tests` in the copy: {passed: bool, first: the first failing test id or None, seconds, tail}."""
    where = imported_from(copy)
    if not Path(where).resolve().is_relative_to(copy.resolve()):
        raise RuntimeError(f"the copy imports mlxdiff from {where}, not from {copy}")
    start = time.monotonic()
    # the ini's addopts (durations table, -n 2) replaced: -ra for the summary, one line per failure's traceback
    cmd = [sys.executable, "-m", "pytest", "-o", "addopts=", "-ra", "--tb=line", "-q", "-x", "-n", "0", "-p",
           "no:cacheprovider", *tests]
    proc = subprocess.Popen(cmd, cwd=copy, env=environment(copy), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    RUNNING.add(proc)
    try:
        text, _ = proc.communicate(timeout=timeout)
        rc = proc.returncode
    except subprocess.TimeoutExpired:
        stop(proc)
        text, rc = f"{proc.communicate()[0]}\ntimed out after {timeout:.0f} s", None
    finally:
        RUNNING.discard(proc)
    seconds = time.monotonic() - start
    first = FIRST_FAILURE.search(text)
    return {"passed": rc == 0, "rc": rc, "first": first.group(2) if first else None, "seconds": seconds,
            "tail": "\n".join(text.strip().splitlines()[-25:]), "mlxdiff": where}


def run_mutant(mutation: Mutation, snapshot: Path, timeout: float, keep: bool) -> dict:
    tmp = Path(tempfile.mkdtemp(prefix=f"mutant-{mutation.id}-"))
    try:
        copy = clone(snapshot, tmp)
        why = check_applies(mutation, copy)
        if why:
            return {"status": "VOID", "detail": why, "seconds": 0.0}
        path = copy / mutation.file
        path.write_text(path.read_text().replace(mutation.old, mutation.new))
        result = run_tests(copy, mutation.tests, timeout)
        if result["rc"] is None:
            status = "TIMEOUT"
        elif result["passed"]:
            status = "MISSED"
        elif result["rc"] == 1:    # pytest: tests failed (2-5: interrupted, internal, usage, no tests)
            status = "caught"
        else:
            status = f"VOID (pytest exit {result['rc']})"
        return {"status": status, "detail": result["first"] or "", "seconds": result["seconds"],
                "tail": result["tail"], "mlxdiff": result["mlxdiff"]}
    finally:
        if not keep:
            shutil.rmtree(tmp, ignore_errors=True)


def run_baseline(tests: tuple, snapshot: Path, timeout: float) -> dict:
    tmp = Path(tempfile.mkdtemp(prefix="mutant-baseline-"))
    try:
        return run_tests(clone(snapshot, tmp), tests, timeout)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", action="append", metavar="ID", help="run only this mutation (repeatable)")
    parser.add_argument("--list", action="store_true", help="list the mutations and their tests, run nothing")
    parser.add_argument("-j", type=int, default=1, metavar="N", help="mutants (and baselines) run at once")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per pytest run (default 1800)")
    parser.add_argument("--no-baseline", action="store_true",
                        help="skip the unmutated runs (only when they were just run on this tree)")
    parser.add_argument("--keep", action="store_true", help="keep each mutant's copy (printed) for inspection")
    parser.add_argument("-v", action="store_true", help="print each failing run's last lines")
    args = parser.parse_args(argv)

    known = {m.id: m for m in MUTATIONS}
    unknown = [i for i in args.only or () if i not in known]
    if unknown:
        print(f"unknown mutation id(s) {unknown}; --list shows them", file=sys.stderr)
        return 2
    chosen = [known[i] for i in args.only] if args.only else list(MUTATIONS)
    if args.list:
        for m in chosen:
            why = check_applies(m)
            print(f"{m.id}: {m.what}\n    {m.file}: {m.old!r}\n    -> {m.new!r}\n    tests: {' '.join(m.tests)}"
                  + (f"\n    DOES NOT APPLY: {why}" if why else ""))
        return 0

    work = Path(tempfile.mkdtemp(prefix="mutant-snapshot-"))
    try:
        def interrupted(signum, _frame):      # the pytest runs first: the pool's threads wait on them
            for proc in list(RUNNING):
                stop(proc)
            sys.exit(128 + signum)
        signal.signal(signal.SIGTERM, interrupted)
        signal.signal(signal.SIGINT, interrupted)
        return check(chosen, copy_tree(ROOT, tree_files(ROOT), work), args)
    finally:
        for proc in list(RUNNING):
            stop(proc)
        shutil.rmtree(work, ignore_errors=True)


def check(chosen, snapshot, args) -> int:
    """The baselines, then the mutants, on clones of `snapshot`; the table on stdout; 1 if any is not caught."""
    print(f"snapshot of the working tree: {snapshot}", file=sys.stderr)
    voids = {m.id: why for m in chosen if (why := check_applies(m, snapshot))}
    for i, why in voids.items():
        print(f"{i}: does not apply: {why}", file=sys.stderr)
    runnable = [m for m in chosen if m.id not in voids]
    sets = sorted({m.tests for m in runnable})
    baselines = {}
    with ThreadPoolExecutor(max(1, args.j)) as pool:
        if not args.no_baseline:
            print(f"baselines: {len(sets)} test set(s), unmutated", file=sys.stderr)
            for tests, result in zip(sets, pool.map(lambda t: run_baseline(t, snapshot, args.timeout), sets)):
                baselines[tests] = result
                print(f"  {' '.join(tests)}: {'pass' if result['passed'] else 'FAIL'} ({result['seconds']:.0f} s; "
                      f"mlxdiff from {result['mlxdiff']})", file=sys.stderr)
                if not result["passed"]:
                    print(result["tail"], file=sys.stderr)
        live = [m for m in runnable if args.no_baseline or baselines[m.tests]["passed"]]
        print(f"mutants: {len(live)}", file=sys.stderr)

        def one(m):
            r = run_mutant(m, snapshot, args.timeout, args.keep)
            print(f"  {m.id}: {r['status']} {r['detail']} ({r['seconds']:.0f} s)", file=sys.stderr)
            if args.v and r.get("tail"):
                print(r["tail"], file=sys.stderr)
            return r
        results = dict(zip([m.id for m in live], pool.map(one, live)))

    print("| mutation | what | file | tests | result | first failing test | s |")
    print("|---|---|---|---|---|---|---|")
    bad = 0
    for m in chosen:
        if m.id in voids:
            status, detail, seconds = "VOID", voids[m.id], 0.0
        elif m.id not in results:
            status, detail, seconds = "VOID", "its tests fail unmutated", 0.0
        else:
            r = results[m.id]
            status, detail, seconds = r["status"], r["detail"], r["seconds"]
        bad += status != "caught"
        tests = ", ".join(Path(t).name for t in m.tests)
        print(f"| {m.id} | {m.what} | {m.file} | {tests} | {status} | {detail} | {seconds:.0f} |")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
