"""What the compiler knows about each stage: boundaries, parameters, stash, F/B/W costs.

`StageFacts` per stage and `ModelPlan` for the whole are frozen values; `to_json()` gives a
deterministic JSON-serialisable dict and `ModelPlan.from_json` reads it back (`==` round trip).
`measure_stash_bytes` runs one forward under `saved_tensors_hooks` and adds up the storages
autograd keeps for the backward.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

PLAN_FORMAT = "pipec.model_plan/1"


@dataclass(frozen=True)
class TensorFacts:
    """Name, shape and dtype of one tensor crossing a stage boundary."""

    name: str
    shape: tuple[int, ...]
    dtype: str  # "float32", "int64", …

    @staticmethod
    def of(name: str, t: Tensor) -> TensorFacts:
        return TensorFacts(name, tuple(t.shape), str(t.dtype).removeprefix("torch."))

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "shape": list(self.shape), "dtype": self.dtype}

    @staticmethod
    def from_json(d: dict[str, Any]) -> TensorFacts:
        return TensorFacts(d["name"], tuple(d["shape"]), d["dtype"])


@dataclass(frozen=True)
class Costs:
    """F, B, W of one stage and one micro-batch, in FLOPs (estimated) or seconds."""

    F: float
    B: float
    W: float

    def to_json(self) -> dict[str, float]:
        return {"F": self.F, "B": self.B, "W": self.W}

    @staticmethod
    def from_json(d: dict[str, float]) -> Costs:
        return Costs(d["F"], d["B"], d["W"])


@dataclass(frozen=True)
class StageFacts:
    """One stage, one micro-batch.

    blocks: the half-open range [first, stop) of model blocks in the stage.
    inputs / outputs: the boundary tensors (the first stage's inputs are the model's; the last
        stage's output is the model's, to which loss_fn is applied on that stage).
    params / param_bytes: parameters held by the stage (a tied parameter counts in each stage
        holding it).
    stash_bytes: activation memory autograd keeps from F until the backward, measured; the
        last stage includes the loss.
    flops: FLOPs of F, B (input gradients, plus the weight gradients not deferred) and W (the
        deferred weight gradients of products with parameters), counted by torch.
    seconds: F, B, W durations: flops / assumed throughput, or profiled medians.
    """

    stage: int
    blocks: tuple[int, int]
    inputs: tuple[TensorFacts, ...]
    outputs: tuple[TensorFacts, ...]
    params: int
    param_bytes: int
    stash_bytes: int
    flops: Costs
    seconds: Costs

    def to_json(self) -> dict[str, Any]:
        return {
            "stage": self.stage,
            "blocks": list(self.blocks),
            "inputs": [t.to_json() for t in self.inputs],
            "outputs": [t.to_json() for t in self.outputs],
            "params": self.params,
            "param_bytes": self.param_bytes,
            "stash_bytes": self.stash_bytes,
            "flops": self.flops.to_json(),
            "seconds": self.seconds.to_json(),
        }

    @staticmethod
    def from_json(d: dict[str, Any]) -> StageFacts:
        return StageFacts(
            d["stage"],
            (d["blocks"][0], d["blocks"][1]),
            tuple(TensorFacts.from_json(t) for t in d["inputs"]),
            tuple(TensorFacts.from_json(t) for t in d["outputs"]),
            d["params"],
            d["param_bytes"],
            d["stash_bytes"],
            Costs.from_json(d["flops"]),
            Costs.from_json(d["seconds"]),
        )


@dataclass(frozen=True)
class ModelPlan:
    """The frontend's result for one model and one stage count.

    spec: the factory spec (`examples/gpt.py:tiny`), or None when built from a ModelSpec object.
    seed: the torch seed the factory ran under; `build_stages` reuses it.
    n_stages = p · v; replicas: 1, or 2 for bidirectional schedules (two copies of every stage).
    blocks_path / n_blocks: the stacks of blocks the model was cut along (their paths,
        comma-separated) and their blocks in all.
    stacks: (path, blocks) of each stack in execution order (`pipec.frontend.blocks`); one
        stack, (blocks_path, n_blocks), when not given.
    partition_mode: "uniform", "balanced" or "explicit"; partition: blocks per stage.
    cost_source: "estimate" (seconds = flops / flops_per_s) or "profile" (measured on `device`).
    tied: groups of (stage, parameter name) holding one shared parameter (e.g. a tied
        embedding and LM head): the runtime must sum their gradients across those stages
        before the optimizer step, as a single-process model would.
    micro_batch_size: the size the factory was asked for (`load_factory`), which every
        rebuild asks for again; None: the factory's own.
    capture: how the model was captured, "fx" or "export"; stages are rebuilt the same way.
    eval_data: whether the ModelSpec holds evaluation data (`launch.py --eval-every` needs it;
        `pipec run` refuses the option before starting when not); None in older plans.
    """

    spec: str | None
    seed: int
    n_stages: int
    p: int
    v: int
    replicas: int
    blocks_path: str
    n_blocks: int
    partition_mode: str
    partition: tuple[int, ...]
    cost_source: str
    flops_per_s: float
    device: str
    tied: tuple[tuple[tuple[int, str], ...], ...]
    stages: tuple[StageFacts, ...]
    micro_batch_size: int | None = None
    capture: str = "fx"
    stacks: tuple[tuple[str, int], ...] = ()
    eval_data: bool | None = None

    def __post_init__(self) -> None:
        if not self.stacks:
            object.__setattr__(self, "stacks", ((self.blocks_path, self.n_blocks),))

    def to_json(self) -> dict[str, Any]:
        out = {
            "format": PLAN_FORMAT,
            "spec": self.spec,
            "seed": self.seed,
            "n_stages": self.n_stages,
            "p": self.p,
            "v": self.v,
            "replicas": self.replicas,
            "blocks": {"path": self.blocks_path, "count": self.n_blocks},
            "capture": self.capture,
            "partition": {"mode": self.partition_mode, "blocks_per_stage": list(self.partition)},
            "cost": {
                "source": self.cost_source,
                "flops_per_s": self.flops_per_s,
                "device": self.device,
            },
            "tied_parameters": [
                [{"stage": k, "name": name} for k, name in group] for group in self.tied
            ],
            "stages": [s.to_json() for s in self.stages],
        }
        if self.micro_batch_size is not None:  # absent otherwise: older plans keep their hash
            out["micro_batch_size"] = self.micro_batch_size
        if len(self.stacks) > 1:  # likewise: a one-stack plan is its path and count
            out["blocks"]["stacks"] = [{"path": p, "count": n} for p, n in self.stacks]
        if self.eval_data is not None:
            out["eval_data"] = self.eval_data
        return out

    @staticmethod
    def from_json(d: dict[str, Any]) -> ModelPlan:
        if d.get("format") != PLAN_FORMAT:
            raise ValueError(f"not a {PLAN_FORMAT} document (format: {d.get('format')!r})")
        return ModelPlan(
            d["spec"],
            d["seed"],
            d["n_stages"],
            d["p"],
            d["v"],
            d["replicas"],
            d["blocks"]["path"],
            d["blocks"]["count"],
            d["partition"]["mode"],
            tuple(d["partition"]["blocks_per_stage"]),
            d["cost"]["source"],
            d["cost"]["flops_per_s"],
            d["cost"]["device"],
            tuple(tuple((h["stage"], h["name"]) for h in group) for group in d["tied_parameters"]),
            tuple(StageFacts.from_json(s) for s in d["stages"]),
            d.get("micro_batch_size"),
            d.get("capture", "fx"),
            tuple((s["path"], s["count"]) for s in d["blocks"].get("stacks", ())),
            d.get("eval_data"),
        )


def measure_stash_bytes(
    stage: nn.Module, inputs: tuple[Tensor, ...], loss: Callable[[Any], Tensor] | None = None
) -> int:
    """Bytes autograd saves for the backward during one forward of `stage` on `inputs`.

    Floating inputs are treated as received activations (leaves requiring grad); `loss`, if
    given, is applied to the output (the last stage). Each storage counts once (views and
    tensors saved by several ops share one), parameters' storages not at all. Works on the meta
    device.
    """
    param_storages = {_storage_key(p) for p in stage.parameters()}
    saved: dict[int, int] = {}

    def pack(t: Tensor) -> Tensor:
        key = _storage_key(t)
        if key not in param_storages:
            saved[key] = t.untyped_storage().nbytes()
        return t

    leaves = tuple(x.detach().requires_grad_(x.is_floating_point()) for x in inputs)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = stage(*leaves)
        if loss is not None:
            out = loss(out)
    del out  # frees the graph; the storages were counted while it was alive
    return sum(saved.values())


def _storage_key(t: Tensor) -> int:
    # The StorageImpl address: unique while the storage lives, also on the meta device where
    # every data_ptr is 0. The graph keeps saved storages alive while we count them.
    return t.untyped_storage()._cdata
