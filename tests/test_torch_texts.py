"""The texts of torch's that pipec still reads, each pinned by a test: where torch gives no
structured record, pipec reads its message, and a torch upgrade that changes one fails its
test, which names the reader to mend.

- torchrun's failure report (`ChildFailedError` and its table): runtime/torchrun.py's
  `_Condense` makes it one line once a rank has said why.
- gloo's error for a peer gone: runtime/barrier.py's `GLOO_GIST` keeps its gist
  (tests/test_runtime_faults.py's `test_a_rank_that_died_between_steps_is_named` pins it).
- `torch.testing.assert_close`'s mismatch lines: runtime/gradcheck.py's `compare` keeps two.

Exit codes and signals come from torchelastic's records (runtime/agent.py), and the ranks
missing from a step barrier from the ranks' own notes in the store (runtime/barrier.py).
"""

from __future__ import annotations

import traceback

import torch
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from pipec.runtime.gradcheck import compare
from pipec.runtime.torchrun import _Condense


def test_torchruns_failure_report_condenses_to_one_line():
    failures = {
        1: ProcessFailure(local_rank=1, pid=11, exitcode=3, error_file="/nonexistent"),
        0: ProcessFailure(local_rank=0, pid=10, exitcode=-15, error_file="/nonexistent"),
    }
    try:
        raise ChildFailedError("launch.py", failures)
    except ChildFailedError:
        report = traceback.format_exc()
    condense = _Condense()
    out = "".join(condense(line, True) for line in report.splitlines(True)) + condense.rest()
    assert out == "torchrun: rank 1 failed first, then rank 0\n", report


def test_assert_closes_mismatch_lines_are_what_the_gradient_check_keeps():
    module = torch.nn.Linear(2, 2, bias=False)
    grads = {id(module.weight): torch.ones(2, 2)}
    (check,) = compare({0: module}, 0, grads, {"weight": torch.zeros(2, 2)})
    assert check.error.startswith("weight: Mismatched elements: 4 / 4"), check.error
    assert "; Greatest absolute difference: 1.0" in check.error, check.error
