"""One rank of test_torch_runtime: pipec builds on torch's runtime with FSDP2 or TP, 4 ranks.

    torchrun --standalone --nproc-per-node 4 tests/torch_runtime_worker.py CASES.json RESULTS_DIR

One 2x2 mesh (pp, inner) for every case: the inner dimension is data parallel (FSDP2, each
data-parallel rank taking half of every micro-batch) or tensor parallel (Colwise/Rowwise per
the case's plan). A case {"name", "build", "modes": ["fsdp" | "fsdp-bf16" | "tp", ...],
"tp_plan", "steps", "lr", optional "per_block"} records on every rank: pipec's own runtime's
losses at pp2 x dp1 on the build (ranks 0 and 1; the others wait), then per mode torch's
runtime's losses over the same steps and micro-batches with AdamW, and after its first step
the gradients that differ from a single-process `loss.backward()` of the plain model (fp32
modes), by parameter name; or the one-line refusal of `schedule`.
"""

import copy
import importlib.util
from functools import cache
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)

from pipec.build_dir import Build, load
from pipec.frontend import ModelSpec, load_factory
from pipec.ir import PipecError
from pipec.runtime.data import micro_batch
from pipec.runtime.faults import Watchdog
from pipec.runtime.interpreter import HANDLERS, run_program
from pipec.runtime.rank import Rank
from pipec.torch_runtime import pipeline_stages, schedule, splits_backward, stage_modules
from tests.runtime_harness import TIMEOUT_S, serve

STYLES = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
CPU = torch.device("cpu")


@cache
def mesh() -> DeviceMesh:
    return init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "inner"))


def step_loss(losses: list[torch.Tensor]) -> list[float]:
    """The step's mean loss over the ranks that computed losses (every rank calls it)."""
    mine = [float(sum(x.item() for x in losses) / len(losses)), 1.0] if losses else [0.0, 0.0]
    total = torch.tensor(mine, dtype=torch.float64)
    dist.all_reduce(total)
    return [total[0].item() / total[1].item()]


def pipec_losses(build: Build, case: dict, watchdog: Watchdog) -> list[float]:
    """pipec's runtime on global ranks 0..p-1 (a pp x dp1 run), the others idle."""
    p, out = build.compiled.world, []
    rt = None
    if dist.get_rank() < p:
        rt = Rank.prepare(build, dist.get_rank(), p, CPU)
        rt.connect(lambda ps: torch.optim.AdamW(ps, lr=case["lr"]), TIMEOUT_S)
        watchdog.describe = rt.describe
    for _ in range(case["steps"]):
        values: list[torch.Tensor] = []
        if rt is not None:
            rt.new_step(rt.step + 1)
            run_program(rt, HANDLERS, watchdog)
            values = list(rt.step_state.losses.values())
        out += step_loss(values)
    return out


def batch(spec: ModelSpec, m: int, part: int, parts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows part/parts of each of the m synthetic micro-batches, concatenated."""
    xs, ys = [], []
    for i in range(m):
        (x,), y = micro_batch(spec, i)
        h = x.shape[0] // parts
        xs.append(x[part * h : (part + 1) * h])
        ys.append(y[part * h : (part + 1) * h])
    return torch.cat(xs), torch.cat(ys)


def parallelize(mods: dict, mode: str, tp_plan: dict, blocks: str, per_block: bool) -> None:
    """TP by the case's plan, or FSDP2 per block and per stage (per stage only when the
    build splits its backward; a case may ask for per-block units anyway, to be refused)."""
    inner = mesh()["inner"]
    for mod in mods.values():
        if mode == "tp":
            parallelize_module(mod, inner, {k: STYLES[v]() for k, v in tp_plan.items()})
            continue
        bf16 = mode == "fsdp-bf16"
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        policy = mp if bf16 else MixedPrecisionPolicy()
        for block in mod.get_submodule(blocks).children() if per_block else []:
            fully_shard(block, mesh=inner, mp_policy=policy)
        fully_shard(mod, mesh=inner, mp_policy=policy)


def grad_errors(mods: dict, reference: torch.nn.Module) -> list[str]:
    """Parameters whose gradient differs from the reference's (every full tensor first: the
    gathers are collectives)."""
    want = dict(reference.named_parameters())
    got = {}
    for mod in mods.values():
        for name, p in mod.named_parameters():
            g = p.grad
            got[name] = g.full_tensor() if isinstance(g, DTensor) else g
    errors = []
    for name, g in got.items():
        try:
            torch.testing.assert_close(g, want[name].grad, rtol=1e-5, atol=1e-7)
        except AssertionError as e:
            errors.append(f"{name}: {str(e).splitlines()[-2:]}")
    return errors


def run_example(case: dict) -> dict:
    """examples/fsdp_tp.py's training loop on the case's build, pp2 x dp1 x tp2."""
    path = Path(__file__).resolve().parents[1] / "examples" / "fsdp_tp.py"
    spec = importlib.util.spec_from_file_location("fsdp_tp", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    grid = init_device_mesh("cpu", (2, 1, 2), mesh_dim_names=("pp", "dp", "tp"))
    losses = example.train(Path(case["build"]), grid, CPU, case["steps"], case["lr"])
    return {"losses": list(losses), "ok": True}


def run_case(case: dict, watchdog: Watchdog) -> dict:
    """pipec's losses on the build once, then torch's runtime in each of the case's modes."""
    if case.get("example"):
        return run_example(case)
    build = load(Path(case["build"]))
    result = {"pipec": pipec_losses(build, case, watchdog) if case["steps"] else []}
    for mode in case["modes"]:
        result[mode] = run_torch(build, case, mode)
        dist.barrier()
    return result | {"ok": True}


def run_torch(build: Build, case: dict, mode: str) -> dict:
    """One mode on torch's runtime: losses per step, first-step gradient errors (fp32), or
    the refusal's message."""
    build_dir = case["build"]
    plan, layout = build.plan["model"], build.compiled.layout
    spec = load_factory(plan["spec"], plan["seed"], plan.get("micro_batch_size"))
    model, reference = spec.model, copy.deepcopy(spec.model)
    pp_rank, inner_rank = (mesh().get_local_rank(d) for d in ("pp", "inner"))
    mods = stage_modules(build_dir, model, pp_rank)
    per_block = case.get("per_block", not splits_backward(build_dir))
    parallelize(mods, mode, case.get("tp_plan", {}), plan["blocks"]["path"], per_block)
    stages = pipeline_stages(build_dir, mods, CPU, mesh()["pp"].get_group())
    try:
        runtime = schedule(build_dir, stages, spec.loss_fn)
    except PipecError as e:
        return {"refused": str(e)}
    dp = mode != "tp"
    x, y = batch(spec, layout.m, inner_rank if dp else 0, 2 if dp else 1)
    first, last = any(st.is_first for st in stages), any(st.is_last for st in stages)
    optimizer = torch.optim.AdamW([p for m in mods.values() for p in m.parameters()], lr=case["lr"])
    out: dict = {"losses": []}
    for step in range(case["steps"]):
        losses: list[torch.Tensor] = []
        runtime.step(*((x,) if first else ()), target=y if last else None, losses=losses,
                     return_outputs=False)  # fmt: skip
        out["losses"] += step_loss(losses)
        if step == 0 and mode != "fsdp-bf16":
            fx, fy = batch(spec, layout.m, 0, 1)
            spec.loss_fn(reference(fx), fy).backward()
            out["grad_errors"] = grad_errors(mods, reference)
            out["grads_checked"] = sum(1 for m in mods.values() for _ in m.parameters())
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return out


if __name__ == "__main__":
    serve(run_case)
