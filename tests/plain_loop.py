"""The one-process training loop that pipelined runs are held equal to (tests only).

The model as its factory builds it, unsplit, trained on the same global batches as a run
(`open_source`, data seed 0) by `loss.backward()` per micro-batch and torch's AdamW. With
`bf16`, under the runtime's policy: the model cast to bf16 (`model.to`, floating inputs too),
fp32 master weights, each micro-batch's gradient added in fp32, the step on the masters and
the result rounded into the bf16 model. A frozen parameter (`requires_grad=False`) is never
stepped.
"""

from __future__ import annotations

import torch

from pipec.frontend import load_factory
from pipec.runtime.data import open_source
from pipec.runtime.lr import Schedule


def plain_loop(
    spec: str, steps: int, m: int, lr: float, options: dict | None = None, bf16: bool = False
) -> dict[str, list[float]]:
    """Losses, learning rates and gradient norms per step. `options`: launch.py's max_norm,
    warmup, decay, min_lr, weight_decay (of parameters of 2+ dimensions) and betas. On one
    thread, as a rank runs: the test models are tiny, and two threads on a busy 2-core host
    took 50x longer."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _loop(spec, steps, m, lr, options or {}, bf16)
    finally:
        torch.set_num_threads(threads)


def _loop(
    spec: str, steps: int, m: int, lr: float, options: dict, bf16: bool
) -> dict[str, list[float]]:
    ms = load_factory(spec, 0)
    model = ms.model
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}  # tied: once
    masters = {n: p.detach().clone() for n, p in params.items()}
    if bf16:
        model.to(torch.bfloat16)
    else:
        masters = params
    decay = options.get("weight_decay", 0.0)
    groups = [
        {"params": [p for p in masters.values() if p.dim() >= 2], "weight_decay": decay},
        {"params": [p for p in masters.values() if p.dim() < 2], "weight_decay": 0.0},
    ]
    opt = torch.optim.AdamW(groups, lr=lr, betas=tuple(options.get("betas", (0.9, 0.999))))
    schedule = Schedule(
        lr,
        steps,
        options.get("warmup", 0),
        options.get("decay", "none"),
        options.get("min_lr", 0.0),
    )
    data = open_source(ms, m, 0, 0)
    out: dict[str, list[float]] = {"losses": [], "lr": [], "grad_norm": []}
    for step in range(1, steps + 1):
        grads = {n: torch.zeros_like(w) for n, w in masters.items()}
        total = 0.0
        for inputs, target in data.next():
            if bf16:
                inputs = tuple(x.bfloat16() if x.is_floating_point() else x for x in inputs)
            loss = ms.loss_fn(model(*inputs), target)
            (loss / m).backward()
            total += loss.item()
            for n, p in params.items():  # fp32 accumulation per micro-batch, as the runtime
                grads[n] += p.grad.float()
                p.grad = None
        for n, w in masters.items():
            w.grad = grads[n]
        norm = torch.nn.utils.clip_grad_norm_(
            list(masters.values()), options.get("max_norm") or float("inf")
        )
        for group in opt.param_groups:
            group["lr"] = schedule.at(step)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if bf16:
            with torch.no_grad():
                for n, p in params.items():
                    p.copy_(masters[n])
        out["losses"].append(total / m)
        out["lr"].append(schedule.at(step))
        out["grad_norm"].append(norm.item())
    return out
