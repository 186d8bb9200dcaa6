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
    failed ranks) below the line a rank printed to say what went wrong; this repeats that line
    last, as `pipec run: ...`, and returns the first failed rank's exit code (2: bad input,
    nothing ran; 3: a fault during the run; 1: --check-grads found a difference).
    """
    plan_file = Path(build) / "plan.json"
    if not (Path(build) / "launch.py").is_file() or not plan_file.is_file():
        raise PipecError(
            f"{build}: no launch.py here; compile a model with `pipec compile MODEL ... --out DIR`"
        )
    plan = json.loads(plan_file.read_text())
    cmd, env = torchrun(
        Path(build) / "launch.py", nproc or plan["world"] * plan.get("dp", 1), *args
    )
    proc = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, text=True)
    messages, codes = [], []
    for line in proc.stderr:
        sys.stderr.write(line)
        if _MESSAGE in line:
            messages.append(line[line.index(_MESSAGE) + len(_MESSAGE) :].strip())
        elif m := _EXITCODE.search(line):
            codes.append(int(m[1]))
    code = proc.wait()
    if code == 0:
        return 0
    said = messages[0] if messages else "a rank failed without a message; see torchrun's report"
    print(f"pipec run: {said}", file=sys.stderr, flush=True)
    return codes[0] if codes and codes[0] > 0 else code
