"""The torchtitan command-line overrides that run a pipec build's exported CSV.

torchtitan (0.3) loads a schedule CSV into torch's `_PipelineScheduleRuntime`
(`--parallelism.pipeline_parallel_schedule_csv`) but cuts and places the model itself: the
stages come from `module_fqns_per_model_part` (one list of module names per stage) and their
placement from the schedule *name*, looped for every class but ZBVZeroBubble and DualPipeV,
which place a V. So the overrides name a schedule whose placement is the build's, the build's
partition in torchtitan Llama's module names (`tok_embeddings`, `layers.N`, `norm`,
`output`), and a local batch of m micro-batches of the build's micro-batch size.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Any

from pipec.frontend.facts import ModelPlan
from pipec.interop import export_torch_csv
from pipec.ir import Layout, PipecError
from pipec.torch_runtime import torch_build


def placement(layout: Layout) -> str:
    """ "loop" (stage s on rank s mod p) or "v" (rank r holds r and 2p-1-r), as torchtitan's
    stage_ids_this_rank places them; PipecError for any other placement."""
    p, n = layout.p, layout.n_stages
    if layout.stage_rank == tuple(s % p for s in range(n)):
        return "loop"
    if n == 2 * p and layout.stage_rank == tuple(min(s, n - 1 - s) for s in range(n)):
        return "v"
    raise PipecError(
        f"torchtitan places stages looped or in a V of two; this build places stages on ranks "
        f"{list(layout.stage_rank)}"
    )


def settings(build_dir: Path, csv_path: Path) -> dict[str, dict[str, Any]]:
    """torchtitan's job config entries by section for the CSV at `csv_path`."""
    build = torch_build(build_dir)
    layout = build.compiled.layout
    plan = ModelPlan.from_json(build.plan["model"])
    style = placement(layout)
    name = {"v": "ZBVZeroBubble"}.get(
        style, "Interleaved1F1B" if layout.n_stages > layout.p else "1F1B"
    )
    size = plan.micro_batch_size or plan.stages[0].inputs[0].shape[0]
    fqns = []
    for s, facts in enumerate(plan.stages):
        part = [f"layers.{b}" for b in range(*facts.blocks)]
        part = (["tok_embeddings"] if s == 0 else []) + part
        fqns.append(part + (["norm", "output"] if s == plan.n_stages - 1 else []))
    return {
        "parallelism": {
            "pipeline_parallel_degree": layout.p,
            "pipeline_parallel_schedule": name,
            "pipeline_parallel_schedule_csv": str(csv_path.resolve()),
            "pipeline_parallel_microbatch_size": size,
            "module_fqns_per_model_part": fqns,
        },
        "training": {"local_batch_size": layout.m * size},
    }


def export_torchtitan(build_dir: Path, out: str, comms: bool) -> str:
    """`pipec export --torchtitan`: the compute_only CSV at `out` and its torchtitan settings
    beside it (`NAME.torchtitan.toml`, to merge into a job file); returns what to print: the
    files and the same settings as command-line overrides. Nothing is written on refusal."""
    if out == "-" or comms:
        raise PipecError("--torchtitan: give --out FILE.csv and no --comms (torchtitan loads "
                         "compute_only)")  # fmt: skip
    csv_path = Path(out)
    text = export_torch_csv(build_dir, comms=False)
    config = settings(build_dir, csv_path)
    flags = [
        f"--{section}.{key} {shlex.quote(v if isinstance(v, str) else json.dumps(v))}"
        for section, entries in config.items()
        for key, v in entries.items()
    ]
    toml = [f"# torchtitan settings for {csv_path.name}, exported from pipec build {build_dir}"]
    for section, entries in config.items():
        toml += ["", f"[{section}]"] + [f"{k} = {json.dumps(v)}" for k, v in entries.items()]
    toml_path = csv_path.with_name(csv_path.name.removesuffix(".csv") + ".torchtitan.toml")
    csv_path.write_text(text, newline="")
    toml_path.write_text("\n".join(toml) + "\n")
    return f"wrote {csv_path} and {toml_path}; torchtitan overrides:\n" + " \\\n".join(flags)
