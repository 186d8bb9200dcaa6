"""Train with pipec's schedule on torch's engine: pipeline x FSDP2 x tensor parallelism.

    torchrun --nproc-per-node 4 examples/fsdp_tp.py                 # pp 2 x dp 1 x tp 2
    torchrun --nproc-per-node 8 examples/fsdp_tp.py --tp 2          # pp 2 x dp 2 x tp 2
    torchrun --nproc-per-node 4 examples/fsdp_tp.py --tp 1 --schedule interleaved  # dp 2

The whole path, in order: the model factory (examples/llama.py:tiny) -> a pipec build of it
(`--schedule`, compiled by rank 0 into `--build`, which each run replaces) -> a (pp, dp, tp)
DeviceMesh -> this pipeline rank's stages of the model (`pipec.torch_runtime.stage_modules`) ->
tensor parallelism by the model's own names (TP_PLAN) and FSDP2 with bf16 compute and fp32
gradient reduction on each stage -> torch's `_PipelineScheduleRuntime` running the build's
order (`pipec.torch_runtime.schedule`) -> `--steps` AdamW steps, the loss printed by rank 0.
gloo on CPU, NCCL on GPUs (one per rank), unchanged. Data: the same synthetic micro-batches
every step (each data-parallel rank its own), so the loss falls as the model learns them.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pipec.build_dir import emit, load
from pipec.frontend import load_factory
from pipec.ir import PipecError
from pipec.model import compile_model
from pipec.runtime.data import micro_batch
from pipec.torch_runtime import pipeline_stages, schedule, splits_backward, stage_modules

MODEL = f"{Path(__file__).with_name('llama.py')}:tiny"  # found from any directory
# examples/llama.py's names; heads and the MLP split across the tp ranks.
TP_PLAN = {
    "blocks.*.attn.wq": ColwiseParallel(),
    "blocks.*.attn.wk": ColwiseParallel(),
    "blocks.*.attn.wv": ColwiseParallel(),
    "blocks.*.attn.wo": RowwiseParallel(),
    "blocks.*.ffn.w1": ColwiseParallel(),
    "blocks.*.ffn.w3": ColwiseParallel(),
    "blocks.*.ffn.w2": RowwiseParallel(),
}
BLOCKS = "blocks"


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--schedule", default="v-half", help="pipec family (default v-half)")
    ap.add_argument("--pp", type=int, default=2, help="pipeline ranks (default 2)")
    ap.add_argument("--tp", type=int, default=2, help="tensor-parallel ranks (default 2)")
    ap.add_argument("--microbatches", type=int, default=4, help="m per step (default 4)")
    ap.add_argument("--steps", type=int, default=10, help="training steps (default 10)")
    ap.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate (default 3e-3)")
    ap.add_argument(
        "--build",
        type=Path,
        help="build directory, replaced by each run (default: build/fsdp_tp/SCHEDULE-ppP-mM)",
    )
    args = ap.parse_args()
    if args.build is None:  # one per configuration: a run never replaces another's
        args.build = Path("build/fsdp_tp") / f"{args.schedule}-pp{args.pp}-m{args.microbatches}"
    return args


def main() -> None:
    args = parse()
    world = int(os.environ["WORLD_SIZE"])
    if world % (args.pp * args.tp):
        raise PipecError(f"{world} ranks are not a multiple of pp {args.pp} x tp {args.tp}")
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["LOCAL_WORLD_SIZE"])))
    dist.init_process_group("nccl" if cuda else "gloo")
    built = torch.ones((), device=device)
    if dist.get_rank() == 0:  # the pipec build: the schedule and where the model is cut
        try:
            result = compile_model(MODEL, args.schedule, args.pp, args.microbatches)
            emit(result, args.build, force=True)  # only a pipec build is replaced
        except PipecError as e:
            print(f"fsdp_tp: {e}", file=sys.stderr)
            built.zero_()
    dist.broadcast(built, 0)
    if not built:
        sys.exit(2)
    dims = (args.pp, world // (args.pp * args.tp), args.tp)
    mesh = init_device_mesh(device.type, dims, mesh_dim_names=("pp", "dp", "tp"))
    for step, loss in enumerate(train(args.build, mesh, device, args.steps, args.lr), 1):
        if dist.get_rank() == 0:
            print(f"step {step} loss {loss:.4f}", flush=True)
    dist.destroy_process_group()


def train(
    build: Path, mesh: DeviceMesh, device: torch.device, steps: int, lr: float
) -> Iterator[float]:
    """Train MODEL with `build`'s schedule over `mesh` (pp, dp, tp); yield each step's loss
    (the same on every rank)."""
    spec = load_factory(MODEL)  # same seed on every rank: the same initial weights
    model = spec.model.to(device)
    stages = stage_modules(build, model, mesh["pp"].get_local_rank())
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    per_block = not splits_backward(build)  # see docs/torch-engine.md
    for module in stages.values():
        if mesh["tp"].size() > 1:
            parallelize_module(module, mesh["tp"], TP_PLAN)
        for block in module.get_submodule(BLOCKS).children() if per_block else ():
            fully_shard(block, mesh=mesh["dp"], mp_policy=mp)
        fully_shard(module, mesh=mesh["dp"], mp_policy=mp)
    pipeline = pipeline_stages(build, stages, device, mesh["pp"].get_group())
    runtime = schedule(build, pipeline, spec.loss_fn)
    first = any(st.is_first for st in pipeline)
    last = any(st.is_last for st in pipeline)
    m = load(build).compiled.layout.m
    batches = [micro_batch(spec, mesh["dp"].get_local_rank() * m + i) for i in range(m)]
    x = torch.cat([b[0][0] for b in batches]).to(device)
    y = torch.cat([b[1] for b in batches]).to(device)
    params = [p for module in stages.values() for p in module.parameters()]
    optimizer = torch.optim.AdamW(params, lr=lr)
    for _ in range(steps):
        losses: list[torch.Tensor] = []
        runtime.step(*((x,) if first else ()), target=y if last else None, losses=losses,
                     return_outputs=False)  # fmt: skip
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        mine = [float(torch.stack(losses).float().mean()), 1.0] if losses else [0.0, 0.0]
        total = torch.tensor(mine, device=device)
        dist.all_reduce(total)  # the mean over the ranks holding the last stage
        yield (total[0] / total[1]).item()


if __name__ == "__main__":
    try:
        main()
    except PipecError as e:  # bad input: one line, exit 2
        print(f"fsdp_tp: {e}", file=sys.stderr)
        sys.exit(2)
