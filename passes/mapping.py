"""Stage-to-rank mappings: policies as plain functions `(stage, n_stages, p) -> rank`."""

from __future__ import annotations

from collections.abc import Callable

Mapping = Callable[[int, int, int], int]


def sequential(stage: int, n_stages: int, p: int) -> int:
    """Consecutive stages on consecutive ranks, n_stages/p of them per rank."""
    return stage * p // n_stages


def interleaved(stage: int, n_stages: int, p: int) -> int:
    """Megatron's interleaving: stage s on rank s mod p, so each rank holds v strided chunks."""
    return stage % p


def v_shape(stage: int, n_stages: int, p: int) -> int:
    """The V placement over 2p stages: rank r holds stages r and 2p-1-r."""
    return stage if stage < p else n_stages - 1 - stage


def stage_ranks(mapping: Mapping, n_stages: int, p: int) -> tuple[int, ...]:
    return tuple(mapping(s, n_stages, p) for s in range(n_stages))
