"""One rank of test_torchtitan: torchtitan's `pipeline_llm` built from pipec's overrides alone.

    torchrun --standalone --nproc-per-node 2 tests/torchtitan_worker.py CASES.json RESULTS_DIR

A case {"name", "args"} names a `.torchtitan.args` file that `pipec export --torchtitan` wrote.
Every rank parses `--module llama3 --config llama3_debugmodel`, then `TEST_ONLY` (fp32, a short
sequence: nothing about the pipeline), then the file's words as they are, with torchtitan's
ConfigManager, and records the parsed pipeline fields. It builds torchtitan's Llama3 debug
model with `LAYERS` layers from one seed and hands it to `pipeline_llm` with the parsed config,
which cuts, places and schedules it (the CSV, the stages' modules, the micro-batches); it steps
once on one batch and records the micro-batches' losses beside a plain loop's (each
micro-batch's loss backward through the whole model) and, for each parameter of its stages,
the largest gradient difference relative to the plain loop's largest gradient entry.

torchtitan on a CPU, patched here only: its device type falls back to CUDA (its meshes are
built on "cpu" instead), and FlexAttention has no CPU backward, so attention runs as causal
SDPA (the debug model's mask is causal; no mask is passed).
"""

import sys
from pathlib import Path

# Hugging Face's datasets stand-in (torchtitan's config registry imports it), for this process.
sys.path.insert(0, str(Path(__file__).resolve().parent / "torchtitan_stubs"))

import copy
import shlex

import torch
import torch.distributed as dist
import torch.nn.functional as F
import torchtitan.distributed.parallel_dims
from torchtitan.config import ConfigManager
from torchtitan.distributed import ParallelDims
from torchtitan.distributed.pipeline_parallel import pipeline_llm
from torchtitan.models.common.attention import FlexAttention
from torchtitan.models.llama3 import parallelize_llama

from tests.runtime_harness import serve

CPU = torch.device("cpu")
LAYERS, SEQ = 8, 16
TEST_ONLY = ["--training.mixed_precision_param", "float32", "--training.seq_len", str(SEQ)]
CHECKPOINT_WRAPPER = "._checkpoint_wrapped_module"  # in a name under activation checkpointing


def causal_sdpa(self, q, k, v, *, scale=None, enable_gqa=False, **kwargs):  # type: ignore[no-untyped-def]
    """FlexAttention.forward's contract ((batch, seq, heads, head_dim) in and out) as SDPA."""
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    out = F.scaled_dot_product_attention(
        q, k, v, is_causal=True, scale=scale, enable_gqa=enable_gqa
    )
    return out.transpose(1, 2)


def loss_fn(out: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, None]:
    """One micro-batch's mean cross entropy, returned as torchtitan's losses return it."""
    return F.cross_entropy(out.flatten(0, 1), target.flatten()), None


def run_case(case: dict, watchdog: object) -> dict:
    words = shlex.split(Path(case["args"]).read_text())
    base = ["--module", "llama3", "--config", "llama3_debugmodel"]
    config = ConfigManager().parse_args([*base, *TEST_ONLY, *words])
    par, training = config.parallelism, config.training
    flags = [w[2:].split(".") for w in words if w.startswith("--")]
    result: dict = {"parsed": {f"{s}.{k}": getattr(getattr(config, s), k) for s, k in flags}}
    result["activation_checkpoint"] = type(config.activation_checkpoint).__qualname__
    model_config = config.model_spec.model
    more = LAYERS - len(model_config.layers)
    model_config.layers = [*model_config.layers, *copy.deepcopy(model_config.layers[:more])]
    torch.manual_seed(0)  # the same weights and batch on every rank
    model = model_config.build()
    model.init_states()
    reference = copy.deepcopy(model)
    x, y = torch.randint(0, model_config.vocab_size, (2, training.local_batch_size, SEQ))
    schedule, parts, first, last = pipeline_llm(
        model,
        parallel_dims=ParallelDims.from_config(par, dist.get_world_size()),
        training=training,
        parallelism=par,
        compile_config=config.compile,
        ac_config=config.activation_checkpoint,
        dump_folder=config.dump_folder,
        device=CPU,
        model_config=model_config,
        parallelize_fn=parallelize_llama,
        loss_fn=loss_fn,
    )
    losses: list[torch.Tensor] = []
    schedule.step(*((x,) if first else ()), target=y if last else None, losses=losses,
                  return_outputs=False)  # fmt: skip
    m = training.local_batch_size // par.pipeline_parallel_microbatch_size
    plain = []
    for xs, ys in zip(x.chunk(m), y.chunk(m), strict=True):
        loss, _ = loss_fn(reference(xs), ys)
        loss.backward()
        plain.append(loss.item())
    result["losses"] = [loss.item() for loss in losses]
    result["plain_losses"] = plain if last else []
    want = dict(reference.named_parameters())
    result["grad_differences"] = {}
    for part in parts:
        for name, p in part.named_parameters():
            name = name.replace(CHECKPOINT_WRAPPER, "")
            g, w = p.grad, want[name].grad
            g = g.full_tensor() if hasattr(g, "full_tensor") else g
            result["grad_differences"][name] = ((g - w).abs().max() / w.abs().max()).item()
    result["parameters"] = len(want)
    return result | {"ok": True}


if __name__ == "__main__":
    torchtitan.distributed.parallel_dims.device_type = "cpu"
    FlexAttention.forward = causal_sdpa  # type: ignore[method-assign]
    serve(run_case)
