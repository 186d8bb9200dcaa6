"""One torchrun launch for bench/plan_check.py: every candidate's build trained in turns.

    torchrun --standalone --nproc-per-node P bench/plan_check_worker.py ROUNDS STEPS BUILD...
    torchrun --standalone --nproc-per-node 2 bench/plan_check_worker.py ping BYTES OUT.json

`ping` measures what one message costs between two ranks on gloo, the plan's `comm`: the
median over round trips of half a blocking send-and-receive of BYTES.

A launch costs seconds here and load from other processes drifts over a minute, so the
candidates share one process group and take turns, round after round (A B C D A B C D …):
whatever load there is hits them alike. Each turn trains STEPS steps with the runtime's own
loop and writes the runtime's own measurements (runtime/main.py: write_measurements, with the
first step of a turn left out as a warm-up), which rank 0 keeps as
BUILD/measured/stats_round<K>.json.
"""

import sys
from pathlib import Path

# The checkout first: this folder's bench/runtime.py would shadow the runtime package.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pipec.runtime.faults import take_termination_signals

take_termination_signals()  # before torch starts threads, as launch.py does

import json
import statistics
import time

import torch
import torch.distributed as dist

from pipec.build_dir import load
from pipec.runtime.faults import Watchdog
from pipec.runtime.interpreter import HANDLERS
from pipec.runtime.loop import train, write_measurements
from pipec.runtime.rank import Rank

TIMEOUT_S = 120.0
PINGS = 300


def ping(nbytes: int, out: Path) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    x = torch.zeros(max(1, nbytes // 4))
    one_way = []
    for _ in range(PINGS):
        dist.barrier()
        t0 = time.perf_counter()
        if rank == 0:
            dist.send(x, 1)
            dist.recv(x, 1)
        else:
            dist.recv(x, 0)
            dist.send(x, 0)
        one_way.append((time.perf_counter() - t0) / 2)
    if rank == 0:
        out.write_text(json.dumps({"median_s": statistics.median(one_way), "bytes": nbytes}))
    dist.destroy_process_group()


def main() -> None:
    torch.set_num_threads(1)
    if sys.argv[1] == "ping":
        ping(int(sys.argv[2]), Path(sys.argv[3]))
        return
    rounds, steps, builds = int(sys.argv[1]), int(sys.argv[2]), [Path(b) for b in sys.argv[3:]]
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    watchdog = Watchdog(TIMEOUT_S, lambda k: f"rank {rank}")
    ranks = []
    for build in builds:
        rt = Rank.prepare(load(build), rank, world, torch.device("cpu"))
        rt.connect(lambda ps: torch.optim.AdamW(ps, lr=1e-3), TIMEOUT_S)
        ranks.append(rt)
    for k in range(rounds):
        for build, rt in zip(builds, ranks):
            watchdog.describe = rt.describe
            traces = train(rt, steps, HANDLERS, watchdog)
            write_measurements(rt, traces, skip=1)
            if rank == 0:
                measured = build / "measured"
                (measured / "stats.json").rename(measured / f"stats_round{k}.json")
    watchdog.stop()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
