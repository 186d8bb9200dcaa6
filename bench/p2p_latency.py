"""gloo's one-way latency for one activation, as the runtime sees it: the cost model's `comm`.

    torchrun --standalone --nproc-per-node 2 bench/p2p_latency.py NBYTES OUT.json

Rank 0 `isend`s an NBYTES message carrying its send time (perf_counter is one system-wide
monotonic clock, so the two processes' readings compare); rank 1 notes when its `irecv`
completes. Two conditions: the sender idle after `isend` (what a ping-pong measures) and the
sender computing right after `isend`, as a pipeline rank does (its gloo I/O thread then needs
a core to push the bytes). Writes the median latency of each, in ms.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

ROUNDS = 60
BUSY_S = 0.004  # the sender's compute after isend: a tiny GPT stage's F takes 2-4 ms here


def _busy(seconds: float) -> None:
    a = torch.randn(64, 64)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        a = torch.tanh(a @ a)


def latencies(nbytes: int, sender_busy: bool) -> list[float]:
    """Rank 1's arrival time minus rank 0's send time, per message (rank 1's list)."""
    msg = torch.zeros(max(nbytes // 8, 1), dtype=torch.float64)
    out = []
    for k in range(ROUNDS):
        dist.barrier()
        if dist.get_rank() == 0:
            time.sleep(0.001)  # let rank 1 post its receive first, as the runtime does
            msg[0] = time.perf_counter()
            work = dist.isend(msg, dst=1, tag=k)
            if sender_busy:
                _busy(BUSY_S)
            work.wait()
        else:
            work = dist.irecv(msg, src=0, tag=k)
            work.wait()
            out.append(time.perf_counter() - float(msg[0]))
    return out


def main() -> None:
    nbytes, out = int(sys.argv[1]), Path(sys.argv[2])
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    result = {
        name: latencies(nbytes, busy) for name, busy in (("idle_ms", False), ("busy_ms", True))
    }
    if dist.get_rank() == 1:
        medians = {name: statistics.median(xs) * 1e3 for name, xs in result.items()}
        out.write_text(json.dumps({"bytes": nbytes, **medians}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
