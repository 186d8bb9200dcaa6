"""One torchrun launch that trains several builds in turns, as `pipec run` trains one.

    torchrun --nproc-per-node P pipec/plan/calibrate_worker.py --threads T --precision fp32 \\
        --rounds R --steps N [--ping OUT.json --ping-bytes A,B] BUILD...

Every rank computes with T torch threads. With `--ping`, ranks 0 and 1 first time one gloo
message of each size in A,B (the median over round trips of half a blocking send and receive)
and rank 0 writes {bytes: seconds} to OUT.json. Then the builds take turns, round after round
(A B C A B C ...), so that whatever load the machine has hits them alike: each turn trains N
steps with the runtime's own loop, optimizer and precision (runtime/loop.py) and writes the
runtime's measurements (the turn's first step left out as a warm-up), which rank 0 keeps as
BUILD/measured/stats_round<K>.json. `pipec plan`'s calibration run (pipec/plan/calibrate_run.py)
and bench/plan_check.py use it.
"""

import sys

# Run as a script, this folder comes first on the path; nothing here is imported by that name.
sys.path.pop(0)

from pipec.runtime.faults import take_termination_signals

take_termination_signals()  # before torch starts threads, as launch.py does

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

from pipec.build_dir import MEASURED, load
from pipec.frontend.precision import PRECISIONS
from pipec.runtime.faults import Watchdog, end_with_parent
from pipec.runtime.interpreter import HANDLERS
from pipec.runtime.loop import train, write_measurements
from pipec.runtime.optim import Trainer
from pipec.runtime.options import parse_launch
from pipec.runtime.rank import Rank

TIMEOUT_S = 120.0
PINGS = 200


def ping(sizes: list[int], out: Path) -> None:
    """Ranks 0 and 1: the median one-way time of a message of each size; rank 0 writes them."""
    rank = dist.get_rank()
    found = {}
    for nbytes in sizes:
        x = torch.zeros(max(1, nbytes // 4))
        one_way = []
        for _ in range(PINGS):
            dist.barrier()
            t0 = time.perf_counter()
            if rank == 0:
                dist.send(x, 1)
                dist.recv(x, 1)
            elif rank == 1:
                dist.recv(x, 0)
                dist.send(x, 0)
            one_way.append((time.perf_counter() - t0) / 2)
        found[nbytes] = statistics.median(one_way)
    if rank == 0:
        out.write_text(json.dumps(found))


def main() -> None:
    if "TORCHELASTIC_RUN_ID" in os.environ:  # started by torchrun: end with it
        end_with_parent()
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, required=True)
    ap.add_argument("--precision", default="fp32")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--ping", type=Path, default=None)
    ap.add_argument("--ping-bytes", default="")
    ap.add_argument("builds", nargs="+", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    options = parse_launch(["--precision", args.precision]).training.trainer_options()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.ping is not None and world > 1:
        ping([int(b) for b in args.ping_bytes.split(",")], args.ping)
    watchdog = Watchdog(TIMEOUT_S, lambda k: f"rank {rank}")
    ranks = []
    for build in args.builds:
        dtype = PRECISIONS[args.precision]
        rt = Rank.prepare(load(build), rank, world, torch.device("cpu"), None, 0, dtype)
        rt.connect(lambda _, rt=rt: Trainer(rt, options), TIMEOUT_S)
        ranks.append(rt)
    for k in range(args.rounds):
        for build, rt in zip(args.builds, ranks):
            watchdog.describe = rt.describe
            traces = train(rt, args.steps, HANDLERS, watchdog)
            write_measurements(rt, traces, skip=1)
            if rank == 0:
                measured = build / MEASURED
                (measured / "stats.json").rename(measured / f"stats_round{k}.json")
    watchdog.stop()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
