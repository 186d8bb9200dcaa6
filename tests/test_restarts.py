"""A run that survives faults by itself: `pipec run --max-restarts N` restarts the ranks after a
rank is killed or hangs, from the newest intact checkpoint the run wrote, and ends with the
tensors of an uninterrupted run, bit for bit; the failure lines, the exit code once the
restarts are spent, and where a restarted rank resumes.

Three `pipec run`s: an uninterrupted one; one whose rank 1 is SIGKILLed from outside (by pid,
once training is under way) and whose rank 0 then stops itself (SIGSTOP, injected with the
test-only PIPEC_FAULT, runtime/inject.py) in the next attempt; one whose restarts run out.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from pipec import checkpoint
from pipec.build_dir import emit, load
from pipec.checkpoint_lineage import Lineage, newest_of_run
from pipec.model import compile_model
from pipec.runtime.agent import _state
from pipec.runtime.failures import Failure, RankEnd
from pipec.runtime.inject import FAULT
from pipec.runtime.restart import resume_from
from pipec.runtime.torchrun import _descendants, torchrun
from tests.test_hostile import saved

ROOT = Path(__file__).resolve().parents[1]
DATA = f"{ROOT}/tests/train_factories.py:copying"
STEPS = 16
# How long a rank waits on a hung peer: the stopped rank is found this long after it stopped.
TIMEOUT_S = "8"


@pytest.fixture(scope="module")
def build(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("restarts") / "build"
    emit(compile_model(DATA, "1f1b", 2, 4), out)
    return out


class Run:
    """`pipec run BUILD ARGS` with its output collected as it comes, and every process under
    it seen while it ran (with whether one was seen stopped)."""

    def __init__(self, build: Path, *args: str, env: dict[str, str] | None = None) -> None:
        cmd = [sys.executable, "-m", "pipec", "run", str(build), "--threads", "1", *args]
        self.proc = subprocess.Popen(
            cmd,
            env=torchrun(build / "launch.py", 1)[1] | (env or {}),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.out: list[str] = []
        self.err: list[str] = []
        self.seen: set[int] = set()
        self.stopped_seen = False
        self._threads = [
            threading.Thread(target=self._read, args=(self.proc.stdout, self.out)),
            threading.Thread(target=self._read, args=(self.proc.stderr, self.err)),
            threading.Thread(target=self._watch),
        ]
        for t in self._threads:
            t.start()

    def _read(self, stream, lines: list[str]) -> None:  # type: ignore[no-untyped-def]
        lines.extend(stream)

    def _watch(self) -> None:
        while self.proc.poll() is None:
            for pid in _descendants(self.proc.pid):
                self.seen.add(pid)
                self.stopped_seen |= _state(pid) == "T"
            time.sleep(0.05)

    def rank_pid(self, rank: int) -> int:
        """The pid of the process of `rank` (the newest attempt's)."""
        for pid in sorted(_descendants(self.proc.pid), reverse=True):
            try:
                environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if f"RANK={rank}".encode() in environ:
                return pid
        raise AssertionError(f"no process of rank {rank}")

    def wait_for(self, pattern: str) -> None:
        while not any(re.match(pattern, line) for line in self.out):
            assert self.proc.poll() is None, "".join(self.err)[-3000:]
            time.sleep(0.02)

    def finish(self) -> int:
        code = self.proc.wait(timeout=300)
        for t in self._threads:
            t.join()
        return code


def _tensors(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor of `directory`'s newest intact checkpoint, by key."""
    path = checkpoint.latest(directory)
    saved_manifest = checkpoint.manifest(path)
    return checkpoint.read(path, sorted(saved_manifest["tensors"]), saved_manifest)


@pytest.fixture(scope="module")
def uninterrupted(build, tmp_path_factory) -> dict[str, torch.Tensor]:
    ck = tmp_path_factory.mktemp("whole") / "ck"
    run = Run(build, "--steps", str(STEPS), "--save", str(ck), "--timeout", TIMEOUT_S)
    assert run.finish() == 0, "".join(run.err)[-3000:]
    return _tensors(ck)


@pytest.mark.slow
def test_a_killed_and_a_hung_rank_are_restarted_to_the_uninterrupted_end(
    build, tmp_path, uninterrupted
):
    """Rank 1 SIGKILLed from outside once training is under way, then (the restart's fault,
    injected) rank 0 stopping itself at step 13: each failure is one line, each restart
    resumes from the newest checkpoint the run completed, the run ends by itself with exit 0,
    no process of it is left (the stopped one killed), and its last checkpoint holds the
    tensors of the uninterrupted run, bit for bit: the data went on where it stopped."""
    ck = tmp_path / "ck"
    run = Run(
        build, "--steps", str(STEPS), "--save", str(ck), "--save-every", "2",
        "--max-restarts", "2", "--timeout", TIMEOUT_S, env={FAULT: ",0:13:stop"},
    )  # fmt: skip
    run.wait_for(r"step +2/")
    os.kill(run.rank_pid(1), signal.SIGKILL)
    code = run.finish()
    err = "".join(run.err)
    assert code == 0, err[-3000:]
    said = re.findall(r"^pipec run: (rank .*)$", err, re.MULTILINE)
    assert len(said) == 2, err[-3000:]
    assert re.fullmatch(r"rank 1 killed \(SIGKILL\) at step \d+; restart 1 of 2 from .*", said[0])
    hung = "rank 0 hung (its process stopped, killed) at step 13; restart 2 of 2 from "
    assert said[1].startswith(hung), said
    # A restart resumes from the newest checkpoint complete when it failed (the one of the
    # step just before a fault may still have been in writing): as its ranks say.
    froms = [re.search(r"from (?:step (\d+)|the start)$", line)[1] for line in said]
    resuming = re.compile(r"^resuming from \S+ \(step (\d+)\)$", re.MULTILINE)
    resumed = resuming.findall("".join(run.out))
    assert [f for f in froms if f] == resumed and froms[1] in ("10", "12"), (said, resumed)
    assert run.stopped_seen and not [p for p in run.seen if _state(p)], "a process is left"
    assert "Traceback" not in err and "ChildFailedError" not in err
    final = _tensors(ck)
    assert final.keys() == uninterrupted.keys()
    assert all(torch.equal(final[k], uninterrupted[k]) for k in final)
    lines = (build / "measured" / "metrics.jsonl").read_text().splitlines()
    steps = [json.loads(line)["step"] for line in lines]  # every attempt's, in turn
    assert sorted(set(steps)) == list(range(1, STEPS + 1)) and steps[-1] == STEPS


@pytest.mark.slow
def test_once_the_restarts_are_spent_the_failure_ends_the_run(build, tmp_path):
    """Rank 1 killed at step 3 in both attempts (injected), one restart: the second failure
    says no restart is left, the run exits with its code (128 + SIGKILL) and says last why a
    rank failed."""
    run = Run(
        build, "--steps", str(STEPS), "--save", str(tmp_path / "ck"), "--max-restarts", "1",
        "--timeout", TIMEOUT_S, env={FAULT: "1:3:kill,1:3:kill"},
    )  # fmt: skip
    code = run.finish()
    err = "".join(run.err)
    assert code == 128 + signal.SIGKILL, err[-3000:]
    said = re.findall(r"^pipec run: (.*)$", err, re.MULTILINE)
    assert said[-3:-1] == [
        "rank 1 killed (SIGKILL) at step 3; restart 1 of 1 from the start",
        "rank 1 killed (SIGKILL) at step 3; no restart left (1 used)",
    ], err[-3000:]
    assert said[-1].startswith("rank 0: "), said


# -- records, lines and where a restart resumes ---------------------------------------------------


KILLED = RankEnd(1, -9, ended=True)
WAITED = RankEnd(0, 3, ended=True, message="rank 0: F s=0 mb=1 (rank_000.pipe:3): timeout", step=7)


@pytest.mark.parametrize(
    "ranks, restart, line, code",
    [
        (
            (WAITED, KILLED),
            1,
            "rank 1 killed (SIGKILL) at step 7; restart 1 of 3 from step 6",
            128 + signal.SIGKILL,
        ),
        (
            (WAITED, RankEnd(1, -9, stopped=True)),
            None,
            "rank 1 hung (its process stopped, killed) at step 7; no restart left (3 used)",
            3,
        ),
        (
            (WAITED, RankEnd(1, -15)),  # SIGTERM: torchrun's stop, after rank 0 ended
            2,
            (
                "rank 0 exited with code 3 at step 7: F s=0 mb=1 (rank_000.pipe:3): timeout; "
                "restart 2 of 3 from step 6"
            ),
            3,
        ),
        (
            (RankEnd(0, 2, ended=True), RankEnd(1, 2, ended=True)),
            None,
            "rank 0 exited with code 2; no restart left (3 used)",
            2,
        ),
    ],
)
def test_a_failure_is_one_line_and_a_code(ranks, restart, line, code):
    failure = Failure(ranks, restart, 3)
    assert Failure.parse(failure.to_line()) == failure
    assert failure.line(6) == line
    assert failure.code() == code
    assert Failure.parse("pipec runtime: rank 0: F s=0 mb=0: no record\n") is None


def test_a_restart_resumes_from_its_runs_newest_intact_checkpoint(build, tmp_path):
    """The run's own newest checkpoint that verifies: not another run's, not a damaged one,
    never a partial one; without any, where the run began."""
    plan = load(build)
    ours, theirs = (Lineage.new(plan.plan, plan.plan_hash, None, run) for run in ("a", "b"))
    ck = tmp_path / "ck"
    assert resume_from(ck, None, "a") is None  # missing: from the start
    saved(ck, 2, ours)
    saved(ck, 4, ours)
    saved(ck, 6, theirs)
    damaged = saved(ck, 8, ours)
    (ck / ".step_000010.partial").mkdir()
    data = next(damaged.glob("*.safetensors"))
    data.write_bytes(data.read_bytes()[:-8] + b"\xff" * 8)  # its last tensor changed
    assert newest_of_run(ck, "a") == ck / "step_000004"
    assert resume_from(ck, None, "b") == ck / "step_000006"
    assert resume_from(ck, tmp_path / "elsewhere", "c") == tmp_path / "elsewhere"
