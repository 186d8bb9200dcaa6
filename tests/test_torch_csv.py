"""torch-csv without torch: the format, export -> import round trips, refusals, the CLI."""

import re

import pytest

from pipec.interop import compile_torch_csv
from pipec.ir import COMPUTE_OPS, Instr, Op, PipecError
from pipec.passes.costs import CostModel
from pipec.passes.from_torch import schedule_from_torch
from pipec.passes.registry import SCHEDULES, family
from pipec.passes.to_torch import torch_rows
from pipec.torch_csv import Action, parse_cell, read_csv, write_csv
from tests.helpers import run
from tests.test_cli import cli_run

family("1f1b")  # registers the built-in families

#: Ops torch's runtime has no action for; a build holding one must be refused by name.
UNEXPORTABLE = {"RECOMPUTE", "EVICT", "LOAD", "ACCEPT", "RETURN", "ALLREDUCE_GRADS"}
SHAPES = [(4, 8, None), (3, 6, None), (2, 4, 3), (4, 12, 2)]


def compute_orders(programs):
    return tuple(tuple(i for i in prog if i.op in COMPUTE_OPS) for prog in programs)


def test_cells_parse_and_print_like_torch():
    assert parse_cell("2F0", "x") == (Action(2, "F", 0),)
    assert parse_cell(" 11SEND_B13 ", "x") == (Action(11, "SEND_B", 13),)
    assert parse_cell("0REDUCE_GRAD", "x") == (Action(0, "REDUCE_GRAD"),)
    assert parse_cell("(4F4;3B0)OVERLAP_F_B", "x") == (Action(4, "F", 4), Action(3, "B", 0))
    assert parse_cell("", "x") == ()
    rows = [[(Action(0, "F", 0),), (Action(0, "I", 0),)], [(Action(1, "F", 0), Action(1, "B", 0))]]
    text = write_csv(rows)
    assert text == "0F0,0I0\r\n(1F0;1B0)OVERLAP_F_B\r\n"
    assert read_csv(text, "t") == rows


@pytest.mark.parametrize(
    "cell, message",
    [
        ("F0", "cannot read action 'F0'"),
        ("0X1", "cannot read action '0X1'"),
        ("0F", "F needs a micro-batch index"),
        ("0REDUCE_GRAD3", "REDUCE_GRAD takes no micro-batch"),
        ("(0F0;0SEND_F0)OVERLAP_F_B", "OVERLAP_F_B must hold compute actions only"),
        ("0F0junk", "cannot read action"),
    ],
)
def test_bad_cells_are_named(cell, message):
    with pytest.raises(PipecError, match="f.csv: rank 1, column 0") as e:
        read_csv(f"0F0\n{cell}\n", "f.csv")
    assert message in str(e.value)


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_export_import_round_trip_every_family(name):
    """Every family either comes back with identical compute orders and layout through both
    CSV forms, or is refused by export naming an op or a layout torch cannot run."""
    ran = 0
    for p, m, v in SHAPES:
        try:
            result = run(name, p, m, v)
        except PipecError as e:
            assert "VerifyError" not in type(e).__name__
            continue  # the family does not take this shape
        c = result.compiled
        ops = {i.op.value for prog in c.programs for i in prog}
        try:
            rows = {comms: torch_rows(c, comms) for comms in (False, True)}
        except PipecError as e:
            assert ops & UNEXPORTABLE or "pipeline" in str(e) or "replicas" in str(e), str(e)
            ran += 1
            continue
        assert not ops & UNEXPORTABLE
        for comms, r in rows.items():
            back = schedule_from_torch("t", read_csv(write_csv(r), "t.csv"), "t.csv")
            assert back.orders == compute_orders(c.programs), (name, p, m, comms)
            assert (back.layout, back.p, back.m, back.v) == (c.layout, c.p, c.m, c.v)
        ran += 1
    assert ran, f"{name} took none of the shapes {SHAPES}"


def test_recompute_is_refused_by_name():
    c = run("1f1b-r", 4, 8).compiled
    with pytest.raises(PipecError, match=r"RECOMPUTE s=0 mb=0\): torch's runtime has no RECOMPUTE"):
        torch_rows(c, comms=False)


def test_comms_rows_map_messages_and_end_with_reduce_grad():
    c = run("interleaved", 2, 4, 2).compiled
    rows = torch_rows(c, comms=True)
    assert [str(a) for (a,) in rows[1][-2:]] == ["1REDUCE_GRAD", "3REDUCE_GRAD"]
    kinds = {a.type for row in rows for (a,) in row}
    assert kinds == {"F", "B", "SEND_F", "RECV_F", "SEND_B", "RECV_B", "REDUCE_GRAD"}
    first = rows[1][0][0]  # rank 1 starts by receiving stage 1's input from rank 0
    assert (first.stage, first.type, first.mb) == (1, "RECV_F", 0)


def test_split_backward_maps_to_input_and_weight():
    """B/W of pipec are torch's I/W; a full torch B stays one fused BW in a split schedule."""
    rows = [
        [(Action(0, "F", 0),), (Action(0, "B", 0),)],
        [(Action(1, "F", 0),), (Action(1, "I", 0),), (Action(1, "W", 0),)],
    ]
    sched = schedule_from_torch("t", rows, "t")
    assert sched.orders == (
        (Instr(Op.F, 0, 0), Instr(Op.BW, 0, 0)),
        (Instr(Op.F, 1, 0), Instr(Op.B, 1, 0), Instr(Op.W, 1, 0)),
    )
    fused = schedule_from_torch("t", [[(Action(0, "F", 0),), (Action(0, "B", 0),)]], "t")
    assert fused.orders == ((Instr(Op.F, 0, 0), Instr(Op.BW, 0, 0)),)


def test_v_placement_is_inferred_from_who_runs_what(tmp_path):
    f = tmp_path / "v.csv"
    f.write_text("0F0,3F0,3B0,0B0\n1F0,2F0,2B0,1B0\n")
    result = compile_torch_csv(f, CostModel())
    assert result.compiled.layout.stage_rank == (0, 1, 1, 0)
    assert result.compiled.schedule == "torch-csv:v" and result.compiled.v == 2


@pytest.mark.parametrize(
    "text, message",
    [
        ("", "empty; expected one row of actions per pipeline rank"),
        ("0F0,0B0\n0F1,0B1\n", "stage 0 runs on rank 0 and rank 1"),
        ("0F0,0B0\n2F0,2B0\n", r"stage\(s\) \[1\] never run"),
        ("0F0,0B0\n\n1F0,1B0\n", "rank 1 runs no compute action"),
        ("0F0,0B0\n1RESHARD\n", "rank 1 runs no compute action"),
        (
            "0F0,0B0,3F0,3B0\n1F0,1B0\n2F0,2B0\n",
            r"ranks hold different numbers of stages \(\[2, 1, 1\]\)",
        ),
        (
            "0F0,0F2,0B0,0B2\n",
            r"stage 0 runs forwards for micro-batches \[0, 2\]; expected each of 0..2",
        ),
        (
            "0F0,0B0,0F1,0B1\n1F1,1B1,1F0,1B0\n",
            "the imported order does not compile: the schedule cannot finish",
        ),
        ("0F0,0B0\n1B0,1F0\n", "the imported order does not compile"),
        ("0F0,0I0,0B0\n", "does not compile"),
    ],
)
def test_bad_csv_is_one_line_and_exit_2(tmp_path, capsys, text, message):
    f = tmp_path / "bad.csv"
    f.write_text(text)
    assert cli_run("simulate", "--from-torch-csv", str(f)) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert str(f) in err
    assert re.search(message, err), err


def test_cli_export_then_compile_from_the_csv(tmp_path, capsys):
    assert (
        cli_run("compile", "-s", "interleaved", "-p", "4", "-m", "8", "-o", str(tmp_path / "b"))
        == 0
    )
    csv = tmp_path / "i.csv"
    assert cli_run("export", str(tmp_path / "b"), "--format", "torch-csv", "--out", str(csv)) == 0
    assert "format='compute_only'" in capsys.readouterr().out
    assert csv.read_text().startswith("0F0,0F1,0F2,0F3,4F0,")
    out = tmp_path / "again"
    assert cli_run("compile", "--from-torch-csv", str(csv), "-p", "4", "-o", str(out)) == 0
    assert "makespan 28.5" in capsys.readouterr().out  # F=B=W=1 a rank's share: 1/2 a chunk
    assert cli_run("verify", str(out)) == 0
    assert cli_run("export", str(out), "--out", "-", "--comms") == 0
    assert "4SEND_F0" in capsys.readouterr().out


@pytest.mark.parametrize(
    "args, message",
    [
        (["-p", "4", "-m", "8"], "give one of --schedule, --from-torch or --from-torch-csv"),
        (["-s", "1f1b", "--from-torch", "Schedule1F1B", "-p", "4", "-m", "8"], "give one of"),
        (["--from-torch", "Schedule1F1B", "-m", "8"], "Missing option '--pp'"),
        (
            ["--from-torch-csv", "/nonexistent.csv"],
            "--from-torch-csv /nonexistent.csv: cannot read it",
        ),
    ],
)
def test_bad_source_options(args, message, capsys):
    assert cli_run("simulate", *args) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_csv_shape_must_match_given_options(tmp_path, capsys):
    f = tmp_path / "a.csv"
    f.write_text("0F0,0B0\n1F0,1B0\n")
    assert cli_run("simulate", "--from-torch-csv", str(f), "-m", "2") == 2
    assert "--microbatches 2 does not match" in capsys.readouterr().err


def test_export_refusal_is_one_line(tmp_path, capsys):
    assert cli_run("compile", "-s", "1f1b-r", "-p", "2", "-m", "2", "-o", str(tmp_path / "b")) == 0
    assert cli_run("export", str(tmp_path / "b"), "--out", str(tmp_path / "x.csv")) == 2
    err = capsys.readouterr().err
    assert "cannot export to torch-csv" in err and "RECOMPUTE" in err and err.count("\n") == 1
    assert not (tmp_path / "x.csv").exists()
