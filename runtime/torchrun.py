"""How pipec starts torchrun: this interpreter's torch.distributed.run, on a free port.

`--standalone` lets torchrun pick a free rendezvous port, so runs (and tests of several
engineers on one machine) never collide on a fixed one; the checkout goes on PYTHONPATH so a
fresh clone runs without installing pipec.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

CHECKOUT = Path(__file__).resolve().parents[1]


def torchrun(script: Path, nproc: int, *args: str) -> tuple[list[str], dict[str, str]]:
    """The command line and environment that run `script` on `nproc` local ranks."""
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        "--nproc-per-node", str(nproc), str(script), *args,
    ]  # fmt: skip
    path = os.pathsep.join(filter(None, [str(CHECKOUT), os.environ.get("PYTHONPATH")]))
    return cmd, os.environ | {"PYTHONPATH": path}
