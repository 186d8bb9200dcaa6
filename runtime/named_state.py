"""A Trainer's checkpoint state under the model's own names, whatever its sharding or dtype.

Keys as pipec/checkpoint.py describes them: `model.NAME` (the fp32 master of parameter NAME;
floating buffers in fp32), `optim.NAME.STATE` (the optimizer state of the whole parameter) and
`step`. Under ZeRO-1 each state tensor is all-gathered over the data-parallel group at save
(every copy joins; the first writes) and sliced at load, so a checkpoint moves freely between
precisions, ZeRO and any D, partition or schedule of the same model.

Each tensor is written once. A parameter tied across stages (the plan's `tied_parameters`: an
LM head tied to the embedding) is written under the name of its first stage's holder, the
other names being aliases of it, whichever ranks hold them; a key several ranks hold (a buffer
every stage reads) is written by the first of them.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from torch import Tensor, nn

from pipec import checkpoint
from pipec.checkpoint import Alias
from pipec.runtime.gather import all_gather_objects
from pipec.runtime.optim import Trainer, _Slice


def _flat(tr: Trainer, per_slice: list[Tensor]) -> Tensor:
    """A per-slice quantity laid out as all of the rank's parameters end to end (fp32), a
    copy in host memory."""
    rt = tr.rt
    mine = torch.zeros(tr.shard, dtype=torch.float32, device=rt.device)
    for s, v in zip(tr.slices, per_slice):
        a = tr.at(s)
        mine[a : a + s.hi - s.lo] = v.view(-1)
    if not tr.options.zero:
        return mine.cpu()
    full = torch.empty(tr.shard * rt.dp, dtype=torch.float32, device=rt.device)
    dist.all_gather_single(full, mine, group=rt.groups.dp)
    return full.cpu()


def _stepped(tr: Trainer) -> dict[str, object]:
    """The optimizer state of a parameter it has stepped (a frozen one has none)."""
    return next((tr.inner.state[s.master] for s in tr.slices if s.master in tr.inner.state), {})


def _moments(tr: Trainer) -> list[str]:
    """The optimizer's per-element state keys (AdamW: exp_avg, exp_avg_sq)."""
    return [k for k, v in _stepped(tr).items() if k != "step" and torch.is_tensor(v)]


def state_dict(tr: Trainer, modules: list[nn.Module]) -> dict[str, object]:
    """What this rank holds of a checkpoint: the first pipeline's parameters and buffers of
    `modules`' stages (empty `modules`: nothing, though the rank still joins the gathers),
    keys a lower rank holds too included (`held_lower`). A copy in host memory, each value
    its own or a view of a copy: training goes on while a thread writes it
    (runtime/saving.py)."""
    rt = tr.rt
    mine = {id(p) for m in modules for p in m.parameters()}
    flats = {"model": _flat(tr, [s.master for s in tr.slices])}
    for key in _moments(tr):
        states = [tr.inner.state.get(s.master, {}) for s in tr.slices]
        flats[key] = _flat(
            tr,
            [
                st[key] if key in st else torch.zeros_like(s.master)
                for s, st in zip(tr.slices, states)
            ],
        )
    first = _stepped(tr)
    step = _host(first["step"]) if "step" in first else None  # one value, every parameter's
    tied = _tied_names(rt.build.plan)
    out: dict[str, object] = {}
    for h in tr.held:
        if id(h.param) not in mine:
            continue
        at = slice(h.offset, h.offset + h.param.numel())
        values = {key: flat[at].view(h.param.shape) for key, flat in flats.items()}
        if not h.param.requires_grad:  # frozen: its value, no optimizer state
            values = {"model": values["model"]}
        elif step is not None:
            values["step"] = step
        own = tied.get(h.names[0], h.names[0])
        for name in h.names:
            for key, value in values.items():
                out[_key(name, key)] = value if name == own else Alias(_key(own, key))
    params = {n for m in modules for n, _ in m.named_parameters(remove_duplicate=False)}
    for m in modules:
        for name, t in m.state_dict().items():
            if name not in params:
                out[f"model.{name}"] = _host(rt.fp32_buffers.get(name, t))
    return out


def _host(t: Tensor) -> Tensor:
    """A copy of tensor `t` in host memory."""
    return t.detach().to("cpu", copy=True)


def _key(name: str, state: str) -> str:
    """The key of parameter `name`'s `state`: "model", its value; else its optimizer's."""
    return f"model.{name}" if state == "model" else f"optim.{name}.{state}"


def _tied_names(plan: dict) -> dict[str, str]:
    """Each name of a parameter tied across stages -> the name it is written under: its
    holder's in the first stage that holds it."""
    out: dict[str, str] = {}
    for group in plan["model"]["tied_parameters"]:
        first = min(group, key=lambda h: h["stage"])["name"]
        out |= {h["name"]: first for h in group}
    return out


def held_lower(keys: list[str], device: torch.device) -> frozenset[str]:
    """The keys among `keys` that a lower rank holds too, and writes (every rank joins the
    gather). A run's keys are the same at every save, but for optimizer states that come
    with the first optimizer step, which are each one rank's."""
    everyone = all_gather_objects(sorted(keys), device)
    return frozenset(keys) & frozenset().union(*everyone[: dist.get_rank()])


def _slice(value: Tensor, s: _Slice) -> Tensor:
    """A saved per-element state's elements of slice `s` (a scalar, such as AdamW's step,
    as saved)."""
    return value.reshape(-1)[s.lo : s.hi].clone() if value.numel() > 1 else value


def load(tr: Trainer, path: Path) -> int:
    """Load checkpoint `path` into the rank's parameters, masters, buffers and optimizer
    state (this rank's slices of each); returns its step. Reads only."""
    rt = tr.rt
    saved = checkpoint.manifest(path)
    every = checkpoint.keys_of(saved)
    keys = ["step"]
    optim: dict[int, list[str]] = {}
    for h in tr.held:
        prefix = f"optim.{h.names[0]}."
        optim[id(h.param)] = [
            k for k in every if k.startswith(prefix) and "." not in k[len(prefix) :]
        ]
        keys += [f"model.{h.names[0]}", *optim[id(h.param)]]
    params = {n for m in rt.modules.values() for n, _ in m.named_parameters()}
    buffers = {
        n: b for m in rt.modules.values() for n, b in m.state_dict().items() if n not in params
    }
    keys += [f"model.{n}" for n in buffers]
    state = checkpoint.read(path, keys, saved)
    with torch.no_grad():
        for h in tr.held:
            h.param.copy_(state[f"model.{h.names[0]}"])
        for n, b in buffers.items():
            value = state[f"model.{n}"]
            b.copy_(value)
            if n in rt.fp32_buffers:
                rt.fp32_buffers[n] = value.float()
        by_param = {id(h.param): h for h in tr.held}
        loaded: dict[int, dict[str, Tensor]] = {}
        optimized = (p for g in tr.inner.param_groups for p in g["params"])
        index = {id(p): i for i, p in enumerate(optimized)}
        for s in tr.slices:
            h = by_param[id(s.param)]
            full = state[f"model.{h.names[0]}"].reshape(-1)
            if tr.bf16:  # fp32 masters are views of the parameters, loaded above
                s.master.copy_(full[s.lo : s.hi])
            keys = optim[id(s.param)]
            if keys:
                loaded[index[id(s.master)]] = {
                    k.rsplit(".", 1)[1]: _slice(state[k], s) for k in keys
                }
    if loaded:
        groups = tr.inner.state_dict()["param_groups"]
        tr.inner.load_state_dict({"state": loaded, "param_groups": groups})
    return int(state["step"])
