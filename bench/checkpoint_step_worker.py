"""One torchrun launch for bench/checkpoint_step.py: one build trained in turns, A B A B ….

    torchrun --nproc-per-node 2 bench/checkpoint_step_worker.py BUILD ROUNDS STEPS EVERY DIR OUT

Both turns save a checkpoint into DIR after every EVERY-th step: `async` as launch.py does
(runtime/saving.py: the state taken and copied to host memory in the step, written in the
background while training goes on), `sync` waiting in the step until it is written (how
checkpoints were written before). The turns share one process group and one model, which
trains on. A step's time is its whole iteration on this rank: from the start of its program
to the start of the next step's (the figures' gather, the save's part in the step, the next
barrier). Rank 0 writes every rank's times to OUT (JSON): by turn, a list per round of
[step, seconds] pairs.
"""

import sys
from pathlib import Path

# The checkout first: this folder's bench/runtime.py would shadow the runtime package.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pipec.runtime.faults import take_termination_signals

take_termination_signals()  # before torch starts threads, as launch.py does

import json

import torch
import torch.distributed as dist

from pipec.build_dir import load
from pipec.checkpoint_lineage import Lineage
from pipec.runtime.faults import Watchdog
from pipec.runtime.gather import all_gather_objects
from pipec.runtime.interpreter import HANDLERS
from pipec.runtime.loop import train
from pipec.runtime.lr import Schedule
from pipec.runtime.optim import Trainer, TrainOptions
from pipec.runtime.rank import Rank
from pipec.runtime.saving import Saver

TIMEOUT_S = 120.0
TURNS = ("async", "sync")


def main() -> None:
    torch.set_num_threads(1)
    build = load(Path(sys.argv[1]))
    rounds, steps, every = (int(a) for a in sys.argv[2:5])
    directory, out = Path(sys.argv[5]), Path(sys.argv[6])
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    rt = Rank.prepare(build, rank, world, torch.device("cpu"))
    total = rounds * len(TURNS) * steps
    options = TrainOptions(Schedule(1e-3, total))
    rt.connect(lambda _: Trainer(rt, options), TIMEOUT_S)
    watchdog = Watchdog(TIMEOUT_S, rt.describe)
    lineage = Lineage.new(build.plan, build.plan_hash, None)
    save = Saver(rt, directory, every, last=0, lineage=lineage, timeout=TIMEOUT_S)

    def after(turn: str, step: int) -> None:
        save(step)
        if turn == "sync":
            save.writer.wait()

    times: dict[str, list[list[tuple[int, float]]]] = {turn: [] for turn in TURNS}
    start = 0
    for _ in range(rounds):
        for turn in TURNS:
            traces = train(
                rt, start + steps + 1, HANDLERS, watchdog, start=start,
                after_step=lambda step, turn=turn: after(turn, step),
            )  # fmt: skip
            save.writer.wait()  # the turn's last write, outside every step's time
            begins = [t.begin for t in traces]  # one step more: the last one's end
            ran = zip(range(start + 1, start + steps + 1), begins, begins[1:])
            times[turn].append([(step, b - a) for step, a, b in ran])
            start += steps + 1
    everyone = all_gather_objects(times, rt.device)
    if rank == 0:
        out.write_text(json.dumps(everyone))
    watchdog.stop()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
