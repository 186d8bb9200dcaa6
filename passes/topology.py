"""The machine: nodes of GPUs joined by links, and what moving data across each link costs.

Ranks are devices. After the placement pass (`passes/mapping.py: remap`) rank r runs on GPU
r % G of node r // G, which is how torchrun numbers global ranks, so the programs of a build
need no separate rank-to-device table. A transfer of `size` stash units between two ranks takes
the latency plus size / bandwidth of the link it crosses: intra-node between two GPUs of one
node, inter-node otherwise. Sizes are in the cost model's memory unit (one micro-batch's stash
of one rank's full share of the model) and bandwidths in those units per time unit, so a
transfer time is in the same unit as the F/B/W costs.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from pipec.ir import PipecError

_LINK = re.compile(r"^(intra|inter)=([^:]+):(.+)$")


@dataclass(frozen=True)
class Link:
    """One kind of link: bandwidth in stash units per time unit (inf: latency only)."""

    bandwidth: float
    latency: float

    def time(self, size: float) -> float:
        return self.latency + size / self.bandwidth

    def to_json(self) -> dict:
        # JSON has no infinity; null stands for an unlimited bandwidth.
        return {
            "bandwidth": None if math.isinf(self.bandwidth) else self.bandwidth,
            "latency": self.latency,
        }

    @staticmethod
    def from_json(d: dict) -> Link:
        bw = d["bandwidth"]
        return Link(math.inf if bw is None else float(bw), float(d["latency"]))


@dataclass(frozen=True)
class Topology:
    """`nodes` nodes of `gpus_per_node` GPUs; rank r is GPU r % G of node r // G."""

    nodes: int
    gpus_per_node: int
    intra: Link
    inter: Link

    @property
    def world(self) -> int:
        return self.nodes * self.gpus_per_node

    def place(self, rank: int) -> tuple[int, int]:
        """(node, gpu) of a rank."""
        return divmod(rank, self.gpus_per_node)

    def link(self, a: int, b: int) -> Link:
        return self.intra if a // self.gpus_per_node == b // self.gpus_per_node else self.inter

    def to_json(self) -> dict:
        return {
            "nodes": self.nodes,
            "gpus_per_node": self.gpus_per_node,
            "intra": self.intra.to_json(),
            "inter": self.inter.to_json(),
        }

    @staticmethod
    def from_json(d: dict) -> Topology:
        return Topology(
            int(d["nodes"]),
            int(d["gpus_per_node"]),
            Link.from_json(d["intra"]),
            Link.from_json(d["inter"]),
        )


def _link_number(text: str, what: str, allow_inf: bool) -> float:
    try:
        x = float(text)
    except ValueError:
        raise PipecError(f"--link {what}: '{text}' is not a number") from None
    if math.isnan(x) or x < 0 or (math.isinf(x) and not allow_inf):
        raise PipecError(f"--link {what}: '{text}' must be a non-negative finite number")
    return x


def parse_links(text: str) -> dict[str, Link]:
    """Parse `--link intra=BW:LAT,inter=BW:LAT` (bandwidth may be `inf`)."""
    links: dict[str, Link] = {}
    for item in filter(None, (t.strip() for t in text.split(","))):
        m = _LINK.match(item)
        if not m:
            raise PipecError(
                f"--link: cannot read '{item}'; expected intra=BW:LAT or inter=BW:LAT, "
                "e.g. --link intra=4:0.01,inter=0.4:0.05 (stashes per time unit : time)"
            )
        kind, bw, lat = m.groups()
        bandwidth = _link_number(bw, f"{kind} bandwidth", allow_inf=True)
        if bandwidth == 0:
            raise PipecError(f"--link {kind} bandwidth must be positive")
        links[kind] = Link(bandwidth, _link_number(lat, f"{kind} latency", allow_inf=False))
    return links


def make_topology(
    p: int, nodes: int | None, gpus_per_node: int | None, links: str
) -> Topology | None:
    """The topology the CLI options describe, or None when none was given (flat `comm`)."""
    if nodes is None and gpus_per_node is None and not links:
        return None
    for name, value in (("--nodes", nodes), ("--gpus-per-node", gpus_per_node)):
        if value is not None and value < 1:
            raise PipecError(f"{name} must be at least 1 (got {value})")
    if nodes is None:
        nodes = p // gpus_per_node if gpus_per_node else 1
    if gpus_per_node is None:
        gpus_per_node = p // nodes
    if nodes * gpus_per_node != p:
        raise PipecError(
            f"--nodes {nodes} x --gpus-per-node {gpus_per_node} is {nodes * gpus_per_node} GPUs "
            f"but --pp is {p}; one rank runs on each GPU, so they must be equal"
        )
    given = parse_links(links)
    need = ("intra", "inter") if nodes > 1 else ("intra",)
    missing = [k for k in need if k not in given]
    if missing:
        raise PipecError(
            f"--link needs {' and '.join(f'{k}=BW:LAT' for k in missing)} for {nodes} node(s) "
            f"of {gpus_per_node} GPUs, e.g. --link intra=4:0.01,inter=0.4:0.05"
        )
    intra = given["intra"]
    return Topology(nodes, gpus_per_node, intra, given.get("inter", intra))
