"""How pipec starts torchrun: this interpreter's torch.distributed.run, on a free port; and
`pipec run BUILD`, which runs a build under it and says last what went wrong.

`--standalone` lets torchrun pick a free rendezvous port, so runs (and tests of several
engineers on one machine) never collide on a fixed one; the checkout goes on PYTHONPATH so a
fresh clone runs without installing pipec.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from pipec.ir import PipecError

CHECKOUT = Path(__file__).resolve().parents[1]


def torchrun(script: Path, nproc: int, *args: str) -> tuple[list[str], dict[str, str]]:
    """The command line and environment that run `script` on `nproc` local ranks."""
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        "--nproc-per-node", str(nproc), str(script), *args,
    ]  # fmt: skip
    path = os.pathsep.join(filter(None, [str(CHECKOUT), os.environ.get("PYTHONPATH")]))
    return cmd, os.environ | {"PYTHONPATH": path}


_EXITCODE = re.compile(r"exitcode\s*:\s*(-?\d+)")
_MESSAGE = "pipec runtime: "


def run_build(build: Path, nproc: int | None, args: Sequence[str]) -> int:
    """Train `build` under torchrun on this machine; its output passes through as it comes.

    On failure torchrun ends with its own report (a ChildFailedError traceback and a table of
    failed ranks) below the line a rank printed to say what went wrong. Once a rank has said
    why, that report is condensed to one line (`_Condense`); without such a line it passes
    through whole, since it is then all there is. The rank's line is repeated last, as
    `pipec run: ...`, and the first failed rank's exit code returned (2: bad input, nothing
    ran; 3: a fault during the run; 1: --check-grads found a difference).
    """
    plan_file = Path(build) / "plan.json"
    if not (Path(build) / "launch.py").is_file() or not plan_file.is_file():
        raise PipecError(
            f"{build}: no launch.py here; compile a model with `pipec compile MODEL ... --out DIR`"
        )
    plan = json.loads(plan_file.read_text())
    nproc = nproc or plan["world"] * plan.get("dp", 1)
    cmd, env = torchrun(Path(build) / "launch.py", nproc, *args)
    print(
        f"pipec run: {nproc} ranks under torchrun; each reads and verifies {build}, rebuilds its "
        f"stages from {plan['model']['spec']}, then runs its program",
        file=sys.stderr,
        flush=True,
    )
    proc = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, text=True)
    messages, codes = [], []
    condense = _Condense()
    for line in proc.stderr:
        if _MESSAGE in line:
            messages.append(line[line.index(_MESSAGE) + len(_MESSAGE) :].strip())
        elif m := _EXITCODE.search(line):
            codes.append(int(m[1]))
        sys.stderr.write(condense(line, bool(messages)))
    sys.stderr.write(condense.rest())
    code = proc.wait()
    if code == 0:
        return 0
    said = messages[0] if messages else "a rank failed without a message; see torchrun's report"
    print(f"pipec run: {said}", file=sys.stderr, flush=True)
    return codes[0] if codes and codes[0] > 0 else code


class _Condense:
    """torchrun's failure report as one line, once a rank has said why it failed.

    The report is its launcher's traceback, ending in `ChildFailedError:`, then a table of the
    failed ranks between two `====` rules. A traceback is held back until its exception line
    shows whose it is: a rank's own (or any other) is written out whole; torchrun's, with the
    table after it, becomes `torchrun: rank R failed first, then ranks ...`. Called with a
    line, it returns what to write now."""

    def __init__(self) -> None:
        self.held: list[str] = []
        self.ranks: list[str] = []
        self.rules = 0  # `====` rules seen in the table; 0 outside it

    def __call__(self, line: str, said: bool) -> str:
        if self.rules:
            if m := re.match(r"\s*rank\s*:\s*(\d+)", line):
                self.ranks.append(m[1])
            if line.startswith("===="):
                self.rules += 1
            if self.rules < 3:
                return ""
            self.rules = 0
            *others, first = self.ranks or ["?"]  # the table ends with the root cause
            self.ranks = []
            then = f", then {'ranks' if len(others) > 1 else 'rank'} " if others else ""
            return f"torchrun: rank {first} failed first{then}{', '.join(others)}\n"
        if not self.held:
            if line.startswith("Traceback (most recent call last):") and said:
                self.held = [line]
                return ""
            return line
        self.held.append(line)
        if line[:1].isspace():
            return ""
        held, self.held = "".join(self.held), []
        if "ChildFailedError" in line:
            self.rules = 1
            return ""
        return held

    def rest(self) -> str:
        """What is still held when the stream ends (a traceback cut short)."""
        held, self.held = "".join(self.held), []
        return held
