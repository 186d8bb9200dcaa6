"""A rank of a run that torchrun may restart: which run it is, which attempt, where it resumes.

`pipec run BUILD ... --save DIR --max-restarts N` starts torchrun with `--max-restarts N`: when a
rank fails, torchrun stops every rank and starts the group again, up to N times
(runtime/agent.py, runtime/failures.py). The new ranks continue the same run:

- The run id is decided once, by `pipec run` before torchrun starts (`RUN_ID`, in every rank's
  environment), and every attempt's checkpoints record it (pipec/checkpoint_lineage.py). So a
  restarted rank 0 saves where the run saved (not "another run"), starts no branch, prunes
  the run's own checkpoints, and takes the run's locks, which the kernel dropped with the
  rank 0 that held them.
- A restarted rank (`attempt()` > 0) resumes from the newest intact checkpoint the run wrote
  into --save (`resume_from`), or where the run's first attempt started (--resume, or nothing)
  when it wrote none; the data stream continues from that checkpoint's step, as on --resume.
- Each attempt meets in a store namespace of its own (`join`): torchrun's agent serves one
  store to every attempt, and the keys of the failed one (gloo's addresses, the step barrier's
  notes) would otherwise meet the new ranks, which then wait on ranks that are gone.
"""

from __future__ import annotations

import os
import uuid
from datetime import timedelta
from pathlib import Path

from pipec.checkpoint_lineage import newest_of_run

#: The run's id, set by `pipec run` for every rank of every attempt (runtime/torchrun.py).
RUN_ID = "PIPEC_RUN_ID"


def run_id() -> str:
    """This run's id: `RUN_ID`'s, else a new one (a run started without pipec run)."""
    return os.environ.get(RUN_ID) or uuid.uuid4().hex[:16]


def attempt() -> int:
    """How many times torchrun has restarted this rank's group (0: the first attempt)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def resume_from(save: Path | None, resume: Path | None, run: str) -> Path | None:
    """Where attempt k > 0 of run `run` resumes: the newest intact checkpoint it saved into
    `save`, else `resume` (the run's --resume, as given; None: from the start)."""
    return (newest_of_run(save, run) if save else None) or resume


def join(backend: str, timeout: timedelta) -> None:
    """Join the default process group: under a torchrun agent's store, in a namespace of this
    attempt's own (see above); else as torch's env:// does."""
    import torch.distributed as dist  # here: `pipec run` imports this module, not torch

    env = os.environ
    if env.get("TORCHELASTIC_USE_AGENT_STORE") != str(True):
        dist.init_process_group(backend, timeout=timeout)
        return
    rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
    store = dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), world, False, timeout)
    ours = dist.PrefixStore(f"pipec/attempt_{attempt()}", store)
    dist.init_process_group(backend, store=ours, rank=rank, world_size=world, timeout=timeout)
