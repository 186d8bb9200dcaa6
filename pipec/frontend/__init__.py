"""The pipec frontend: model factories, capture (torch.fx or torch.export), stages, stage facts.

The compiler calls `build_model_plan`; the runtime calls `build_stages`; `split_model` returns
the stage modules for tests and tools. See docs/models.md.
"""

from pipec.frontend.facts import Costs, ModelPlan, StageFacts, TensorFacts, measure_stash_bytes
from pipec.frontend.plan import DEFAULT_FLOPS_PER_S, build_model_plan, build_stages, split_model
from pipec.frontend.spec import (
    DEFAULT_SEED,
    FrontendError,
    ModelSpec,
    load_factory,
    next_token_loss,
    token_model_spec,
)

__all__ = [
    "DEFAULT_FLOPS_PER_S",
    "DEFAULT_SEED",
    "Costs",
    "FrontendError",
    "ModelPlan",
    "ModelSpec",
    "StageFacts",
    "TensorFacts",
    "build_model_plan",
    "build_stages",
    "load_factory",
    "measure_stash_bytes",
    "next_token_loss",
    "split_model",
    "token_model_spec",
]
