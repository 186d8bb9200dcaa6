"""Faults: a killed or hung rank ends the whole run within the timeout, and every other rank
says which rank it is and which instruction it was at; a bad build is refused before any rank
communicates.

The fault tests run OUT/launch.py under torchrun for many steps and, once training is under
way, kill (SIGKILL) or freeze (SIGSTOP) rank 2 from outside, as a crash or a hang would.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import re
import signal
import subprocess
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from pipec.build_dir import emit, load
from pipec.ir import Op, PipecError
from pipec.model import compile_model
from pipec.runtime.barrier import BARRIER_SHARE, step_barrier, who_left
from pipec.runtime.interpreter import HANDLERS, check_program
from pipec.runtime.torchrun import torchrun
from tests.helpers import forked
from tests.runtime_launch import refused, said_by_rank_0

ROOT = Path(__file__).resolve().parents[1]
GPT = f"{ROOT}/examples/gpt.py:tiny"
TIMEOUT_S = 5
# How long the test waits for the others' messages after the fault: a guard against a hang,
# not a bound on speed (a loaded machine may take long to react).
WAIT_S = 120
MESSAGE = re.compile(r"pipec runtime: rank (\d) ?: ?(.*)")


@pytest.fixture(scope="module")
def build(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("faults") / "build"
    emit(compile_model(GPT, "1f1b", 4, 8), out)
    return out


class Launch:
    """torchrun on OUT/launch.py with its output lines collected as they come."""

    def __init__(self, build: Path, *args: str) -> None:
        cmd, env = torchrun(build / "launch.py", 4, *args)
        self.proc = subprocess.Popen(
            cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        self.lines: list[tuple[float, str]] = []
        self._readers = [
            threading.Thread(target=self._read, args=(s,))
            for s in (self.proc.stdout, self.proc.stderr)
        ]
        for t in self._readers:
            t.start()

    def _read(self, stream) -> None:
        for line in stream:
            self.lines.append((time.monotonic(), line.rstrip("\n")))

    def wait_for(self, pattern: str, timeout: float) -> float:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for t, line in list(self.lines):
                if re.search(pattern, line):
                    return t
            time.sleep(0.05)
        raise AssertionError(f"no line matching {pattern!r} in {timeout} s:\n{self.text()}")

    def worker_pid(self, rank: int) -> int:
        """The pid of torchrun's worker process for `rank`."""
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
                parent = int(Path(f"/proc/{pid}/stat").read_text().split()[3])
            except (OSError, ValueError):
                continue
            if f"RANK={rank}".encode() in environ and _ancestor(parent, self.proc.pid):
                return int(pid)
        raise AssertionError(f"no worker process for rank {rank}")

    def finish(self, timeout: float) -> int:
        code = self.proc.wait(timeout)
        for t in self._readers:
            t.join()
        return code

    def text(self) -> str:
        return "\n".join(line for _, line in self.lines)

    def messages(self) -> dict[int, tuple[float, str]]:
        """The first runtime message of each rank, with when it came."""
        found: dict[int, tuple[float, str]] = {}
        for t, line in self.lines:
            m = MESSAGE.search(line)
            if m and int(m[1]) not in found:
                found[int(m[1])] = (t, m[2])
        return found


def _ancestor(pid: int, ancestor: int) -> bool:
    while pid > 1:
        if pid == ancestor:
            return True
        pid = int(Path(f"/proc/{pid}/stat").read_text().split()[3])
    return False


INSTRUCTION = re.compile(
    r"[A-Z_]+(?: s=\d+)?(?: mb=\d+)?(?: (?:to|from)=\d+)? \(rank_\d{3}\.pipe:\d+\)"
)


@pytest.mark.slow
@pytest.mark.parametrize("fault", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "hung"])
def test_a_dead_or_hung_rank_stops_every_rank_with_a_message(build, fault):
    run = Launch(build, "--steps", "100000", "--timeout", str(TIMEOUT_S))
    victim = None
    try:
        run.wait_for(r"step +2/", timeout=120)
        victim = run.worker_pid(2)
        os.kill(victim, fault)
        others = {0, 1, 3}
        deadline = time.monotonic() + TIMEOUT_S + WAIT_S
        while not others <= set(run.messages()) and time.monotonic() < deadline:
            time.sleep(0.1)
        messages = run.messages()
        assert others <= set(messages), run.text()
        for rank in others:
            assert INSTRUCTION.search(messages[rank][1]), messages[rank][
                1
            ]  # names the instruction and its line
        # Whoever waited on the victim directly says so.
        assert any("rank 2" in text for _, text in messages.values()), run.text()
    finally:
        if victim is not None and fault is signal.SIGSTOP:
            # pipec's agent kills a stopped rank once the others fail: it may be gone already
            with contextlib.suppress(ProcessLookupError):
                os.kill(victim, signal.SIGKILL)
        code = run.finish(timeout=60)
    assert code != 0


BARRIER_TIMEOUT_S = 2.0


def _barrier_rank(rank: int, where: str) -> None:
    """One rank of `test_a_rank_missing_from_the_step_barrier_is_named`; rank 2 never arrives."""
    dist.init_process_group("gloo", init_method=f"file://{where}/store", rank=rank, world_size=3)
    if rank == 2:
        time.sleep(2 * BARRIER_TIMEOUT_S)
    else:
        try:
            step_barrier("before step 3", BARRIER_TIMEOUT_S)
            outcome = "passed"
        except RuntimeError as e:
            outcome = str(e)
        Path(f"{where}/{rank}").write_text(outcome)
    os._exit(0)  # the group is broken: skip its teardown


def test_a_rank_missing_from_the_step_barrier_is_named(tmp_path):
    """Between steps no rank waits on a peer's message, so the barrier itself names the missing
    rank: rank 0 gives up first (`BARRIER_SHARE` of the timeout) and says who did not come."""
    forked(_barrier_rank, 3, str(tmp_path))
    wait = BARRIER_TIMEOUT_S * BARRIER_SHARE
    assert (tmp_path / "0").read_text() == (
        f"rank 2 did not reach the barrier before step 3 in {wait:g} s"
    )
    assert (tmp_path / "1").read_text() != "passed"


def _dying_rank(rank: int, where: str) -> None:
    """One rank of `test_a_rank_that_died_between_steps_is_named`: after the first barrier rank
    2 exits, its connections closing; the others go on to the next."""
    dist.init_process_group("gloo", init_method=f"file://{where}/store", rank=rank, world_size=3)
    step_barrier("before step 1", BARRIER_TIMEOUT_S * 10)
    if rank == 2:
        os._exit(1)
    try:
        step_barrier("before step 2", BARRIER_TIMEOUT_S * 10)
        outcome = "passed"
    except RuntimeError as e:
        outcome = str(e)
    Path(f"{where}/{rank}").write_text(outcome)
    os._exit(0)


def test_a_rank_that_died_between_steps_is_named(tmp_path):
    """A dead rank's closed connections fail the barrier at once, gloo's message naming only an
    address: the ranks still there say which rank never arrived (each notes in the store where
    it arrived), long before the barrier's timeout."""
    t0 = time.monotonic()
    forked(_dying_rank, 3, str(tmp_path))
    said = [(tmp_path / str(r)).read_text() for r in (0, 1)]
    assert all(m.startswith("rank 2 never reached the barrier before step 2") for m in said), said
    # Rank 1's then gives gloo's gist (runtime/barrier.py's GLOO_GIST, a text of torch's):
    # were the text to change, its whole first line would follow, from gloo's source file.
    gist = said[1].split(": ", 1)[1]
    assert not gist.startswith("[") and "This is typically" not in gist, said
    assert time.monotonic() - t0 < BARRIER_TIMEOUT_S * 10 * BARRIER_SHARE, said


def _gone_while_gathering(rank: int, where: str, fault: str) -> None:
    """One rank of `test_a_rank_gone_after_the_barrier_is_named`: rank 2 passes the barrier
    and exits or stops before its part of the step's gather, as a rank killed or stopped
    there does."""
    dist.init_process_group(
        "gloo",
        init_method=f"file://{where}/store",
        rank=rank,
        world_size=3,
        timeout=timedelta(seconds=BARRIER_TIMEOUT_S),
    )
    step_barrier("before step 2", BARRIER_TIMEOUT_S * 10)
    if rank == 2:
        if fault == "exited":
            os._exit(1)
        os.kill(os.getpid(), signal.SIGSTOP)
    rows = [torch.empty(2) for _ in range(3)]
    try:
        dist.all_gather(rows, torch.zeros(2), async_op=True).wait()
        outcome = "passed"
    except RuntimeError as e:
        outcome = str(who_left(e, "while step 1's figures were gathered"))
    Path(f"{where}/{rank}").write_text(outcome)
    os._exit(0)


@pytest.mark.parametrize("fault", ["exited", "stopped"])
def test_a_rank_gone_after_the_barrier_is_named(tmp_path, fault):
    """Every rank's arrival is noted, so a rank gone after the barrier is not found by its
    note: the others look its process up (on this machine), which has exited (its connection
    closed) or is stopped (the gather times out)."""
    ctx = mp.get_context("fork")
    procs = [
        ctx.Process(target=_gone_while_gathering, args=(r, str(tmp_path), fault)) for r in range(3)
    ]
    for proc in procs:
        proc.start()
    for proc in procs[:2]:
        proc.join(timeout=60)
    procs[2].kill()
    procs[2].join(timeout=60)
    said = [(tmp_path / str(r)).read_text() for r in (0, 1)]
    assert all(
        re.fullmatch(rf"rank 2 {fault}.* while step 1's figures were gathered: .+", m) for m in said
    ), said


@pytest.mark.parametrize(
    "damage, message",
    [
        (
            lambda t: t.replace("F s=1 mb=3\n", "F s=1 mb=three\n"),
            r"rank_001.pipe:\d+: not an instruction",
        ),
        (lambda t: t.replace("version=1", "version=7"), "format version 7"),
        (
            lambda t: re.sub(r"plan=[0-9a-f]{16}", "plan=" + "0" * 16, t),
            "header does not match plan.json",
        ),
    ],
)
def test_a_corrupted_program_is_refused_before_any_communication(
    build, tmp_path, monkeypatch, capsys, damage, message
):
    copy = tmp_path / "b"
    copy.mkdir()
    for f in build.iterdir():
        if f.is_file():
            (copy / f.name).write_text(f.read_text())
    (copy / "rank_001.pipe").write_text(damage((copy / "rank_001.pipe").read_text()))
    assert re.search(message, said_by_rank_0(copy, monkeypatch, capsys))


def test_a_wrong_world_size_is_refused(build, monkeypatch, capsys):
    err = said_by_rank_0(build, monkeypatch, capsys, world=2)
    assert (
        "the plan has 4 pipeline ranks x 1 data-parallel copies = 4 ranks, but this run has 2"
        in err
    )


def test_an_op_without_handler_is_refused_naming_op_and_line(build, monkeypatch, capsys):
    handlers = {op: h for op, h in HANDLERS.items() if op is not Op.SEND_GRAD}
    err = refused(build, monkeypatch, capsys, rank=1, handlers=handlers)
    assert err.count("\n") == 1 and err.startswith("pipec runtime: rank 1: ")
    assert re.search(r"rank_001.pipe:\d+: op SEND_GRAD has no runtime handler", err)


def test_check_program_names_the_file_line(build):
    text = (build / "rank_000.pipe").read_text()
    line = next(n for n, t in enumerate(text.splitlines(), 1) if t.startswith("BW "))
    program = load(build).compiled.programs[0]
    handlers = {op: h for op, h in HANDLERS.items() if op is not Op.BW}
    with pytest.raises(PipecError, match=rf"^rank_000.pipe:{line}: op BW has no runtime handler"):
        check_program(program, handlers, "rank_000.pipe")
