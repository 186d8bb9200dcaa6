"""A deadlock is explained: the verifier names the whole cycle of ranks waiting on each other,
each with its instruction and what it waits for."""

from dataclasses import replace

import pytest

from pipec.ir import Instr, Op
from pipec.passes.verify import VerifyError, verify
from tests.helpers import run
from tests.test_cli import cli_run


def moved(program, instr: Instr, after: Instr | None) -> tuple:
    """`program` with `instr` moved right after `after` (to the front when None)."""
    rest = [i for i in program if i != instr]
    at = 0 if after is None else rest.index(after) + 1
    return tuple(rest[:at] + [instr] + rest[at:])


def with_program(result, rank: int, program):
    programs = list(result.compiled.programs)
    programs[rank] = program
    return replace(result.compiled, programs=tuple(programs))


def test_two_rank_cycle():
    """1F1B, rank 0 sends mb 1 before mb 0: it waits for rank 1 to take mb 1, rank 1 waits
    for mb 0; the two other ranks wait behind them."""
    base = run("1f1b", 4, 8)
    send0, send1 = Instr(Op.SEND_ACT, 0, 0, 1), Instr(Op.SEND_ACT, 0, 1, 1)
    broken = with_program(base, 0, moved(base.compiled.programs[0], send0, send1))
    with pytest.raises(VerifyError) as e:
        verify(broken, base.costs)
    assert str(e.value) == (
        "deadlock under blocking send/recv: ranks 0 -> 1 -> 0 wait on each other in a cycle: "
        "rank 0, instruction 2 (SEND_ACT s=0 mb=1 to=1) waits for rank 1 to reach "
        "RECV_ACT s=1 mb=1 from=0; "
        "rank 1, instruction 0 (RECV_ACT s=1 mb=0 from=0) waits for rank 0 to reach "
        "SEND_ACT s=0 mb=0 to=1 (2 more blocked ranks wait on these)"
    )


def test_three_rank_cycle():
    """Interleaved on 3 ranks: stage 3 (rank 0) takes its input from stage 2 (rank 2). With
    that receive first on rank 0, each rank waits for the one before it in the ring."""
    base = run("interleaved", 3, 3, 2)
    recv = Instr(Op.RECV_ACT, 3, 0, 2)
    broken = with_program(base, 0, moved(base.compiled.programs[0], recv, None))
    with pytest.raises(VerifyError) as e:
        verify(broken, base.costs)
    assert str(e.value) == (
        "deadlock under blocking send/recv: ranks 0 -> 2 -> 1 -> 0 wait on each other in a "
        "cycle: "
        "rank 0, instruction 0 (RECV_ACT s=3 mb=0 from=2) waits for rank 2 to reach "
        "SEND_ACT s=2 mb=0 to=0; "
        "rank 2, instruction 0 (RECV_ACT s=2 mb=0 from=1) waits for rank 1 to reach "
        "SEND_ACT s=1 mb=0 to=2; "
        "rank 1, instruction 0 (RECV_ACT s=1 mb=0 from=0) waits for rank 0 to reach "
        "SEND_ACT s=0 mb=0 to=1"
    )


def test_waiting_on_a_finished_rank():
    """No cycle: rank 0 waits for a gradient rank 1 never sends (its program has ended)."""
    base = run("1f1b", 2, 2)
    send = Instr(Op.SEND_GRAD, 1, 1, 0)
    broken = with_program(base, 1, tuple(i for i in base.compiled.programs[1] if i != send))
    with pytest.raises(VerifyError, match=r"deadlock") as e:
        verify(broken, base.costs)
    assert str(e.value).endswith(
        "waits for rank 1 to reach SEND_GRAD s=1 mb=1 to=0, but rank 1 has finished its "
        "program without it"
    )


def test_verify_and_show_name_the_cycle_of_a_deadlocking_build(tmp_path, capsys):
    out = tmp_path / "b"
    assert cli_run("compile", "-s", "interleaved", "-p", "3", "-m", "3", "-o", str(out)) == 0
    f = out / "rank_000.pipe"
    lines = f.read_text().splitlines(keepends=True)  # two header lines, then instructions
    recv = "RECV_ACT s=3 mb=0 from=2\n"
    lines.remove(recv)
    f.write_text("".join([*lines[:2], recv, *lines[2:]]))
    capsys.readouterr()
    for cmd, prefix in (("verify", ""), ("show", "this build is broken: ")):
        assert cli_run(cmd, str(out)) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1
        assert f"pipec: error: {prefix}deadlock under blocking send/recv: ranks 0 -> 2 -> 1" in err
