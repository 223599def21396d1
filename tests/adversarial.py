"""Run user-mistake cases each in its own process, under a memory cap and a timeout, cheaply.

A fresh server process imports mlxdiff once (and runs no MLX work), then forks one child per case: the child caps
its address space (RLIMIT_AS), arms an alarm, sends stdout/stderr to files and runs the case. So every case is
isolated like a subprocess (a crash, an abort or a hang costs only that child) but pays no interpreter start-up.

A case is a dict:
    {"cli": "mlxdiff.generate", "argv": [...]}        -> the module's main(argv); its return value is the exit code
    {"api": "python source"}                          -> exec'd; exit 2 when it raises MlxdiffError (message on
                                                         stderr as the CLI prints it), 0 when it returns
Optional keys: "cwd", "env" (set in the child), "timeout" (s), "memory" (bytes).

`run_cases(cases)` returns one Outcome per case; `refused(outcome)` says whether it ended the way a user mistake
must: exit 2, exactly one non-empty stderr line starting "mlxdiff:", no traceback, no crash, no hang. A module whose
tests each run a few cases shares one `CaseServer` (a module-scope fixture): the server's imports are paid once.
"""

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MEMORY_CAP = 4 << 30
TIMEOUT_S = 60

SERVER = r'''
import importlib, json, os, resource, signal, sys, traceback
sys.path.insert(0, sys.argv[1])
# what a load imports, once here rather than in every child (5-10 s a case otherwise). transformers for the
# tokenizers; not transformers.processing_utils (torch with it, 9 s of CPU), which no tokenizer load imports
import mlxdiff, mlxdiff.generate, mlxdiff.convert, mlxdiff.footprint, mlxdiff.pipelines.flux2, mlxdiff.pipelines.sd3
import transformers
from mlxdiff.errors import MlxdiffError

def child(case, out, err):
    # Python's Ctrl-C handler, whatever the test runner's SIGINT disposition (a background job starts with SIGINT
    # ignored, and the fork server would inherit that)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    resource.setrlimit(resource.RLIMIT_AS, (case["memory"], case["memory"]))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    signal.alarm(case["timeout"])
    for fd, path in ((1, out), (2, err)):
        f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(f, fd)
        os.close(f)
    sys.stdout = os.fdopen(1, "w", buffering=1, closefd=False)
    sys.stderr = os.fdopen(2, "w", buffering=1, closefd=False)
    if case.get("cwd"):
        os.chdir(case["cwd"])
    os.environ.update(case.get("env") or {})
    rc = 1
    try:
        if "cli" in case:
            try:
                rc = importlib.import_module(case["cli"]).main(case["argv"])
            except SystemExit as e:
                rc = e.code if isinstance(e.code, int) else 1
        else:
            try:
                exec(compile(case["api"], "<case>", "exec"), {"__name__": "__case__"})
                rc = 0
            except MlxdiffError as e:
                print(f"mlxdiff: error: {e}", file=sys.stderr)
                rc = 2
    except BaseException:
        traceback.print_exc()
        rc = 1
    sys.stdout.flush(); sys.stderr.flush()
    os._exit(rc if isinstance(rc, int) else 1)

for line in sys.stdin:
    case = json.loads(line)
    out, err = case["stdout"], case["stderr"]
    pid = os.fork()
    if pid == 0:
        child(case, out, err)
    _, status = os.waitpid(pid, 0)
    print(json.dumps({"rc": os.WEXITSTATUS(status) if os.WIFEXITED(status) else None,
                      "signal": os.WTERMSIG(status) if os.WIFSIGNALED(status) else None}), flush=True)
'''


@dataclass
class Outcome:
    case: dict
    rc: int | None          # None when killed by a signal
    signal: int | None      # SIGALRM (14): the timeout; SIGKILL/SIGABRT/SIGSEGV: a crash
    stdout: str
    stderr: str

    def describe(self) -> str:
        what = self.case.get("argv") or self.case.get("api")
        return f"{what!r}: rc={self.rc} signal={self.signal}\nstderr: {self.stderr[-2000:]}"


class CaseServer:
    """One fork server for several run() calls (its imports paid once); close() ends it. Each case's stdout and
    stderr go to files under `tmp_path`/adversarial-io, the server's working folder."""

    def __init__(self, tmp_path):
        self.tmp = Path(tmp_path) / "adversarial-io"
        self.tmp.mkdir(parents=True, exist_ok=True)
        self.n = 0
        env = {**os.environ, "PYTHONFAULTHANDLER": ""}
        env.pop("PYTHONFAULTHANDLER")
        self.server = subprocess.Popen([sys.executable, "-c", SERVER, str(ROOT)], stdin=subprocess.PIPE,
                                       stdout=subprocess.PIPE, text=True, env=env, cwd=self.tmp)

    def run(self, cases) -> list:
        outcomes = []
        for case in cases:
            self.n += 1
            full = {"timeout": TIMEOUT_S, "memory": MEMORY_CAP, **case,
                    "stdout": str(self.tmp / f"{self.n}.out"), "stderr": str(self.tmp / f"{self.n}.err")}
            self.server.stdin.write(json.dumps(full) + "\n")
            self.server.stdin.flush()
            line = self.server.stdout.readline()
            if not line:
                raise RuntimeError("the adversarial server died")
            status = json.loads(line)
            outcomes.append(Outcome(case, status["rc"], status["signal"],
                                    Path(full["stdout"]).read_text(errors="replace"),
                                    Path(full["stderr"]).read_text(errors="replace")))
        return outcomes

    def close(self):
        self.server.stdin.close()
        self.server.wait(timeout=60)


def run_cases(cases, tmp_path) -> list:
    """The cases in a server of their own."""
    server = CaseServer(tmp_path)
    try:
        return server.run(cases)
    finally:
        server.close()


def refused(outcome: Outcome) -> bool:
    """Exit 2 and exactly one non-empty stderr line that starts with "mlxdiff:" (no traceback, no crash, no hang)."""
    lines = [line for line in outcome.stderr.splitlines() if line.strip()]
    return (outcome.rc == 2 and outcome.signal is None and len(lines) == 1 and lines[0].startswith("mlxdiff:")
            and "Traceback" not in outcome.stderr)
