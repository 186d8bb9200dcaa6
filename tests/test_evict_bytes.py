"""`--memory-limit` in bytes (issue 5): bytes of activation stash per rank, with a model.

Each stash weighs its stage's measured `stash_bytes`, on whichever rank holds it (the measure
of the simulator's `peak_stash_bytes`); a plain number still means stashes.
"""

import json

import pytest

from pipec.compile import compile_schedule
from pipec.ir import Op, PipecError
from pipec.passes.costs import CostModel
from pipec.passes.evict import EvictionPlanner
from pipec.passes.lower import lower
from pipec.passes.registry import Request, build_schedule
from pipec.passes.verify import VerifyError
from tests.test_cli import cli_run

# Uneven stages, so that a byte limit is not a stash limit in disguise: the acceptor of rank
# 0 (rank 3) holds its own heavy stashes and rank 0's light ones.
BYTES = CostModel(stash_bytes=(500.0, 400.0, 300.0, 700.0))


def byte_peaks(result) -> list[int]:
    return [r.peak_stash_bytes for r in result.sim.ranks]


def test_every_feasible_byte_limit_holds_on_every_rank():
    """From the smallest feasible limit up to the plain peak: each rank's simulated stash
    bytes stay within the limit, the program verifies, and fewer bytes move as it rises."""
    plain = compile_schedule("1f1b", 4, 8, costs=BYTES)
    assert byte_peaks(plain) == [2000, 1200, 600, 700]
    planner = EvictionPlanner(
        lower(build_schedule("1f1b", Request(4, 8, 1, BYTES)), BYTES), BYTES, in_bytes=True
    )
    smallest = planner.smallest_feasible()
    # Rank 0 keeps 3 of its 500 B stashes (its partner then holds its own 700 B and one of
    # rank 0's); keeping 2 would need the partner to hold 700 + 2 * 500 B at once.
    assert smallest == 1500
    moved = []
    for limit in (smallest, 1900, 2000):
        r = compile_schedule(
            "1f1b", 4, 8, costs=BYTES, evict=True, memory_limit=limit, limit_in_bytes=True
        )
        assert max(byte_peaks(r)) <= limit
        assert r.plan["memory_limit_bytes"] == limit and r.plan["memory_limit"] is None
        moved.append(sum(i.op is Op.EVICT for prog in r.compiled.programs for i in prog))
    assert moved[0] >= moved[1] > moved[2] == 0


def test_a_byte_limit_below_the_smallest_names_it_in_bytes():
    with pytest.raises(
        PipecError,
        match=r"--memory-limit 1499B .* smallest feasible limit is "
        r"1500B \(0.00143 MiB\)$",
    ):
        compile_schedule(
            "1f1b", 4, 8, costs=BYTES, evict=True, memory_limit=1499, limit_in_bytes=True
        )


def test_a_byte_limit_without_evict_is_checked_against_the_simulated_bytes():
    with pytest.raises(
        VerifyError,
        match="rank 0: 2000B of stash live at its peak, over the "
        "limit 1999B; raise --memory-limit or add --evict",
    ):
        compile_schedule("1f1b", 4, 8, costs=BYTES, memory_limit=1999, limit_in_bytes=True)
    assert compile_schedule("1f1b", 4, 8, costs=BYTES, memory_limit=2000, limit_in_bytes=True)


def test_a_byte_limit_needs_a_model(capsys):
    args = ("simulate", "-s", "1f1b", "-p", "4", "-m", "8", "--evict")
    assert cli_run(*args, "--memory-limit", "40GiB") == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "needs a MODEL" in err
    with pytest.raises(PipecError, match="needs a MODEL"):
        compile_schedule("1f1b", 4, 8, evict=True, memory_limit=3, limit_in_bytes=True)
    assert cli_run(*args, "--memory-limit", "3", "--json") == 0  # a plain number: stashes
    out = json.loads(capsys.readouterr().out)
    assert out["memory_limit"] == 3 and "memory_limit_bytes" not in out


def test_cli_byte_limit_with_the_tiny_gpt(tmp_path, capsys):
    """The measured stash bytes of examples/gpt.py:tiny (about 0.5 MiB per stage and
    micro-batch): 1.5 MiB is infeasible and the line names the smallest feasible in bytes;
    that figure compiles, verifies, and holds every rank."""
    model = ("examples/gpt.py:tiny", "-s", "1f1b", "-p", "4", "-m", "8", "--evict")
    assert cli_run("simulate", *model, "--memory-limit", "1.5MiB") == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--memory-limit 1572864B (1.5 MiB) is infeasible" in err
    smallest = err.split("smallest feasible limit is ")[1].split(" ")[0]  # e.g. 1587456B
    out = tmp_path / "b"
    assert cli_run("compile", *model, "--memory-limit", smallest, "-o", str(out)) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("evict: "))
    assert line.startswith(f"evict: limit {smallest} (") and "B) moved per iteration" in line
    stats = json.loads((out / "stats.json").read_text())
    assert max(r["peak_stash_bytes"] for r in stats["ranks"]) <= int(smallest[:-1])
    assert cli_run("verify", str(out)) == 0
    # Undo one stash move on both ranks: still a valid program, but rank 0 is over the limit.
    evict = next(
        x for x in (out / "rank_000.pipe").read_text().splitlines() if x.startswith("EVICT")
    )
    s, mb = evict.split()[1:3]
    for rank in (0, 3):
        f = out / f"rank_{rank:03d}.pipe"
        lines = f.read_text().splitlines(True)
        moves = {(op, s, mb) for op in ("EVICT", "ACCEPT", "LOAD", "RETURN")}
        f.write_text("".join(x for x in lines if tuple(x.split()[:3]) not in moves))
    capsys.readouterr()
    assert cli_run("verify", str(out)) == 2
    assert f"of stash live at its peak, over the limit {smallest}" in capsys.readouterr().err


def test_a_byte_limit_at_bf16_prices_half_the_stash(tmp_path, capsys):
    """`pipec compile --precision bf16` prices the stash bytes of a bf16 run (half an fp32
    model's, as `pipec plan --precision bf16` does): 0.8 MiB, infeasible at fp32 (the smallest
    there is 1.51 MiB), compiles, verifies and holds every rank; the plan says what it priced,
    and an fp32 plan carries no such key (its hash unchanged)."""
    model = ("examples/gpt.py:tiny", "-s", "1f1b", "-p", "4", "-m", "8", "--evict")
    fp32, bf16 = tmp_path / "fp32", tmp_path / "bf16"
    assert cli_run("compile", *model, "--memory-limit", "0.8MiB", "-o", str(fp32)) == 2
    assert "smallest feasible limit is 1587456B" in capsys.readouterr().err
    assert not fp32.exists()
    assert cli_run("compile", *model, "--memory-limit", "1.6MiB", "-o", str(fp32)) == 0
    args = ("--memory-limit", "0.8MiB", "--precision", "bf16", "-o", str(bf16))
    assert cli_run("compile", *model, *args) == 0
    assert "evict: limit 838860B (0.8 MiB) of bf16 stash per rank" in capsys.readouterr().out
    assert cli_run("verify", str(bf16)) == 0
    plans = {p: json.loads((p / "plan.json").read_text()) for p in (fp32, bf16)}
    assert "precision" not in plans[fp32] and plans[bf16]["precision"] == "bf16"
    halves = [b / 2 for b in plans[fp32]["costs"]["stash_bytes"]]
    assert plans[bf16]["costs"]["stash_bytes"] == halves
    stats = json.loads((bf16 / "stats.json").read_text())
    assert max(r["peak_stash_bytes"] for r in stats["ranks"]) <= 0.8 * 2**20


def test_precision_prices_a_model_only(tmp_path, capsys):
    out = ("--precision", "bf16", "-o", str(tmp_path / "x"))
    assert cli_run("compile", "-s", "1f1b", "-p", "4", "-m", "8", *out) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--precision bf16 prices a MODEL's stash bytes" in err
    # A plan profile prices the build as `pipec plan` did (its own --precision).
    planned = ("--micro-batch-size", "2", "--plan-profile", str(tmp_path / "profile.json"))
    assert cli_run("compile", "examples/gpt.py:tiny", "-s", "1f1b", "-p", "4", "-m", "8",
                   *planned, *out) == 2  # fmt: skip
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.rstrip().endswith("drop --precision")
    assert not (tmp_path / "x").exists()
