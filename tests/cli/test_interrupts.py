"""SIGTERM and SIGINT during a process-pool library build end every worker, print no traceback,
leave the previous files intact, and the next run works; Ctrl-C during an ILP solve stops it at
once."""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import REPO

CORAL = Path(sys.executable).with_name("coral")


def _children(pid: int) -> set[int]:
    """Live processes whose parent is `pid` (read from /proc)."""
    found = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            fields = stat.rsplit(")", 1)[1].split()
            if int(fields[1]) == pid and fields[0] != "Z":
                found.add(int(entry.name))
    return found


def _descendants(pid: int) -> set[int]:
    """Children, their children, and so on (Ray's raylet starts its workers)."""
    found: set[int] = set()
    todo = [pid]
    while todo:
        for child in _children(todo.pop()) - found:
            found.add(child)
            todo.append(child)
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.fixture
def project(tmp_path: Path) -> Path:
    shutil.copy(REPO / "Pulumi.yaml", tmp_path / "Pulumi.yaml")
    (tmp_path / "stacks").mkdir()
    for stack in ("dev", "paper-core"):  # paper-core's build keeps two workers busy for seconds
        shutil.copy(REPO / "stacks" / f"Pulumi.{stack}.yaml", tmp_path / "stacks")
    return tmp_path


def _signal_state(pid: int) -> str:
    """The process's blocked, ignored and caught signal masks (Linux), for a failure message."""
    try:
        status = Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError:
        return "(no /proc status)"
    return " ".join(line for line in status if line.startswith(("SigBlk", "SigIgn", "SigCgt")))


def _as_a_terminal_would() -> None:
    """In the child before exec: SIGINT handled and unblocked, as in a shell, whatever the
    test runner's process holds (the suite's Ctrl-C tests hung in a full pytest-xdist run
    and passed alone, their command silent after SIGINT)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})


def _build(project: Path, stack: str, out: str, executor: str = "process") -> subprocess.Popen[str]:
    command = ["templates", "build", "--stack", stack, "--out", out, "--workers", "2"]
    return subprocess.Popen(
        [str(CORAL), *command, "--executor", executor],
        cwd=project,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # a SIGINT below reaches only what the test means it to
        preexec_fn=_as_a_terminal_would,
    )


RAY = pytest.param(
    "ray",
    marks=[
        pytest.mark.slow,
        pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="ray not installed"),
    ],
)


@pytest.mark.skipif(not Path("/proc").is_dir() or not CORAL.exists(), reason="needs Linux /proc")
@pytest.mark.parametrize("executor", ["process", RAY])
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_during_a_build_ends_every_worker(
    project: Path, signum: int, executor: str
) -> None:
    previous = project / "lib" / "previous.json"
    previous.parent.mkdir()
    previous.write_bytes(b'{"previous": true}\n')
    proc = _build(project, "paper-core", "lib", executor)
    workers: set[int] = set()
    deadline = time.monotonic() + 120
    while len(workers) < 2 and proc.poll() is None and time.monotonic() < deadline:
        workers |= _descendants(proc.pid)
        time.sleep(0.02)
    assert len(workers) >= 2, "the build never started its two workers"
    time.sleep(0.3 if executor == "process" else 5)  # the workers are placing templates now
    workers |= _descendants(proc.pid)
    if signum == signal.SIGINT:
        os.killpg(proc.pid, signum)  # Ctrl-C: the whole foreground group, workers included
    else:
        os.kill(proc.pid, signum)  # kill -TERM <pid of coral>
    # communicate() returns only once no process holds the pipes: no orphan keeps stdout open.
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode != 0
    assert "Traceback" not in stderr, stderr
    # The build's own handler ran (ray.init installs one that exits 15 and ends nothing).
    assert f"Interrupted ({signal.Signals(signum).name})." in stderr, stderr
    deadline = time.monotonic() + 10
    while any(_alive(w) for w in workers) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [w for w in workers if _alive(w)], "a worker survived the signal"
    assert previous.read_bytes() == b'{"previous": true}\n'
    assert sorted(p.name for p in previous.parent.iterdir()) == ["previous.json"]
    again = _build(project, "dev", "lib")
    _, stderr = again.communicate(timeout=120)
    assert again.returncode == 0, stderr
    assert len(list(previous.parent.glob("*.json"))) > 1


# Five market-split rows over 40 binaries (Cornuejols and Dawande's hard family): SCIP works
# on them past any time limit a stack sets, so a Ctrl-C sent a second into the first solve of
# `coral plan` lands inside SCIP. Added to every solver coral creates, beside coral's model.
HARD_SOLVES = """
import random
from solver.allocation import model
plain = model.new_solver
def new_solver(backend):
    solver = plain(backend)
    rng = random.Random(7)
    x = [solver.BoolVar(f"split[{i}]") for i in range(40)]
    for _ in range(5):
        a = [rng.randrange(100) for _ in x]
        solver.Add(solver.Sum([c * v for c, v in zip(a, x)]) == sum(a) // 2)
    return solver
model.new_solver = new_solver
from coral_iac.cli.app import app
app(prog_name="coral")
"""


def _plan_dev_with(project: Path, script: str) -> subprocess.Popen[str]:
    """`coral plan --stack dev --out plan.json` on a built library, started by `script` (which
    patches something first) in its own session."""
    built = subprocess.run(
        [str(CORAL), "templates", "build", "--stack", "dev", "--out", "lib"],
        cwd=project,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert built.returncode == 0, built.stderr
    (project / "patched_coral.py").write_text(script)
    command = ["plan", "--stack", "dev", "--library", "lib", "--out", "plan.json"]
    return subprocess.Popen(
        [sys.executable, "patched_coral.py", *command],
        cwd=project,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        preexec_fn=_as_a_terminal_would,
    )


@pytest.mark.skipif(not CORAL.exists(), reason="needs the installed coral command")
def test_ctrl_c_during_the_ilp_solve_stops_at_once_and_writes_nothing(project: Path) -> None:
    """SCIP catches SIGINT itself by default and returns its best plan as if its time limit
    hit: the run went on and wrote a plan. Ctrl-C must stop the solve, exit 130 and leave
    --out alone."""
    proc = _plan_dev_with(project, HARD_SOLVES)
    assert proc.stderr is not None
    seen = []
    for line in proc.stderr:  # the capacity model, then the first ILP solve
        seen.append(line)
        if "capacity model:" in line:
            break
    assert proc.poll() is None, "".join(seen)
    time.sleep(1.0)
    os.killpg(proc.pid, signal.SIGINT)
    sent = time.monotonic()
    try:
        stdout, stderr = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        state = _signal_state(proc.pid)
        os.killpg(proc.pid, signal.SIGKILL)  # leave no process behind for the other tests
        stdout, stderr = proc.communicate()
        pytest.fail(f"still running 120 s after Ctrl-C ({state}); its stderr:\n{stderr}")
    took = time.monotonic() - sent
    assert proc.returncode == 130, stderr
    assert took < 2.0, f"exited {took:.1f} s after Ctrl-C"
    assert "Interrupted (SIGINT)." in stderr and "Traceback" not in stderr, stderr
    assert "CTRL-C" not in stdout  # SCIP's own message would break --json
    assert not (project / "plan.json").exists()


CTRL_C_AT_FORK = HARD_SOLVES.replace(
    "from coral_iac.cli.app import app",
    """import os, signal
sent = []
def ctrl_c_at_the_first_fork():
    if not sent:
        sent.append(1)
        os.kill(os.getpid(), signal.SIGINT)
os.register_at_fork(before=ctrl_c_at_the_first_fork)
from coral_iac.cli.app import app""",
)


@pytest.mark.skipif(not CORAL.exists(), reason="needs the installed coral command")
def test_ctrl_c_while_the_searches_fork_their_workers_still_stops(project: Path) -> None:
    """A signal that lands during a fork is raised in an at-fork hook, where Python prints and
    drops it: the plan ran on through hard solves. Held over the fork, it stops the run."""
    proc = _plan_dev_with(project, CTRL_C_AT_FORK)
    try:
        _, stderr = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        state = _signal_state(proc.pid)
        os.killpg(proc.pid, signal.SIGKILL)
        _, stderr = proc.communicate()
        pytest.fail(f"Ctrl-C at the fork was lost: running after 60 s ({state}); stderr:\n{stderr}")
    assert proc.returncode == 130, stderr
    assert "Interrupted (SIGINT)." in stderr, stderr
    assert not (project / "plan.json").exists()
