"""torchtitan's settings for a pipec build's exported CSV, in the installed torchtitan's form.

torchtitan loads a schedule CSV into torch's `_PipelineScheduleRuntime`
(`--parallelism.pipeline_parallel_schedule_csv`) but cuts and places the model itself: the
stages come from `module_fqns_per_model_part` (one list of module names per stage) and their
placement from the schedule *name*, looped for every class but ZBVZeroBubble and DualPipeV,
which place a V. So the settings name a schedule whose placement is the build's, the build's
partition in the names of torchtitan's decoders (`tok_embeddings`, `layers.N`, `norm` and the
head), and a local batch of m micro-batches of the build's micro-batch size. They set only what
the build decides: the model (`--module`, `--config`) stays the user's.

Two forms, by torchtitan version: 0.3 takes a Python config function plus command-line
overrides (a list of lists as one comma-joined word per stage; a pipeline needs
`--training.disable_cuda_graphs`) and calls the head `lm_head`; 0.2 takes a TOML job file and
calls it `output`. torchtitan drops, silently, a module that no stage names, and a name the
model lacks builds a stage without it: every name is mapped from the user's model and checked.
"""

from __future__ import annotations

import json
import re
from importlib import metadata
from pathlib import Path
from typing import Any

from pipec.build_dir import Build
from pipec.frontend import FrontendError, load_factory
from pipec.frontend.facts import ModelPlan
from pipec.interop import export_torch_csv
from pipec.ir import Layout, PipecError
from pipec.provenance import resolve
from pipec.torch_runtime import outer_modules, splits_backward, torch_build

#: torchtitan's decoder head, by the versions whose settings pipec writes (newest last).
HEADS = {"0.2": "output", "0.3": "lm_head"}
#: The user's module names (examples/llama.py's, Hugging Face Llama's, torchtitan's own) to
#: torchtitan's decoders'; "head" is the version's head. A name maps with what follows it.
NAMES = {
    "tok_embeddings": "tok_embeddings",
    "model.embed_tokens": "tok_embeddings",
    "blocks": "layers",
    "layers": "layers",
    "model.layers": "layers",
    "norm": "norm",
    "model.norm": "norm",
    "output": "head",
    "lm_head": "head",
}
#: Why a split-backward build sets FSDP's resharding and activation checkpointing (measured with
#: torch 2.13 and torchtitan 0.3: FSDP resharding after forward loses weight gradients under
#: torch's input/weight split, and selective checkpointing fails at the weight part).
SPLIT_BACKWARD = (
    "splits each backward into input and weight parts: keep fsdp_reshard_after_forward at "
    "never (always loses weight gradients) and activation checkpointing full or none "
    "(selective, torchtitan's default, fails at the weight part); both are set above"
)
#: Characters a word of the overrides file may hold: `$(cat FILE)` splits and globs, unquoted.
PLAIN = re.compile(r"[\w@%+=:,./-]+")


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


def version(asked: str | None) -> tuple[str, str]:
    """The form to write (a key of HEADS) and where it came from: `--torchtitan-version`, else
    the installed torchtitan's, else the newest."""
    if asked is None:
        try:
            installed = metadata.version("torchtitan")
        except metadata.PackageNotFoundError:
            return max(HEADS), "torchtitan is not installed here: the newest form"
        asked, source = installed, f"torchtitan {installed}, installed"
    else:
        source = "--torchtitan-version"
    form = ".".join(asked.split(".")[:2])
    if form not in HEADS:
        raise PipecError(
            f"torchtitan {asked} ({source}): pipec writes settings for torchtitan "
            f"{', '.join(HEADS)}; pass --torchtitan-version with one of them"
        )
    return form, source


def name_map(option: str | None) -> dict[str, str]:
    """NAMES with `--torchtitan-names OURS=THEIRS,...` over it; PipecError for a malformed one."""
    out = dict(NAMES)
    for item in option.split(",") if option else ():
        ours, sep, theirs = item.partition("=")
        if not (sep and ours and theirs):
            raise PipecError(
                f"--torchtitan-names {option}: give OURS=THEIRS pairs, comma-separated "
                "(e.g. transformer.h=layers,lm_head=head)"
            )
        out[ours] = theirs
    return out


def torchtitan_names(names: list[str], mapping: dict[str, str], head: str, model: str) -> list[str]:
    """`names` (one stage's modules, the user's) in torchtitan's decoder's names; PipecError
    for a name no rule maps or one torchtitan's decoder lacks."""
    out = []
    for name in names:
        rule = max(
            (k for k in mapping if name == k or name.startswith(k + ".")), key=len, default=None
        )
        if rule is None:
            raise PipecError(
                f"--torchtitan: {model}'s module {name!r} has no torchtitan name; map it with "
                f"--torchtitan-names {name}=NAME (tok_embeddings, layers, norm or head)"
            )
        target = mapping[rule] + name[len(rule) :]
        theirs = head + target[len("head") :] if target.split(".")[0] == "head" else target
        if not re.fullmatch(rf"tok_embeddings|norm|{head}|layers\.\d+", theirs):
            raise PipecError(
                f"--torchtitan: {model}'s module {name!r} maps to {theirs!r}, which torchtitan's "
                f"decoder lacks (tok_embeddings, layers.N, norm, {head}); fix it with "
                f"--torchtitan-names {rule}=NAME"
            )
        out.append(theirs)
    return out


def stage_names(build: Build, mapping: dict[str, str], head: str) -> list[list[str]]:
    """Each stage's modules in torchtitan's names: the user's model's outer modules (loaded
    from the build's factory) on the first and last stage, its blocks in between; PipecError
    for a model cut along several stacks or two modules given one name."""
    plan = ModelPlan.from_json(build.plan["model"])
    if len(plan.stacks) > 1:
        raise PipecError(
            f"--torchtitan: {build.path} is cut along several stacks of blocks; torchtitan's "
            "decoder has one (layers)"
        )
    try:
        spec = load_factory(
            resolve(build.plan["model"], None, build.path), plan.seed, plan.micro_batch_size
        )
    except FrontendError as e:
        raise PipecError(f"{build.path}: {e}") from None
    before, after = outer_modules(spec.model, plan.blocks_path)
    model = type(spec.model).__name__
    out = []
    for s, facts in enumerate(plan.stages):
        blocks = [f"{plan.blocks_path}.{b}".lstrip(".") for b in range(*facts.blocks)]
        names = (before if s == 0 else []) + blocks + (after if s == plan.n_stages - 1 else [])
        out.append(torchtitan_names(names, mapping, head, model))
    flat = [n for part in out for n in part]
    twice = sorted({n for n in flat if flat.count(n) > 1})
    if twice:
        raise PipecError(
            f"--torchtitan: several of {model}'s modules map to {', '.join(twice)}; give each "
            "its own with --torchtitan-names"
        )
    return out


def settings(build_dir: Path, csv_path: Path, form: str, mapping: dict[str, str]) -> dict:
    """torchtitan's config entries by section for the CSV at `csv_path`, in `form`."""
    build = torch_build(build_dir)
    layout = build.compiled.layout
    plan = ModelPlan.from_json(build.plan["model"])
    style = placement(layout)
    name = {"v": "ZBVZeroBubble"}.get(
        style, "Interleaved1F1B" if layout.n_stages > layout.p else "1F1B"
    )
    size = plan.micro_batch_size or plan.stages[0].inputs[0].shape[0]
    parallelism: dict[str, Any] = {
        "pipeline_parallel_degree": layout.p,
        "pipeline_parallel_schedule": name,
        "pipeline_parallel_schedule_csv": str(csv_path.resolve()),
        "pipeline_parallel_microbatch_size": size,
        "module_fqns_per_model_part": stage_names(build, mapping, HEADS[form]),
    }
    training: dict[str, Any] = {"local_batch_size": layout.m * size}
    if form != "0.2":  # 0.3 refuses a pipeline with CUDA graphs (0.2 has none)
        training["disable_cuda_graphs"] = True
    config = {"parallelism": parallelism, "training": training}
    if splits_backward(build_dir):  # see SPLIT_BACKWARD
        parallelism["fsdp_reshard_after_forward"] = "never"
        config["activation_checkpoint"] = {"mode": "full"}
    return config


def override_words(config: dict[str, dict[str, Any]]) -> list[str]:
    """torchtitan 0.3's command-line overrides, one setting a line (flag, then its words): a
    true flag alone, a list of lists as one comma-joined word per inner list; the activation
    checkpointing mode as the subcommand `activation_checkpoint:MODE`, last (tyro applies the
    words after a subcommand to it)."""
    lines = []
    for section, entries in config.items():
        if section == "activation_checkpoint":
            continue
        for key, value in entries.items():
            flag = f"--{section}.{key}"
            if value is True:
                lines.append(flag)
            elif isinstance(value, list):
                lines.append(" ".join([flag, *(",".join(part) for part in value)]))
            else:
                lines.append(f"{flag} {value}")
    if "activation_checkpoint" in config:
        lines.append(f"activation_checkpoint:{config['activation_checkpoint']['mode']}")
    return lines


def toml_text(config: dict[str, dict[str, Any]], header: str) -> str:
    """torchtitan 0.2's job-file sections (JSON literals, which TOML reads the same)."""
    lines = [f"# {header}"]
    for section, entries in config.items():
        lines += ["", f"[{section}]"] + [f"{k} = {json.dumps(v)}" for k, v in entries.items()]
    return "\n".join(lines) + "\n"


def export_torchtitan(
    build_dir: Path, out: str, comms: bool, asked: str | None, names: str | None
) -> str:
    """`pipec export --torchtitan`: the compute_only CSV at `out` and torchtitan's settings
    beside it (0.3: `NAME.torchtitan.args`, the overrides; 0.2: `NAME.torchtitan.toml`, to
    merge into a job file); returns what to print. Nothing is written on refusal."""
    if out == "-" or comms:
        raise PipecError("--torchtitan: give --out FILE.csv and no --comms (torchtitan loads "
                         "compute_only)")  # fmt: skip
    csv_path = Path(out)
    form, source = version(asked)
    text = export_torch_csv(build_dir, comms=False)
    config = settings(build_dir, csv_path, form, name_map(names))
    stem = csv_path.name.removesuffix(".csv")
    split = "activation_checkpoint" in config  # a split backward: see SPLIT_BACKWARD
    warning = f"\nwarning: {build_dir} {SPLIT_BACKWARD}" if split else ""
    if form == "0.2":
        body = toml_text(config, f"torchtitan settings for {csv_path.name}, from {build_dir}")
        beside = csv_path.with_name(f"{stem}.torchtitan.toml")
        how = "merge its sections into your job file (--job.config_file)"
    else:
        if not PLAIN.fullmatch(config["parallelism"]["pipeline_parallel_schedule_csv"]):
            raise PipecError(
                f"--out {out}: torchtitan reads the overrides unquoted ($(cat FILE)): name a "
                "path without spaces or shell characters"
            )
        body = "\n".join(override_words(config)) + "\n"
        beside = csv_path.with_name(f"{stem}.torchtitan.args")
        how = f"pass them last, after --module and --config: ... $(cat {beside})"
    csv_path.write_text(text, newline="")
    beside.write_text(body)
    return f"wrote {csv_path} and {beside} ({source}); {how}:\n{body.rstrip()}" + warning
