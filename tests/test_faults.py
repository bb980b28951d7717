"""Lost, late and duplicated messages, and ranks that fail (the fault injector, PIPEINFER_DEBUG_FAULT).

- The injector's specification is parsed strictly: a bad one is one clear error. The older
  PIPEINFER_DEBUG_FAIL=RANK:N means RANK:raise:N.
- In-process, on a link to itself: a duplicated message is recognised by its sequence number and
  dropped; a lost one is reported by the next message of its stream, naming both ranks.
- The representative subset of the fault matrix (scripts/fault_matrix.py): real jobs on 3 ranks plus
  a draft rank (and with the draft on the head), each ending in the fault-free text or one error line
  naming a rank, with no process left. `make fault-matrix` runs every cell.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

from pipeinfer_cli.errors import UsageError
from pipeinfer_cli.transport.faults import Fault, FaultInjector, fail_alias, parse_faults
from pipeinfer_cli.transport.messages import Tag

ROOT = Path(__file__).resolve().parents[1]


def test_fault_spec_is_parsed():
    assert parse_faults("2:result:4:dup, 0:STREAM:1:delay=0.5, 1:raise:3, 1:payload:2:sigill") == [
        Fault(2, Tag.RESULT, 4, "dup"), Fault(0, Tag.STREAM, 1, "delay", 0.5), Fault(1, None, 3, "raise"),
        Fault(1, Tag.PAYLOAD, 2, "sigill")]


@pytest.mark.parametrize("spec", ["2:result:4", "x:result:1:drop", "1:nosuchtag:1:drop", "1:stream:0:drop",
                                  "1:stream:1:explode", "1:stream:1:delay=soon", "1:raise", "1:raise:0",
                                  "1:raise:x", "1:stream:1:raise", "2:3"])
def test_bad_fault_spec_is_one_clear_error(spec):
    with pytest.raises(UsageError, match="PIPEINFER_DEBUG_FAULT.*RANK:TAG:N:MODE.*RANK:raise:N"):
        parse_faults(spec)


def test_the_old_fail_variable_means_raise():
    assert fail_alias("2:3") == "2:raise:3"
    assert fail_alias("1") == "1:raise:1"  # N defaults to 1, as it always did
    assert fail_alias("") == ""
    old = FaultInjector.from_env(2, {"PIPEINFER_DEBUG_FAIL": "2:3"})
    new = FaultInjector.from_env(2, {"PIPEINFER_DEBUG_FAULT": "2:raise:3"})
    assert old.raise_at == new.raise_at == 3 and old.faults == new.faults == []


def test_the_injector_holds_only_its_ranks_faults():
    env = {"PIPEINFER_DEBUG_FAULT": "1:stream:6:drop,2:raise:4", "PIPEINFER_DEBUG_FAIL": "1:5"}
    one, two = FaultInjector.from_env(1, env), FaultInjector.from_env(2, env)
    assert (one.faults, one.raise_at) == ([Fault(1, Tag.STREAM, 6, "drop")], 5)
    assert (two.faults, two.raise_at) == ([], 4)
    assert FaultInjector.from_env(0, env) is None  # nothing planned for rank 0
    assert FaultInjector.from_env(0, {}) is None
    assert two.copies(Tag.STREAM, lambda: None) == 1  # a rank that only raises sends every message


def test_a_rank_asks_its_links_injector_where_to_raise():
    from mpi4py import MPI

    from pipeinfer_cli.runtime.rank_report import fault_injection
    from pipeinfer_cli.transport.mpi_link import Link

    assert fault_injection(Link(MPI.COMM_SELF, faults=FaultInjector(0, parse_faults("0:raise:7")))) == 7
    assert fault_injection(Link(MPI.COMM_SELF)) is None
    assert fault_injection(None) is None


@pytest.fixture
def self_link():
    """make(fault): a Link on COMM_SELF (sends to rank 0 reach itself) with that fault planned."""
    from mpi4py import MPI

    from pipeinfer_cli.transport.mpi_link import Link

    made = []

    def make(fault: str):
        made.append(Link(MPI.COMM_SELF, faults=FaultInjector(0, parse_faults(fault))))
        return made[-1]

    yield make
    for link in made:  # every send was received: let MPI release the requests
        assert link.flush(timeout_s=5)


def _drain(link, tag) -> list[int]:
    """Every message of tag waiting on the link (sends to oneself complete when received)."""
    got = []
    while (st := link.probe(0, tag)) is not None:
        got.append(int(link.recv_array(0, tag, np.int64, st)[0]))
    link.progress_sends()
    return got


def test_a_duplicated_message_is_recognised_and_dropped(self_link):
    link = self_link("0:stream:2:dup")
    for i in range(1, 4):
        link.send_array(np.asarray([i], np.int64), 0, Tag.STREAM)
    assert _drain(link, Tag.STREAM) == [1, 2, 3]
    assert link.strays == 1


def test_a_lost_message_is_reported_by_the_next_one(self_link):
    from pipeinfer_cli.transport.mpi_link import MessageLostError

    link = self_link("0:result:2:drop")
    for i in range(1, 4):
        link.send_array(np.asarray([i], np.int64), 0, Tag.RESULT)
    assert int(link.recv_array(0, Tag.RESULT, np.int64)[0]) == 1
    with pytest.raises(MessageLostError, match="RESULT message 2 from rank 0 to rank 0 never arrived"):
        link.probe(0, Tag.RESULT)


def test_pickled_messages_carry_sequence_numbers_too(self_link):
    link = self_link("0:stats:1:dup")
    link.send_pickled({"a": 1}, 0, Tag.STATS)
    link.send_pickled({"b": 2}, 0, Tag.STATS)
    assert link.recv_pickled(0, Tag.STATS) == {"a": 1}
    assert link.recv_pickled(0, Tag.STATS) == {"b": 2}
    assert link.strays == 1


# -- the matrix's representative subset, in real jobs --------------------------------------------------

def _matrix():
    spec = importlib.util.spec_from_file_location("fault_matrix", ROOT / "scripts" / "fault_matrix.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


matrix = _matrix()
_references: dict[str, str] = {}


@pytest.mark.mpi
@pytest.mark.parametrize("name", matrix.SUBSET)
def test_fault_matrix_cell(smollm2_path, name):
    cell = matrix.cells([name])[0]
    if cell.topology not in _references:
        _references[cell.topology] = matrix.reference_text(str(smollm2_path), cell.topology)
    # A longer --rank-timeout than the full matrix's 3 s, so that a loaded machine cannot trip it, and
    # no judgement on the seconds (tests never assert on wall-clock time; the matrix reports them).
    rank_timeout = 6
    if cell.tag == "heartbeat":
        # Heartbeats are timed (one every rank_timeout/4 s), not sent per token: a job that ends
        # within two intervals sends too few on a fast, quiet machine and the fault never fires.
        # The first beat of a 1 s timeout fires within 0.25 s; should the loaded machine then trip
        # the timeout, that is one of the accepted outcomes (one clear error).
        cell.nth, rank_timeout = 1, 1
    matrix.run_cell(str(smollm2_path), cell, _references[cell.topology], rank_timeout=rank_timeout, within_s=None)
    assert cell.outcome in ("ok", "error"), f"{cell.name}: {cell.outcome} {cell.detail} {cell.problems}"
