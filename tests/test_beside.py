"""`beside`: half of a large compile on the other core, with the same results and errors."""

import os
import signal
import tempfile
from pathlib import Path

import pytest

from pipec import beside as beside_module
from pipec import build_dir
from pipec.beside import beside
from pipec.build_dir import emit
from pipec.compile import package
from pipec.ir import Compiled, Op, PipecError
from pipec.passes.verify import VerifyError
from tests.helpers import run

FORKED = beside_module.MIN_FORKED_WORK  # work at which beside forks


def test_the_child_runs_and_its_effects_are_seen(tmp_path):
    marker = tmp_path / "done"
    with beside(lambda: marker.write_text(str(os.getpid())), FORKED):
        pass
    assert marker.read_text() != str(os.getpid())  # written by another process


def test_an_error_in_the_child_is_raised_here():
    def fail():
        raise VerifyError("rank 3 at 7 (F s=3 mb=0): needs F s=2 mb=0")

    with pytest.raises(VerifyError, match="rank 3 at 7"), beside(fail, FORKED):
        pass


def test_an_error_that_does_not_pickle_comes_back_as_text():
    class Local(Exception):  # a local class cannot be unpickled
        pass

    def fail():
        raise Local("no pickle")

    with pytest.raises(RuntimeError, match="Local: no pickle"), beside(fail, FORKED):
        pass


def test_a_child_that_dies_is_named():
    die = lambda: os.kill(os.getpid(), signal.SIGKILL)
    with pytest.raises(RuntimeError, match="died .killed by SIGKILL"), beside(die, FORKED):
        pass


def test_the_blocks_error_comes_first_and_the_child_is_stopped(tmp_path):
    marker = tmp_path / "late"

    def slow():
        import time

        time.sleep(30)
        marker.write_text("ran")

    with pytest.raises(KeyError), beside(slow, FORKED):
        raise KeyError("block")
    assert not marker.exists()


def test_small_work_runs_here_after_the_block():
    seen = []
    with beside(lambda: seen.append(("fn", os.getpid())), FORKED - 1):
        seen.append(("block", os.getpid()))
    assert seen == [("block", os.getpid()), ("fn", os.getpid())]


@pytest.fixture
def always_fork(monkeypatch):
    monkeypatch.setattr(beside_module, "MIN_FORKED_WORK", 0)


def test_forked_compile_and_emit_write_the_same_files(always_fork, monkeypatch):
    result = run("zb-h1", 4, 8)
    with tempfile.TemporaryDirectory() as d:
        emit(result, Path(d) / "forked")
        monkeypatch.setattr(beside_module, "MIN_FORKED_WORK", 10**9)
        emit(run("zb-h1", 4, 8), Path(d) / "inline")
        names = sorted(p.name for p in (Path(d) / "forked").iterdir())
        assert names == sorted(p.name for p in (Path(d) / "inline").iterdir())
        for name in names:
            forked, inline = Path(d) / "forked" / name, Path(d) / "inline" / name
            assert forked.read_bytes() == inline.read_bytes()


def test_a_forked_compile_still_catches_a_deadlock(always_fork):
    good = run("1f1b", 4, 8).compiled
    prog = list(good.programs[1])
    first_recv = next(k for k, i in enumerate(prog) if i.op is Op.RECV_ACT)
    # Rank 1 sends its first activation before it has received (and computed) it.
    send = next(k for k, i in enumerate(prog) if i.op is Op.SEND_ACT)
    prog[first_recv], prog[send] = prog[send], prog[first_recv]
    programs = (good.programs[0], tuple(prog), *good.programs[2:])
    bad = Compiled(good.schedule, good.p, good.m, good.v, good.layout, programs)
    with pytest.raises(VerifyError, match=r"rank 1, instruction 0 .*: sends what is not computed"):
        package(bad)


def test_a_failed_forked_emit_leaves_no_directory(always_fork, tmp_path, monkeypatch):
    result = run("1f1b", 4, 8)

    def broken(directory, res, half):
        if half == 0:
            raise OSError("disk full")
        return original(directory, res, half)

    original = build_dir._write
    monkeypatch.setattr(build_dir, "_write", broken)
    with pytest.raises(
        PipecError, match=r"--out .*/out: cannot write the build there \(disk full\)"
    ):
        emit(result, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    assert [p.name for p in tmp_path.iterdir()] == []
