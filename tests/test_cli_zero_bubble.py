"""The CLI with the zero-bubble and V-shape families: --mem units; bad input is one line, exit 2."""

import json

import pytest

from tests.test_cli import cli_run as cli


def test_zb_1p_in_mem_units_matches_table5(capsys):
    """1.5B, m=24: memory per F = 34h+5as, per W = -32h (h=2304, a=24, s=1024); cap = p·F."""
    args = ["--costs", "F=18522,B=18086,W=9337,comm=601", "--mem", "F=201216,W=-73728"]
    code = cli(
        "simulate",
        "-s",
        "zb-auto",
        "-p",
        "8",
        "-m",
        "24",
        *args,
        "--memory-limit",
        str(8 * 201216),
        "--json",
    )
    assert code == 0
    assert round(json.loads(capsys.readouterr().out)["span_bubble"], 4) == 0.1585


@pytest.mark.parametrize(
    "args, message",
    [
        (["-s", "v-min", "-p", "1", "-m", "4"], "v-min: --pp must be at least 2 for a V placement"),
        (["-s", "v-half", "-p", "4", "-m", "1"], "v-half: --microbatches must be at least 2"),
        (
            ["-s", "zb-v", "-p", "4", "-m", "8", "-v", "3"],
            "zb-v: --chunks 3 is not allowed; it takes 2",
        ),
        (
            ["-s", "zb-auto", "-p", "4", "-m", "8", "--costs", "F=1,B=0,W=1"],
            "zb-auto: --costs B must be positive (got 0)",
        ),
        (
            ["-s", "zb-auto", "-p", "4", "-m", "8", "--costs", "F=1,B=1,W=-1"],
            "--costs W must not be negative",
        ),
        (
            ["-s", "zb-auto", "-p", "4", "-m", "8", "--memory-limit", "0.5"],
            "zb-auto: --memory-limit 0.5 is below the smallest feasible, 1",
        ),
        (
            ["-s", "v-adaptive", "-p", "8", "-m", "16", "--memory-limit", "3"],
            "--memory-limit 3 is below the smallest feasible at p=8, m=16: 4",
        ),
        (
            ["-s", "zb-h2", "-p", "4", "-m", "8", "--memory-limit", "4"],
            "zb-h2 peaks at 7 stashes at p=4, m=8: --memory-limit 4 is below it; use at least 7",
        ),
        (
            ["-s", "v-min", "-p", "4", "-m", "8", "--memory-limit", "1.5"],
            "v-min peaks at 2 stashes at p=4, m=8: --memory-limit 1.5 is below it; use at least 2",
        ),
    ],
)
def test_bad_input_is_one_line_and_exit_2(args, message, capsys):
    assert cli("simulate", *args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("pipec: error: ") and message in err
