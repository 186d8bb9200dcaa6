"""Topology and placement: links cost every transfer, pair-adjacent keeps evictions in a node."""

import json
import re
from dataclasses import replace

import pytest

from pipec.compile import compile_schedule
from pipec.ir import PipecError
from pipec.passes.costs import CostModel, parse_mem
from pipec.passes.mapping import mirror_pairs, pair_adjacent, remap
from pipec.passes.registry import Request, build_schedule
from pipec.passes.topology import Link, Topology, make_topology, parse_links
from tests.helpers import run
from tests.test_cli import cli_run

# A 16-way pipeline on two 8-GPU nodes, inter-node bandwidth a tenth of intra-node (BPipe's
# re-evaluation). Stage inputs (what pipeline messages carry) are 0.3% of a stash, about
# GPT-3 96B's 2·s·b·h bytes against its stage stash.
TWO_NODES = "intra=0.5:0,inter=0.05:0"


def two_nodes(link: str = TWO_NODES) -> CostModel:
    return replace(parse_mem("in=0.003", CostModel()), topology=make_topology(16, 2, 8, link))


def test_a_message_costs_latency_plus_size_over_bandwidth_of_its_link():
    """1F1B p=2, m=1: F, message, F, BW, message, BW; a message carries the stage input."""
    for nodes in (1, 2):
        link = "intra=0.5:0.1,inter=0.25:0.2" if nodes == 2 else "intra=0.5:0.1"
        costs = replace(CostModel(), topology=make_topology(2, nodes, None, link))
        hop = (0.2 + (1 / 16) / 0.25) if nodes == 2 else (0.1 + (1 / 16) / 0.5)
        assert compile_schedule("1f1b", 2, 1, costs=costs).sim.makespan == pytest.approx(
            6 + 2 * hop
        )


def test_without_a_topology_every_transfer_costs_comm():
    costs = CostModel(comm=0.5)
    assert costs.transfer_time(0, 1, 1.0) == costs.transfer_time(0, 1, 100.0) == 0.5
    assert costs.transfer_time(1, 1, 1.0) == 0.0


def test_topology_round_trips_through_the_plan():
    costs = two_nodes("intra=inf:0.01,inter=0.4:0.05")
    assert costs.topology.intra == Link(float("inf"), 0.01)
    assert CostModel.from_json(json.loads(json.dumps(costs.to_json()))) == costs
    assert "topology" not in CostModel().to_json()  # plans without one keep their hash


@pytest.mark.parametrize(
    "nodes, gpus, link, message",
    [
        (2, 8, "intra=1:0", "--link needs inter=BW:LAT for 2 node(s) of 8 GPUs"),
        (3, None, "intra=1:0,inter=1:0", "--nodes 3 x --gpus-per-node 5 is 15 GPUs but --pp is 16"),
        (0, None, "intra=1:0", "--nodes must be at least 1"),
        (1, None, "intra=0:0", "--link intra bandwidth must be positive"),
        (1, None, "intra=1:-1", "must be a non-negative finite number"),
        (1, None, "intra=1", "--link: cannot read 'intra=1'"),
        (None, None, "", None),
    ],
)
def test_topology_errors_are_one_line(nodes, gpus, link, message):
    if message is None:
        assert make_topology(16, nodes, gpus, link) is None
        return
    with pytest.raises(PipecError, match=re.escape(message)):
        make_topology(16, nodes, gpus, link)
    assert parse_links("intra=2:0.5") == {"intra": Link(2.0, 0.5)}


def test_remap_moves_programs_and_keeps_every_order():
    sched = build_schedule("interleaved", Request(4, 8, 2))
    devices = (2, 0, 3, 1)
    moved = remap(sched, devices)
    assert [moved.orders[devices[r]] for r in range(4)] == list(sched.orders)
    assert moved.layout.stage_rank == tuple(devices[r] for r in sched.layout.stage_rank)
    assert mirror_pairs(moved.layout) == [(2, 1), (0, 3)]  # the same pairs, on devices


def test_pair_adjacent_puts_each_pair_on_adjacent_gpus_of_one_node():
    """p=16 on 2 x 8: pair (s, 15-s) on GPUs 2s, 2s+1 of node s // 4."""
    result = compile_schedule(
        "1f1b", 16, 64, costs=two_nodes(), evict=True, mapping="pair-adjacent"
    )
    topo, rank_of = result.costs.topology, result.compiled.layout.stage_rank
    for s in range(8):
        (node_a, gpu_a), (node_b, gpu_b) = topo.place(rank_of[s]), topo.place(rank_of[15 - s])
        assert node_a == node_b and abs(gpu_a - gpu_b) == 1
    assert result.sim.transfers and all(t.src // 8 == t.dst // 8 for t in result.sim.transfers)


def test_pair_adjacent_beats_sequential_when_evictions_cross_slow_links():
    """Both at the balanced bound 9. Sequential sends every eviction over the inter-node link
    (a stash in 20 T_F there) and its backwards wait; pair-adjacent keeps them on the intra-
    node link (2 T_F, hidden by prefetch) at the price of a second node crossing per pass."""
    seq = compile_schedule("1f1b", 16, 64, costs=two_nodes(), evict=True, mapping="sequential")
    adj = compile_schedule("1f1b", 16, 64, costs=two_nodes(), evict=True, mapping="pair-adjacent")
    plain = compile_schedule("1f1b", 16, 64, costs=two_nodes(), mapping="pair-adjacent")
    assert seq.plan["memory_limit"] == adj.plan["memory_limit"] == 9
    assert all(t.src // 8 != t.dst // 8 for t in seq.sim.transfers)
    assert adj.sim.makespan < seq.sim.makespan
    assert adj.sim.makespan == pytest.approx(plain.sim.makespan)  # no load waits
    best = compile_schedule("1f1b", 16, 64, costs=two_nodes(), evict=True, mapping="auto")
    assert best.plan["mapping"] == "pair-adjacent" and best.sim.makespan == adj.sim.makespan


def test_auto_keeps_sequential_when_nothing_is_faster():
    costs = replace(CostModel(), topology=make_topology(4, 1, None, "intra=4:0"))
    result = compile_schedule("1f1b", 4, 8, costs=costs, evict=True, mapping="auto")
    assert "mapping" not in result.plan  # sequential: ties go to it


def test_pair_adjacent_needs_pairs_inside_nodes():
    layout = build_schedule("1f1b", Request(6, 6, 1)).layout
    odd = Topology(2, 3, Link(1.0, 0.0), Link(1.0, 0.0))
    with pytest.raises(PipecError, match="--gpus-per-node 3 .*use an even number"):
        pair_adjacent(layout, odd)
    assert pair_adjacent(layout, None) == (0, 2, 4, 5, 3, 1)
    assert sorted(pair_adjacent(build_schedule("1f1b", Request(5, 5, 1)).layout, None)) == list(
        range(5)
    )


def test_cli_topology_mapping_and_show(tmp_path, capsys):
    args = [
        "-s",
        "1f1b",
        "-p",
        "16",
        "-m",
        "32",
        "--nodes",
        "2",
        "--link",
        TWO_NODES,
        "--mem",
        "in=0.003",
        "--evict",
        "--mapping",
        "pair-adjacent",
    ]
    assert cli_run("simulate", *args, "--json") == 0
    out = json.loads(capsys.readouterr().out)
    assert out["mapping"] == "pair-adjacent" and out["memory_limit"] == 9
    assert out["moved_inter_node"] == 0 and out["moved_stashes"] == 2 * out["evicted"] > 0
    assert cli_run("compile", *args, "-o", str(tmp_path / "b")) == 0
    assert "stash units moved per iteration (0 over inter-node links)" in capsys.readouterr().out
    assert cli_run("verify", str(tmp_path / "b")) == 0
    assert cli_run("show", str(tmp_path / "b"), "--lines", "1") == 0
    shown = capsys.readouterr().out
    assert "stage  rank  node  gpu" in shown
    assert "\n   15     1     0    1\n" in shown and "\n    4     8     1    0\n" in shown
    assert cli_run("simulate", "-s", "1f1b", "-p", "4", "-m", "8", "--mapping", "nope") == 2
    assert "Invalid value for '--mapping'" in capsys.readouterr().err


def test_placement_does_not_touch_default_builds():
    """No topology, sequential, no eviction: the same plan hash as before this feature."""
    assert run("1f1b", 4, 8).plan_hash == "f371753370ae34dd"
