"""A plan's prices on disk: the measured profile and the transfer prices it was given.

`pipec plan` writes one when it hands out `pipec compile` command lines (`--out`, `--json`);
`pipec compile --plan-profile FILE` reads it back and prices a build exactly as the plan priced
its candidates: the same profile (floats round-trip through JSON exactly) through the same
functions. Without a `--save-profile` path the file is named after a digest of its content, so a
later plan never overwrites the file an earlier command line names.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipec.ir import PipecError
from pipec.passes.topology import Topology
from pipec.plan.facts import ModelProfile

FORMAT = "pipec.plan_profile/2"
"""/2 added the bytes of each block's boundary and, on CPU, its host bytes and W's hold."""


@dataclass(frozen=True)
class SavedProfile:
    """What a plan prices candidates with: the profile, and each transfer's price (`comm_s`
    seconds, or by link on `machine`, bandwidths in bytes per second)."""

    profile: ModelProfile
    comm_s: float = 0.0
    machine: Topology | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "comm_s": self.comm_s,
            "machine": None if self.machine is None else self.machine.to_json(),
            "profile": self.profile.to_json(),
        }

    @property
    def digest(self) -> str:
        """A digest of the content (sorted JSON): names the file, and a build records it."""
        text = json.dumps(self.to_json(), sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:12]


def default_path(saved: SavedProfile, out: Path | None = None) -> Path:
    """`plan-profile-DIGEST.json` beside the build `out` (in its parent directory: a build
    holds exactly its plan's files), or in the current directory without one."""
    name = f"plan-profile-{saved.digest}.json"
    return Path(out).parent / name if out is not None else Path(name)


def save(saved: SavedProfile, path: Path | None = None, out: Path | None = None) -> Path:
    """Write `saved` to `path` (default: `default_path`, beside the build `out` if given)."""
    path = default_path(saved, out) if path is None else Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(saved.to_json(), sort_keys=True, indent=1) + "\n")
    return path


def load(path: Path) -> SavedProfile:
    """Read a file `save` wrote; PipecError naming the file and what is wrong with it."""
    try:
        d = json.loads(Path(path).read_text())
    except OSError as e:
        raise PipecError(f"--plan-profile {path}: {e.strerror or e}") from None
    except ValueError as e:
        raise PipecError(f"--plan-profile {path}: not JSON ({e})") from None
    written = d.get("format") if isinstance(d, dict) else None
    if isinstance(written, str) and written.startswith("pipec.plan_profile/") and written != FORMAT:
        raise PipecError(
            f"--plan-profile {path}: written by another version of pipec plan ({written}, this "
            f"one reads {FORMAT}); plan again to write it anew"
        )
    if written != FORMAT:
        raise PipecError(
            f"--plan-profile {path}: not a profile `pipec plan` wrote (format {FORMAT}); "
            "write one with pipec plan ... --save-profile FILE"
        )
    try:
        machine = None if d["machine"] is None else Topology.from_json(d["machine"])
        return SavedProfile(ModelProfile.from_json(d["profile"]), d["comm_s"], machine)
    except (KeyError, TypeError, ValueError) as e:
        raise PipecError(f"--plan-profile {path}: corrupted ({type(e).__name__}: {e})") from None
