"""A draft rank streams its tokens (runtime/remote_draft.py): the head-side proxy against a scripted
link, without MPI. What is checked: a request that continues the open stream is answered from it
without a message to the draft rank; a reply comes with the first token past the path; pieces of a
stream the head left are dropped; a diverging path opens a new stream; the end of a request stops
the stream and leaves nothing of it on the link; a synchronous proposal waits for all its tokens."""

from __future__ import annotations

from collections import deque

import numpy as np

from pipeinfer_cli.runtime.remote_draft import RemoteDrafter
from pipeinfer_cli.transport.messages import STREAM_AHEAD, DraftReply, DraftRequest, Msg, Tag


class ScriptedLink:
    """The head's side of a link to a draft rank at rank 1: requests are kept, replies are queued
    by the test (or by `answer_stop` for the end of a stream)."""

    def __init__(self):
        self.sent: list[DraftRequest] = []
        self.inbox: deque[np.ndarray] = deque()

    def send_array(self, arr, dest, tag):
        assert dest == 1 and tag == Tag.DRAFT_REQ
        req = DraftRequest.decode(np.asarray(arr, np.int64))
        self.sent.append(req)
        if req.kind == Msg.RUN and req.n_max == 0:  # the draft rank answers a stop with a final piece
            self.inbox.append(DraftReply([], [], req.stream, True).encode())

    def piece(self, stream: int, tokens, final=False):
        self.inbox.append(DraftReply(list(tokens), [0.9] * len(tokens), stream, final).encode())

    def probe(self, source, tag):
        assert source == 1 and tag == Tag.DRAFT_REP
        return len(self.inbox[0]) if self.inbox else None

    def recv_array(self, source, tag, dtype, status):
        return self.inbox.popleft()

    def progress_sends(self):
        pass

    def wait_probe(self, source, tag, on_idle=None):
        assert self.inbox, "the proxy would wait for a reply that never comes"

    def raise_reported_error(self):
        pass


def test_message_round_trip_keeps_the_stream_id_and_the_final_flag():
    req = DraftRequest.decode(DraftRequest(Msg.RUN, [5, 6, 7], 9, 0.25, stream=42).encode())
    assert (req.kind, req.path, req.n_max, req.p_min, req.stream) == (Msg.RUN, [5, 6, 7], 9, 0.25, 42)
    rep = DraftReply.decode(DraftReply([11, 12], [0.5, 0.75], stream=42, final=True).encode())
    assert (rep.tokens, rep.probs, rep.stream, rep.final) == ([11, 12], [0.5, 0.75], 42, True)
    empty = DraftReply.decode(DraftReply([], [], stream=3, final=False).encode())
    assert (empty.tokens, empty.stream, empty.final) == ([], 3, False)


def test_requests_that_continue_the_stream_are_answered_from_it_without_a_message():
    link = ScriptedLink()
    d = RemoteDrafter(link, 1)
    d.request([1, 2, 3], 2, 0.0)
    assert len(link.sent) == 1
    first = link.sent[0]
    assert first.path == [1, 2, 3] and first.n_max == 2 + STREAM_AHEAD
    assert d.poll() is None  # nothing has arrived
    link.piece(first.stream, [4])
    prop = d.poll()  # one token past the path is a reply
    assert prop.tokens == [4] and prop.base == [1, 2, 3] and not d.outstanding
    link.piece(first.stream, [5])
    link.piece(first.stream, [6])
    d.request([1, 2, 3, 4], 4, 0.0)  # the head launched 4: the stream goes on
    assert len(link.sent) == 1
    prop = d.poll()
    assert prop.tokens == [5, 6] and prop.base == [1, 2, 3, 4]
    # The path ran ahead of the stream along the same tokens: it is followed, not replaced.
    d.request([1, 2, 3, 4, 5, 6, 7], 4, 0.0)
    assert len(link.sent) == 1 and d.poll() is None
    link.piece(first.stream, [7, 8])
    assert d.poll().tokens == [8]


def test_a_diverging_path_opens_a_new_stream_and_the_old_one_is_ignored():
    link = ScriptedLink()
    d = RemoteDrafter(link, 1)
    d.request([1, 2], 3, 0.0)
    old = link.sent[-1].stream
    link.piece(old, [3])
    assert d.poll().tokens == [3]
    d.request([1, 2, 9], 3, 0.0)  # 3 was rejected: the target chose 9
    assert d.poll() is None
    new = link.sent[-1]
    assert len(link.sent) == 2 and new.path == [1, 2, 9] and new.stream != old
    link.piece(old, [4])  # drafted before the draft rank saw the new request
    link.piece(new.stream, [10])
    prop = d.poll()
    assert prop.tokens == [10] and prop.base == [1, 2, 9]


def test_a_stream_that_ends_short_of_the_path_is_asked_afresh():
    link = ScriptedLink()
    d = RemoteDrafter(link, 1)
    d.request([1], 1, 0.0)
    sid = link.sent[-1].stream
    link.piece(sid, [2])
    assert d.poll().tokens == [2]
    link.piece(sid, [3], final=True)
    d.request([1, 2, 3], 1, 0.0)  # the stream has nothing past 3 and will draft no more
    assert d.poll() is None
    assert len(link.sent) == 2 and link.sent[-1].path == [1, 2, 3]


def test_the_end_of_a_request_stops_the_stream_and_drains_its_pieces():
    link = ScriptedLink()
    d = RemoteDrafter(link, 1)
    d.request([1], 2, 0.0)
    sid = link.sent[-1].stream
    link.piece(sid, [2])
    link.piece(sid, [3])
    d.end_stream()
    stop = link.sent[-1]
    assert stop.kind == Msg.RUN and stop.n_max == 0 and stop.stream != sid
    assert not link.inbox and d.stream is None and not d.outstanding
    d.end_stream()  # nothing open: no message
    assert link.sent[-1] is stop


def test_a_synchronous_proposal_waits_for_all_its_tokens_or_the_end_of_the_stream():
    link = ScriptedLink()
    d = RemoteDrafter(link, 1)
    link.piece(1, [7])  # the stream the proposal will open has id 1
    link.piece(1, [8])
    link.piece(1, [9], final=True)
    prop = d.propose([5, 6], 3, 0.5)
    assert prop.tokens == [7, 8, 9] and link.sent[-1].n_max == 3  # no drafting ahead under a cutoff
    link.piece(2, [1], final=True)  # the draft fell under p_min after one token
    assert d.propose([5, 6, 7, 8, 9, 4], 3, 0.5).tokens == [1]
