"""Slot geometry (decode/slot_geometry.py): the one place that counts a request's KV sequences and
cuts the engine into request slots."""

from __future__ import annotations

import re
from pathlib import Path

from pipeinfer_cli.decode.draft_spec import DraftSpec
from pipeinfer_cli.decode.session import DecodeOptions
from pipeinfer_cli.decode.slot_geometry import MAX_SEQUENCES, SlotGeometry, sequences_per_request
from pipeinfer_cli.runtime.job import JobConfig

SRC = Path(__file__).resolve().parent.parent / "src" / "pipeinfer_cli"


def test_sequences_per_request():
    assert sequences_per_request(4, 1) == 6  # canonical + 4 runs + spare
    assert sequences_per_request(4, 3) == 14  # a tree of 3 branches per run
    assert sequences_per_request(40, 4) == MAX_SEQUENCES
    assert sequences_per_request(4, 3, drafts=False) == 2


def test_job_geometry():
    one = JobConfig(Path("t.gguf"), "t", None, DraftSpec.lookup(), n_ctx=1000)
    assert one.geometry == SlotGeometry(1, 6, 1000) and one.slot_ctx == one.engine_ctx == 1000
    par = JobConfig(Path("t.gguf"), "t", None, DraftSpec.lookup(), n_ctx=1100, parallel=2,
                    decode=DecodeOptions(max_inflight=2, max_branches=2))
    assert par.geometry == SlotGeometry(2, 6, 512) and (par.geometry.n_seq, par.geometry.n_ctx) == (12, 1024)
    plain = JobConfig(Path("t.gguf"), "t", None, n_ctx=4096, parallel=4)
    assert plain.geometry.seqs_per_slot == 2  # iterative only: canonical + spare
    alone = JobConfig(Path("t.gguf"), "t", None, n_ctx=4096)
    assert alone.geometry.seqs_per_slot == 6


def test_engine_split_and_fit():
    g = SlotGeometry.of_engine(12, 1024, 2)
    assert (g.seqs_per_slot, g.cells_per_slot) == (6, 512) and g.fits
    wide = SlotGeometry(16, 14, 256)
    assert not wide.fits and wide.max_inflight_fitting(3) == 1


def test_one_definition_of_the_sequence_count():
    """The sequence count is written once: nothing else multiplies in-flight runs by branches."""
    pattern = re.compile(r"max_inflight\s*\*\s*max\(1,")
    found = [str(p.relative_to(SRC)) for p in SRC.rglob("*.py")
             if p.name != "slot_geometry.py" and pattern.search(p.read_text())]
    assert not found, f"a KV sequence count outside decode/slot_geometry.py: {found}"
