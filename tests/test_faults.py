"""Lost, late and duplicated messages (the fault injector in the transport, PIPEINFER_DEBUG_FAULT).

- The injector's specification is parsed strictly: a bad one is one clear error.
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
from pipeinfer_cli.transport.faults import Fault, parse_faults
from pipeinfer_cli.transport.messages import Tag

ROOT = Path(__file__).resolve().parents[1]


def test_fault_spec_is_parsed():
    assert parse_faults("2:result:4:dup, 0:STREAM:1:delay=0.5") == [
        Fault(2, Tag.RESULT, 4, "dup"), Fault(0, Tag.STREAM, 1, "delay", 0.5)]


@pytest.mark.parametrize("spec", ["2:result:4", "x:result:1:drop", "1:nosuchtag:1:drop", "1:stream:0:drop",
                                  "1:stream:1:explode", "1:stream:1:delay=soon"])
def test_bad_fault_spec_is_one_clear_error(spec):
    with pytest.raises(UsageError, match="PIPEINFER_DEBUG_FAULT.*RANK:TAG:N:MODE"):
        parse_faults(spec)


@pytest.fixture
def self_link(monkeypatch):
    """make(fault): a Link on COMM_SELF (sends to rank 0 reach itself) with that fault planned."""
    from mpi4py import MPI

    from pipeinfer_cli.transport.mpi_link import Link

    made = []

    def make(fault: str):
        monkeypatch.setenv("PIPEINFER_DEBUG_FAULT", fault)
        made.append(Link(MPI.COMM_SELF))
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
