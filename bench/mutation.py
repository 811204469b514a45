"""Mutation testing of the core modules with cosmic-ray: how many small, realistic bugs each module's own fast
tests notice.

For each core module (``TARGETS``: the losses, the advantage estimators, turn-level credit, the loss mask,
rollout correction, the weight-sync checks, the proxy's stitching, the Search-R1 parser, the judges, MaxScore,
and the request guards of the three HTTP servers), cosmic-ray (``pip install cosmic-ray``) writes one mutant at
a time into a copy of the tree (an operator swapped, a comparison's bound moved, a number changed by one, a
condition negated, a loop skipped, an exception type replaced, a decorator removed) and runs that module's
test subset; a mutant the tests pass on *survived*. A run prints a table (module, mutants, killed, survived,
timeout, surviving share) and writes ``bench/results/mutation.json`` with every survivor's place and diff.

Operators: cosmic-ray's core set, less its exotic arithmetic replacements (``+`` to ``<<``, ``%``, ``**`` ...)
and ``is`` comparisons, which make mutants no test could meaningfully tell apart, and its variable replacer
and inserter (random names and values): see :func:`keep_operator`. Mutants inside type annotations of a
module with ``from __future__ import annotations`` are skipped (never evaluated: equivalent by construction).

Speed: the test subset of a mutant runs in a process forked from one that imported torch, numpy, numba,
transformers, FastAPI and pytest once (``serve``; the mutated module and everything of the project are imported
after the fork, so each mutant is tested fresh), which turns ~10 s of start-up per mutant into ~0.1 s.
Modules compiled by numba run with ``NUMBA_DISABLE_JIT=1`` (the kernels as plain Python: same semantics, no
compile per mutant). Run it niced, one module at a time::

    nice -n 15 python bench/mutation.py                 # every core module
    nice -n 15 python bench/mutation.py judges maxscore # some
    python bench/mutation.py --dry-run                  # count the mutants only
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import hashlib
import json
import os
import re
import select
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Self

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "bench" / "results" / "mutation.json"
PYTEST_ARGS = ["-x", "-q", "--assert=plain", "-p", "no:cacheprovider", "-p", "no:randomly", "-p", "no:unraisableexception", "-W", "ignore"]
PRELOAD = ("torch", "numpy", "numba", "scipy", "transformers", "tokenizers", "fastapi", "starlette", "uvicorn",
           "httpx2", "pydantic", "orjson", "yaml", "pytest", "hypothesis", "openai", "langgraph", "bm25s", "Stemmer",
           "faiss", "jinja2", "safetensors")
PROJECT = ("corpora", "retrieval", "agent", "training", "eval", "sleuth", "tests", "bench")


@dataclass(frozen=True)
class Target:
    """One module under mutation: its path, its fast tests, the definitions mutated (``only``: qualified names
    such as ``RetrieveEndpoint.admit``; empty: the whole file) and the environment of its tests."""

    path: str
    tests: tuple[str, ...]
    only: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()


TARGETS: dict[str, Target] = {
    "losses": Target("training/algos/losses.py", ("tests/test_losses_exact.py", "tests/test_policy_losses.py")),
    "advantages": Target("training/algos/advantages.py", ("tests/test_advantages_exact.py", "tests/test_advantages.py")),
    "estimators": Target("training/algos/estimators.py", ("tests/test_advantages_exact.py", "tests/test_advantages.py",
                                                         "tests/test_turn_credit.py")),
    "turn_credit": Target("training/algos/turn_credit.py", ("tests/test_turn_credit.py",)),
    "masking": Target("training/masking.py", ("tests/test_masking.py",)),
    "offpolicy": Target("training/algos/offpolicy.py", ("tests/test_offpolicy_math.py",)),
    "weight_sync": Target("training/rollout/weight_sync.py", ("tests/test_weight_sync_checks.py",)),
    "stitch": Target("agent/external/stitch.py", ("tests/test_stitch.py",)),
    "search_r1": Target("agent/protocols/search_r1.py", ("tests/test_search_r1_parser.py",)),
    "judges": Target("agent/judges.py", ("tests/test_judges.py",)),
    "maxscore": Target("retrieval/maxscore.py", ("tests/test_maxscore.py",), env=(("NUMBA_DISABLE_JIT", "1"),)),
    "retrieval_server_limits": Target(
        "retrieval/server.py", ("tests/test_retrieval_server_limits.py",),
        only=("ServerLimits", "parse_request", "_flag", "RetrieveEndpoint.admit", "RetrieveEndpoint._handle")),
    "http_guard": Target("retrieval/http_guard.py", ("tests/test_http_guard.py", "tests/test_retrieval_server_limits.py")),
    "serve_limits": Target(
        "agent/serve/service.py", ("tests/test_serve_limits.py",),
        only=("check_unicode", "int_in", "AgentService.check_auth", "AgentService.read_json",
              "AgentService.check_question", "AgentService.episode_options", "AgentService.take_slot",
              "AgentService.take_slots")),
    "serve_params": Target("agent/serve/chat_params.py", ("tests/test_serve_limits.py",),
                           only=("_number", "_positive_int", "_in_range", "parse_chat_params")),
    "proxy_limits": Target(
        "agent/external/proxy.py", ("tests/test_proxy_limits.py",),
        only=("Proxy._log", "Proxy._params", "Proxy._check_auth", "Proxy._read_json", "Proxy._episode_of",
              "_number")),
}

_ARITH = {"Add", "Sub", "Mul", "Div", "FloorDiv"}
_BITS = {"BitAnd", "BitOr", "BitXor"}
_SHIFTS = {"LShift", "RShift"}
_BINARY = re.compile(r"core/ReplaceBinaryOperator_(\w+?)_(\w+)$")
_COMPARE = re.compile(r"core/ReplaceComparisonOperator_(\w+?)_(\w+)$")


def keep_operator(name: str) -> bool:
    """Whether cosmic-ray's operator ``name`` is used: binary operators are replaced within their family
    (arithmetic ``+ - * / //``, bitwise ``& | ^``, shifts), comparisons among ``== != < <= > >=`` (and ``is`` with
    ``is not``), every other core operator but the variable replacer and inserter."""
    m = _BINARY.match(name)
    if m:
        a, b = m.groups()
        return any(a in fam and b in fam for fam in (_ARITH, _BITS, _SHIFTS)) or (a == "Mod" and b in _ARITH)
    m = _COMPARE.match(name)
    if m:
        a, b = m.groups()
        return ("Is" in a) == ("Is" in b) and a not in ("In", "NotIn")
    return name not in ("core/VariableReplacer", "core/VariableInserter")


def definition_lines(path: Path, names: tuple[str, ...]) -> set[int]:
    """The source lines of the named top-level functions/classes and ``Class.method`` methods of ``path``
    (decorators included). Raises ``ValueError`` naming a definition the file lacks (the list must follow a
    refactor, never silently mutate nothing)."""
    tree = ast.parse(path.read_text())
    found: dict[str, ast.AST] = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            found[node.name] = node
            if isinstance(node, ast.ClassDef):
                for sub in node.body:
                    if isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        found[f"{node.name}.{sub.name}"] = sub
    missing = [n for n in names if n not in found]
    if missing:
        raise ValueError(f"{path}: no definition named {missing}; update TARGETS in bench/mutation.py")
    lines: set[int] = set()
    for n in names:
        node = found[n]
        start = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
        lines.update(range(start, node.end_lineno + 1))
    return lines


def annotation_spans(path: Path) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """``((line, col), (end_line, end_col))`` of every annotation of ``path`` when the module has ``from __future__
    import annotations`` (never evaluated: a mutant inside one is equivalent by construction); else ``[]``."""
    tree = ast.parse(path.read_text())
    lazy = any(isinstance(n, ast.ImportFrom) and n.module == "__future__" and any(a.name == "annotations" for a in n.names)
               for n in tree.body)
    if not lazy:
        return []
    spans = []
    for node in ast.walk(tree):
        notes = []
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            a = node.args
            notes = [x.annotation for x in (*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg) if x] + [node.returns]
        elif isinstance(node, ast.AnnAssign):
            notes = [node.annotation]
        spans += [((n.lineno, n.col_offset), (n.end_lineno, n.end_col_offset)) for n in notes if n is not None]
    return spans


def copy_tree(dest: Path, src: Path = ROOT) -> Path:
    """Copy the repository's files (tracked, and untracked ones git does not ignore) to ``dest``."""
    names = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=src, check=True,
                           capture_output=True).stdout.decode().split("\0")
    for name in filter(None, names):
        s = src / name
        if s.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(s, dest / name)
    return dest


# -- the forking test server ------------------------------------------------------------------------------
def serve(sock_path: str, root: str, preload: bool = True) -> None:
    """Import pytest and its plugins, and the heavy libraries (``preload``), then run each request's pytest
    arguments in a forked child (cwd ``root``); answer its exit code. A client that hangs up (cosmic-ray's
    timeout killed it) gets its child killed."""
    os.chdir(root)
    sys.path.insert(0, root)
    sys.dont_write_bytecode = True
    from importlib.metadata import entry_points

    plugins = [ep.value.split(":")[0] for ep in entry_points(group="pytest11")]  # pytest's plugins (seconds each)
    for name in ("pytest", *plugins, *(PRELOAD if preload else ())):  # an optional library that fails here is
        with contextlib.suppress(Exception):  # imported after the fork if needed
            __import__(name)
    _check_no_project_modules()
    srv = socket.socket(socket.AF_UNIX)
    srv.bind(sock_path)
    srv.listen(1)
    while True:
        conn, _ = srv.accept()
        req = json.loads(_recv_line(conn))
        if req.get("stop"):
            conn.close()
            return
        code = _run_forked(conn, srv, req)
        if req.get("warm"):
            _import_what_the_tests_imported(req["warm"])
        try:
            conn.sendall(str(code).encode())
        except OSError:
            pass
        conn.close()


def _check_no_project_modules() -> None:
    loaded = sorted(m for m in sys.modules if m.split(".")[0] in PROJECT)
    if loaded:
        raise RuntimeError(f"the test server imported project modules before forking: {loaded[:5]}")


def _third_party(name: str) -> bool:
    top = name.split(".")[0]
    return top not in PROJECT and top not in ("__main__", "__mp_main__") and not top.startswith(("test_", "conftest"))


def _in_tree(module: object) -> bool:
    """Whether ``module`` was loaded from the tree under test (the cwd), which only a fork may import."""
    f = getattr(module, "__file__", None)
    if not (isinstance(f, str) and os.path.isabs(f)):
        return False
    p = Path(f).resolve()
    return p.is_relative_to(Path.cwd().resolve()) and not p.is_relative_to(Path(sys.prefix).resolve())


def _import_what_the_tests_imported(listing: str) -> None:
    """Import in the server the libraries a warm-up run of the tests imported lazily (``torch.testing`` pulls in
    ``torch.distributed.tensor`` and sympy, seconds per mutant otherwise); never a project module."""
    names = json.loads(Path(listing).read_text()) if Path(listing).exists() else []
    for name in names:
        if name in sys.modules or not _third_party(name):
            continue
        before = set(sys.modules)
        with contextlib.suppress(Exception):
            __import__(name)
        new = set(sys.modules) - before
        if any(not _third_party(m) for m in new):  # it imports the project (a plugin, a test helper): undo it
            for m in new:
                del sys.modules[m]
    _check_no_project_modules()
    tree = [m for m, mod in list(sys.modules.items()) if _third_party(m) and _in_tree(mod)]
    if tree:
        raise RuntimeError(f"the test server imported modules of the tree under test: {tree[:5]}")


def _run_forked(conn: socket.socket, srv: socket.socket, req: dict) -> int:
    pid = os.fork()
    if pid == 0:  # the child: pytest on a fresh import of the project
        srv.close()
        conn.close()
        os.setsid()
        fd = os.open(req.get("log") or os.devnull, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        import pytest

        try:
            code = int(pytest.main(req["args"]))
        except BaseException:  # noqa: BLE001
            code = 99
        if req.get("warm"):  # what the server should import before the next forks: libraries, nothing of the tree
            Path(req["warm"]).write_text(json.dumps(sorted(m for m, mod in list(sys.modules.items())
                                                           if _third_party(m) and not _in_tree(mod))))
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        ready, _, _ = select.select([conn], [], [], 0.05)
        if ready and not conn.recv(1):  # the client is gone
            try:
                os.killpg(pid, signal.SIGKILL)
            except OSError:
                pass
            os.waitpid(pid, 0)
            return -9


def _recv_all(conn: socket.socket) -> bytes:
    return b"".join(iter(lambda: conn.recv(65536), b""))


def _recv_line(conn: socket.socket) -> bytes:
    """One request: JSON up to a newline (the client keeps its side open, so that its closing it means it is
    gone)."""
    parts = []
    while not parts or not parts[-1].endswith(b"\n"):
        chunk = conn.recv(65536)
        if not chunk:
            break
        parts.append(chunk)
    return b"".join(parts)


def ask(sock_path: str, args: list[str], log: str | None = None, warm: str | None = None) -> int:
    """Have the server at ``sock_path`` run pytest with ``args``; returns pytest's exit code. ``warm``: a file
    where the run lists the modules it imported, which the server then imports itself (a warm-up run)."""
    with socket.socket(socket.AF_UNIX) as s:
        s.connect(sock_path)
        s.sendall(json.dumps({"args": args, "log": log, "warm": warm}).encode() + b"\n")
        reply = _recv_all(s)
    return int(reply or 98)


class ForkServer:
    """A :func:`serve` process for one tree and environment (a context manager)."""

    def __init__(self, root: Path, env: dict[str, str], preload: bool = True, python: str = sys.executable):
        self.sock = str(Path(tempfile.mkdtemp(prefix="mut-")) / "s")
        full = {**os.environ, **env, "PYTHONPATH": str(root), "PYTHONDONTWRITEBYTECODE": "1"}
        self.proc = subprocess.Popen([python, str(Path(__file__).resolve()), "serve", "--socket", self.sock,
                                      "--root", str(root), *([] if preload else ["--no-preload"])], env=full, cwd=root)

    def __enter__(self) -> Self:
        while not os.path.exists(self.sock):
            if self.proc.poll() is not None:
                raise RuntimeError(f"the mutation test server exited with {self.proc.returncode}")
            time.sleep(0.1)
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            with socket.socket(socket.AF_UNIX) as s:
                s.connect(self.sock)
                s.sendall(b'{"stop": true}\n')
        except OSError:
            pass
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        shutil.rmtree(Path(self.sock).parent, ignore_errors=True)


# -- one module's campaign --------------------------------------------------------------------------------
def init_session(target: Target, tree: Path, work: Path, name: str, timeout: float, test_command: str,
                 sample: int = 0, only_mutants: set[tuple[int, str, int]] | None = None) -> Path:
    """Write the cosmic-ray config of ``target`` (``cosmic-ray exec <config> <session>`` reruns it), initialise
    its session, and mark as skipped the mutants of operators :func:`keep_operator` drops and those outside
    ``target.only``. ``sample`` > 0: keep at most that many of the rest, every k-th in source order (a
    systematic sample over the whole file; the others are skipped as ``"not sampled"``). ``only_mutants``:
    ``(line, operator, occurrence)`` of the mutants to run (a previous run's survivors); the others are
    skipped as ``"killed before"``. Returns the session file."""
    from cosmic_ray.commands import init
    from cosmic_ray.config import load_config
    from cosmic_ray.work_db import use_db
    from cosmic_ray.work_item import WorkerOutcome, WorkResult

    config, session = work / f"{name}.toml", work / f"{name}.sqlite"
    config.write_text(
        "[cosmic-ray]\n"
        f"module-path = {json.dumps(target.path)}\n"
        f"timeout = {timeout:.1f}\n"
        "excluded-modules = []\n"
        f"test-command = {json.dumps(test_command)}\n\n"
        "[cosmic-ray.distributor]\nname = \"local\"\n")
    session.unlink(missing_ok=True)
    lines = definition_lines(tree / target.path, target.only) if target.only else None
    notes = annotation_spans(tree / target.path)
    with contextlib.chdir(tree), use_db(str(session)) as db:
        init([Path(target.path)], db, load_config(str(config)).operators_config)
        for item in list(db.pending_work_items):
            m = item.mutations[0]
            pos = tuple(m.start_pos)
            if (not keep_operator(m.operator_name) or (lines is not None and pos[0] not in lines)
                    or any(a <= pos < b for a, b in notes)):
                db.set_result(item.job_id, WorkResult(worker_outcome=WorkerOutcome.SKIPPED, output="filtered"))
        if sample > 0:
            rest = sorted(db.pending_work_items, key=lambda i: (tuple(i.mutations[0].start_pos),
                                                                 i.mutations[0].operator_name, i.mutations[0].occurrence))
            step = -(-len(rest) // sample)
            for k, item in enumerate(rest):
                if k % step:
                    db.set_result(item.job_id, WorkResult(worker_outcome=WorkerOutcome.SKIPPED, output="not sampled"))
        if only_mutants is not None:
            for item in list(db.pending_work_items):
                m = item.mutations[0]
                if (m.start_pos[0], m.operator_name.removeprefix("core/"), m.occurrence) not in only_mutants:
                    db.set_result(item.job_id, WorkResult(worker_outcome=WorkerOutcome.SKIPPED, output="killed before"))
            left = sum(1 for _ in db.pending_work_items)
            if left != len(only_mutants):
                raise ValueError(f"{name}: {len(only_mutants)} survivors to rerun, {left} found: run the module whole")
    return session


def execute_session(tree: Path, work: Path, name: str, session: Path, env: dict[str, str]) -> None:
    """``cosmic-ray exec`` of a session, in this process: each mutant written into ``tree`` and restored."""
    from cosmic_ray.commands import execute
    from cosmic_ray.config import load_config
    from cosmic_ray.work_db import WorkDB, use_db

    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        with contextlib.chdir(tree), use_db(str(session), WorkDB.Mode.open) as db:
            execute(db, load_config(str(work / f"{name}.toml")))
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def collect(session: Path, tree: Path, target: Target) -> dict:
    """Counts and survivors of a finished session."""
    from cosmic_ray.work_db import WorkDB, use_db
    from cosmic_ray.work_item import TestOutcome, WorkerOutcome

    source = (tree / target.path).read_text().splitlines()
    counts = {"mutants": 0, "killed": 0, "survived": 0, "timeout": 0, "errors": 0, "pending": 0, "unsampled": 0}
    survivors = []
    with use_db(str(session), WorkDB.Mode.open) as db:
        for item, result in db.completed_work_items:
            if result.worker_outcome == WorkerOutcome.SKIPPED:
                counts["unsampled"] += result.output == "not sampled"
                continue
            counts["mutants"] += 1
            m = item.mutations[0]
            if result.test_outcome == TestOutcome.SURVIVED:
                counts["survived"] += 1
                line = m.start_pos[0]
                survivors.append({"line": line, "operator": m.operator_name.removeprefix("core/"),
                                  "occurrence": m.occurrence, "source": source[line - 1].strip(),
                                  "diff": "\n".join(x for x in (result.diff or "").splitlines()
                                                    if x[:1] in "+-" and x[:3] not in ("+++", "---"))})
            elif result.test_outcome == TestOutcome.KILLED and result.output == "timeout":
                counts["timeout"] += 1
            elif result.test_outcome == TestOutcome.KILLED:
                counts["killed"] += 1
            else:  # incompetent (the mutant does not even import) or a worker failure: not a survivor
                counts["errors"] += 1
        pending = sum(1 for _ in db.pending_work_items)
    counts["mutants"] += pending
    counts["pending"] = pending
    counts["surviving_share"] = round(counts["survived"] / max(counts["mutants"], 1), 4)
    survivors.sort(key=lambda s: (s["line"], s["operator"]))
    return {**counts, "survivors": survivors}


def run_target(name: str, target: Target, tree: Path, work: Path, dry_run: bool = False, preload: bool = True,
               sample: int = 0, previous: dict | None = None) -> dict:
    """Mutation-test ``target`` in the copied ``tree`` (``work``: the sessions' folder). The unmutated tests
    must pass first (``RuntimeError`` with their log otherwise). ``dry_run``: count the mutants, run nothing;
    ``preload``: import the heavy libraries once in the test server (off for a project that needs none);
    ``sample``: run at most that many mutants (see :func:`init_session`; 0: all); ``previous``: this module's
    last result, whose survivors alone are run again (tests were added since; the mutants it killed stay
    killed), ``ValueError`` if the module's source changed since."""
    env = dict(target.env)
    sha = hashlib.sha256((tree / target.path).read_bytes()).hexdigest()
    only = None
    if previous is not None:
        if previous.get("source_sha256", sha) != sha:
            raise ValueError(f"{name}: {target.path} changed since its last run: run it whole")
        only = {(x["line"], x["operator"], x["occurrence"]) for x in previous["survivors"]}
        sample = 0
    test_args = [*PYTEST_ARGS, *target.tests]
    started = time.time()
    client = tree / "bench" / "mutation.py"  # the copy's: editing this file never disturbs a running campaign
    client = client if client.exists() else Path(__file__).resolve()
    if dry_run:
        session = init_session(target, tree, work, name, 0.0, "true", sample, only)
        baseline = 0.0
    else:
        with ForkServer(tree, env, preload) as server:
            log = work / f"{name}.baseline.log"
            code = ask(server.sock, test_args, str(log), warm=str(work / f"{name}.modules.json"))
            t0 = time.time()
            if code == 0:  # timed after the warm-up, as each mutant runs
                code = ask(server.sock, test_args, str(log))
            baseline = time.time() - t0
            if code != 0:
                raise RuntimeError(f"{name}: the unmutated tests fail (exit {code}): see {log}\n"
                                   + log.read_text()[-3000:])
            cmd = shlex.join([sys.executable, str(client), "test", "--socket", server.sock, "--", *test_args])
            session = init_session(target, tree, work, name, max(30.0, 5 * baseline + 15), cmd, sample, only)
            execute_session(tree, work, name, session, env)
    out = collect(session, tree, target)
    if previous is not None:  # the mutants killed before count as killed; the survivors are this run's
        still = {(x["line"], x["operator"], x["occurrence"]) for x in out["survivors"]}
        since = [x for x in previous["survivors"] if (x["line"], x["operator"], x["occurrence"]) not in still]
        out = {**out, **{k: previous[k] + out[k] for k in ("killed", "timeout", "errors")},
               "mutants": previous["mutants"], "unsampled": previous.get("unsampled", 0), "survivors_rerun": True,
               "killed_since": previous.get("killed_since", []) + since}  # survivors the added tests kill
        out["surviving_share"] = round(out["survived"] / max(out["mutants"], 1), 4)
    return {"path": target.path, "tests": list(target.tests), "only": list(target.only), **out,
            "baseline_s": round(baseline, 2), "seconds": round(time.time() - started, 1), "source_sha256": sha}


# -- report -----------------------------------------------------------------------------------------------
def table(results: dict[str, dict]) -> str:
    head = "| module | path | mutants | killed | survived | timeout | errors | surviving |\n|---|---|---|---|---|---|---|---|"
    rows = [f"| {n} | `{r['path']}` | {_mutants(r)} | {r['killed']} | {r['survived']} | {r['timeout']} | "
            f"{r['errors']} | {100 * r['surviving_share']:.1f}% |" for n, r in results.items()]
    return "\n".join([head, *rows])


def _mutants(r: dict) -> str:
    """The mutants cell: the count, and the population a sample was drawn from."""
    extra = r.get("unsampled", 0)
    return f"{r['mutants']} (sample of {r['mutants'] + extra})" if extra else str(r["mutants"])


def main(argv: list[str] | None = None) -> dict[str, dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("modules", nargs="*", help=f"modules to run (default: all): {', '.join(TARGETS)}")
    p.add_argument("--dry-run", action="store_true", help="count the mutants of each module; run no test")
    p.add_argument("--out", default=str(OUT), help="JSON results (merged with the modules already there)")
    p.add_argument("--keep", action="store_true", help="keep the copied tree and the sessions (printed)")
    p.add_argument("--survivors", action="store_true",
                   help="run only the survivors of each module's last run in --out (after adding tests)")
    p.add_argument("--sample", type=int, default=0, metavar="N",
                   help="at most N mutants per module, every k-th in source order (default: all)")
    args = p.parse_args(argv)
    unknown = [m for m in args.modules if m not in TARGETS]
    if unknown:
        p.error(f"unknown modules {unknown}; choose from {', '.join(TARGETS)}")
    names = args.modules or list(TARGETS)
    work = Path(tempfile.mkdtemp(prefix="sleuth-mutation-"))
    results: dict[str, dict] = {}
    failed: dict[str, str] = {}
    try:
        for name in names:
            print(f"[mutation] {name}: {TARGETS[name].path} with {' '.join(TARGETS[name].tests)}", flush=True)
            try:
                tree = copy_tree(work / name)  # per module: tests written meanwhile count for the next one
                prev = None
                if args.survivors:
                    old = json.loads(Path(args.out).read_text())["modules"] if Path(args.out).exists() else {}
                    if name not in old:
                        raise ValueError(f"{name}: no previous run in {args.out} to take survivors from")
                    prev = old[name]
                results[name] = r = run_target(name, TARGETS[name], tree, work, args.dry_run, sample=args.sample,
                                               previous=prev)
            except (RuntimeError, ValueError) as e:  # the next module still runs
                print(f"[mutation] {name}: FAILED: {e}", flush=True)
                failed[name] = str(e)
                continue
            print(f"[mutation] {name}: {r['mutants']} mutants, {r['survived']} survived, {r['seconds']} s", flush=True)
            if not args.dry_run:  # after each module: an interrupted run keeps what it measured
                write_results(Path(args.out), {name: r})
    finally:
        if args.keep:
            print(f"[mutation] kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    print(table(results))
    if failed:
        print(f"[mutation] not measured: {', '.join(failed)}")
    if not args.dry_run and results:
        print(f"[mutation] wrote {args.out}")
    return results


def write_results(out: Path, results: dict[str, dict]) -> None:
    """Merge ``results`` into the JSON at ``out``: the modules measured now replace their old entries, every other
    module's entry is kept (the campaign runs a module or a few at a time)."""
    from importlib.metadata import version

    old = json.loads(out.read_text()) if out.exists() else {}
    merged = {**old.get("modules", {}), **results}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"tool": f"cosmic-ray {version('cosmic-ray')}", "modules": merged}, indent=1) + "\n")


def _client(argv: list[str]) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--socket", required=True)
    p.add_argument("args", nargs=argparse.REMAINDER)
    a = p.parse_args(argv)
    return ask(a.socket, [x for x in a.args if x != "--"])


def _server(argv: list[str]) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--socket", required=True)
    p.add_argument("--root", required=True)
    p.add_argument("--no-preload", action="store_true")
    a = p.parse_args(argv)
    serve(a.socket, a.root, preload=not a.no_preload)


if __name__ == "__main__":
    if sys.argv[1:2] == ["test"]:
        sys.exit(_client(sys.argv[2:]))
    elif sys.argv[1:2] == ["serve"]:
        _server(sys.argv[2:])
    else:
        main()
