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
from pipec.plan.calibration import Calibration
from pipec.plan.conditions import Conditions
from pipec.plan.facts import ModelProfile

FORMAT = "pipec.plan_profile/3"
"""/2 added the bytes of each block's boundary and, on CPU, its host bytes and W's hold; /3
the calibration, the runtime's cost per instruction and the conditions measured under."""


@dataclass(frozen=True)
class SavedProfile:
    """What a plan prices candidates with: the block profile, each transfer's price (`comm_s`
    seconds, or by link on `machine`, bandwidths in bytes per second), the runtime's seconds
    per instruction, and the calibration that scales the profile's times (None: none)."""

    profile: ModelProfile
    comm_s: float = 0.0
    machine: Topology | None = None
    instr_s: tuple[tuple[int, float], ...] = ()
    calibration: Calibration | None = None

    @property
    def priced(self) -> ModelProfile:
        """The profile candidates are priced from: the block profile, calibrated if it was."""
        return self.calibration.apply(self.profile) if self.calibration else self.profile

    @property
    def conditions(self) -> Conditions | None:
        """What the plan's times were measured under: the calibration's, else the sweep's."""
        if self.calibration is not None and self.calibration.conditions is not None:
            return self.calibration.conditions
        return self.profile.conditions

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "comm_s": self.comm_s,
            "machine": None if self.machine is None else self.machine.to_json(),
            "instr_s": [list(x) for x in self.instr_s],
            "calibration": None if self.calibration is None else self.calibration.to_json(),
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
        calibration = None if d["calibration"] is None else Calibration.from_json(d["calibration"])
        profile = ModelProfile.from_json(d["profile"])
        instr_s = tuple((int(n), float(x)) for n, x in d["instr_s"])
        return SavedProfile(profile, d["comm_s"], machine, instr_s, calibration)
    except (KeyError, TypeError, ValueError) as e:
        raise PipecError(f"--plan-profile {path}: corrupted ({type(e).__name__}: {e})") from None
