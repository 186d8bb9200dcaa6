"""The example GPT captured by torch.fx, the fallback capture, forced: the runtime tests keep
that path training (module-level Linears split into B and W, attention a wrapped call)."""

from dataclasses import replace

from examples.gpt import tiny
from pipec.frontend import ModelSpec


def gpt_tiny() -> ModelSpec:
    return replace(tiny(), capture="fx")
