"""Why pipec gives each direction between two ranks its own gloo group: an `isend`'s cost to
its caller with one group for both directions against one group per direction.

    PYTHONPATH=. python bench/gloo_pairs.py [--rounds 3] [--messages 300]

Two ranks compute (a chain of small matmuls, ~1-2 ms) and after each burst `isend` one
16 KB message to the other, whose receives were all posted first (as the runtime posts a
step's receives at its start), then wait for the other's message. Over one group both
directions share gloo's TCP pair, which locks for a send while the I/O thread reads the
message coming the other way; each direction in its own group has a pair to itself
(runtime/p2p.py, `Rank.connect`'s links). The two ways alternate (A B A B); the table gives
the time each `isend` call held its caller, per way over every run and rank.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pipec.runtime.torchrun import torchrun

WAYS = ("shared", "per-direction")


def worker(way: str, messages: int, out: Path) -> None:
    """One rank: `messages` rounds of compute, isend, wait for the peer's message."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    peer = 1 - rank
    send_group = recv_group = None
    if way == "per-direction":
        zero_to_one, one_to_zero = dist.new_group([0, 1]), dist.new_group([0, 1])
        send_group, recv_group = (
            (zero_to_one, one_to_zero) if rank == 0 else (one_to_zero, zero_to_one)
        )
    a, x = torch.randn(256, 256), torch.randn(4096)
    buffers = [torch.empty(4096) for _ in range(messages)]
    dist.barrier()
    receives = [dist.irecv(b, peer, group=recv_group, tag=k) for k, b in enumerate(buffers)]
    held, sends = [], []
    for k in range(messages):
        for _ in range(6):
            a = (a @ a).tanh_()
        t0 = time.perf_counter()
        sends.append(dist.isend(x, peer, group=send_group, tag=k))
        held.append((time.perf_counter() - t0) * 1e3)
        receives[k].wait()
    for w in sends:
        w.wait()
    every: list[list[float] | None] = [None, None]
    dist.all_gather_object(every, held)
    if rank == 0:
        out.write_text(json.dumps(every))
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3, help="runs of each way, alternating")
    ap.add_argument("--messages", type=int, default=300, help="messages per rank and run")
    ap.add_argument("--worker", choices=WAYS, help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args.worker, args.messages, args.out)
        return
    tmp = Path(tempfile.mkdtemp(prefix="pipec-gloo-pairs-"))
    held: dict[str, list[float]] = {way: [] for way in WAYS}
    for k in range(args.rounds):
        for way in WAYS:
            print(f"run {k + 1}/{args.rounds}: {way}", flush=True)
            out = tmp / f"{way}-{k}.json"
            extra = ("--worker", way, "--messages", str(args.messages), "--out", str(out))
            cmd, env = torchrun(Path(__file__), 2, *extra)
            subprocess.run(cmd, env=env, check=True, capture_output=True, text=True)
            held[way] += [t for rank in json.loads(out.read_text()) for t in rank]
    print(
        f"\nisend's time in its caller, ms: 2 ranks computing, 16 KB messages, "
        f"{args.rounds} runs x {args.messages} messages x 2 ranks per row, {os.cpu_count()} cores"
    )
    print("| groups | median | p90 | p99 | max | calls over 1 ms |")
    print("|---|---|---|---|---|---|")
    for way, ts in held.items():
        ts.sort()
        q = statistics.quantiles(ts, n=100)
        over = sum(t > 1.0 for t in ts)
        print(
            f"| {way} | {statistics.median(ts):.3f} | {q[89]:.3f} | {q[98]:.3f} | {ts[-1]:.2f} "
            f"| {over} of {len(ts)} ({over / len(ts):.1%}) |"
        )


if __name__ == "__main__":
    main()
