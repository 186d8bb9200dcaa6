"""One rank of test_torch_csv_runtime: run pipec-exported CSVs under torch's own runtime.

    torchrun --standalone --nproc-per-node P tests/torch_csv_worker.py FILE:FORMAT ...

For each CSV, every rank builds the stages its row runs (a small MLP block per stage, same seed
everywhere), loads the CSV into torch's `_PipelineScheduleRuntime` and takes one step on gloo;
the parameter gradients must equal a single-process reference on the same batch.
"""

import copy
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import _PipelineScheduleRuntime

from pipec.torch_csv import read_csv

WIDTH = 16


def mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(out, target)


def check(path: str, fmt: str, rank: int) -> None:
    rows = read_csv(Path(path).read_text(), path)
    forwards = [a for row in rows for cell in row for a in cell if a.type == "F"]
    n_stages, m = 1 + max(a.stage for a in forwards), 1 + max(a.mb for a in forwards)
    mine = sorted({a.stage for cell in rows[rank] for a in cell if a.type == "F"})
    torch.manual_seed(0)
    blocks = [
        torch.nn.Sequential(
            torch.nn.Linear(WIDTH, WIDTH), torch.nn.Tanh(), torch.nn.Linear(WIDTH, WIDTH)
        )
        for _ in range(n_stages)
    ]
    x, y = torch.randn(2 * m, WIDTH), torch.randn(2 * m, WIDTH)
    reference = copy.deepcopy(torch.nn.Sequential(*blocks))
    mse(reference(x), y).backward()
    stages = [
        PipelineStage(copy.deepcopy(blocks[s]), s, n_stages, torch.device("cpu")) for s in mine
    ]
    schedule = _PipelineScheduleRuntime(stages, m, loss_fn=mse)
    schedule._load_csv(path, format=fmt)
    schedule.step(x, target=y)
    for stage in stages:
        for got, want in zip(stage.submod.parameters(), reference[stage.stage_index].parameters()):
            torch.testing.assert_close(got.grad, want.grad, rtol=1e-5, atol=1e-6)
    print(f"ok {path} {fmt} rank {rank} stages {mine}", flush=True)


def main() -> None:
    dist.init_process_group("gloo")
    for arg in sys.argv[1:]:
        path, fmt = arg.rsplit(":", 1)
        check(path, fmt, dist.get_rank())
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
