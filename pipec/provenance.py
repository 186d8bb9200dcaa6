"""Where a build's model comes from: recorded at compile time, checked before a run.

`record` goes into plan.json's model as "factory": the factory file's absolute path and sha256
(for a path spec such as `examples/gpt.py:tiny`) and a fingerprint of the model's state_dict
(every name, shape and dtype). A run then finds the factory from any directory (`resolve`) and
refuses a model that no longer matches the plan (`check_model`), each in one line, before any
rank communicates.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from pipec.ir import PipecError


def _file_of(spec: str) -> str | None:
    """The file part of a path spec (`dir/file.py:factory`); None for `package.module:factory`."""
    where = spec.rpartition(":")[0]
    return where if where.endswith(".py") or "/" in where or "\\" in where else None


def file_sha256(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def fingerprint(model) -> str:  # type: ignore[no-untyped-def]
    """A hash of the model's state_dict names, shapes and dtypes (not its values)."""
    rows = "\n".join(f"{n} {tuple(t.shape)} {t.dtype}" for n, t in model.state_dict().items())
    return hashlib.sha256(rows.encode()).hexdigest()[:16]


def record(spec: str, model) -> dict:  # type: ignore[no-untyped-def]
    """The "factory" entry of a model plan for `spec` and the model its factory built."""
    entry = {"fingerprint": fingerprint(model), "tensors": len(model.state_dict())}
    file = _file_of(spec)
    if file is not None:
        path = Path(file).resolve()
        entry |= {"file": str(path), "sha256": file_sha256(path)}
    return entry


def check_factory(model_plan: dict, build: Path) -> None:
    """Raise PipecError when the plan's factory file is not the one its spec names, or still
    exists with other content than the plan recorded (edited after compiling): the plan's hash
    covers the factory's sha256, and a rank must not run code the plan does not."""
    spec = model_plan["spec"]
    factory = model_plan.get("factory") or {}
    if "file" not in factory:
        return
    recorded = Path(factory["file"])
    written = Path(_file_of(spec) or "")
    # The spec as written names the file's last parts (after any '..'), or all of it.
    tail = written.resolve().parts if written.is_absolute() else written.parts
    tail = tail[max((i + 1 for i, part in enumerate(tail) if part == ".."), default=0) :]
    if not tail or recorded.parts[-len(tail) :] != tail:
        raise PipecError(
            f"{build}/plan.json: its factory file {recorded} is not the file of its spec {spec} "
            "(the plan was edited); recompile"
        )
    if recorded.is_file() and file_sha256(recorded) != factory["sha256"]:
        name = spec.rpartition(":")[2]
        raise PipecError(
            f"{recorded}: the model's factory changed since {build} was compiled (its sha256 is "
            "not the plan's); recompile, or run it as it is now with "
            f"--model {recorded}:{name}"
        )


def resolve(model_plan: dict, override: str | None, build: Path) -> str:
    """The spec a run loads: `override` (--model) if given, which accepts a changed factory;
    for a path spec, the file recorded at compile time if it still has the recorded sha256
    (`check_factory`), else the spec as written if that file has it; a module spec as written
    (it is found on PYTHONPATH). A factory file that moved or changed is one line naming it."""
    if override:
        return override
    check_factory(model_plan, build)
    spec = model_plan["spec"]
    factory = model_plan.get("factory") or {}
    if "file" not in factory:
        return spec
    name = spec.rpartition(":")[2]
    recorded = Path(factory["file"])
    if recorded.is_file():
        return f"{recorded}:{name}"
    written = Path(_file_of(spec) or "")
    if written.is_file() and file_sha256(written) == factory["sha256"]:
        return f"{written.resolve()}:{name}"
    raise PipecError(
        f"{build}: the model's factory file {recorded} is gone (compiled as {spec}); "
        f"pass --model NEW/PATH/{recorded.name}:{name} to launch.py, or recompile"
    )


def check_model(model, model_plan: dict, spec: str) -> None:  # type: ignore[no-untyped-def]
    """Raise PipecError when `model` (built from `spec`) no longer matches the plan's."""
    factory = model_plan.get("factory")
    if factory is None:  # compiled before plans recorded the model
        return
    found = fingerprint(model)
    if found != factory["fingerprint"]:
        raise PipecError(
            f"{spec} no longer matches the plan: its state_dict has {len(model.state_dict())} "
            f"tensors (fingerprint {found}), the plan's model {factory['tensors']} "
            f"({factory['fingerprint']}); the model changed since compiling: recompile"
        )
