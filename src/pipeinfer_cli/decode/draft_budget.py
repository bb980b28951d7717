"""How far ahead of the committed tokens PipeInfer drafts: as far as a drafted token still has a
fair chance of being committed, by the acceptance measured so far.

A drafted token is committed only if every drafted token before it on the path is accepted too.
With a per-token acceptance rate a, the token d places ahead of the last committed one is reached
with probability about a^d; the tokens past the first rejection are drafted, launched and
verified for nothing (their runs are cancelled). So the head keeps drafted tokens in flight only
up to the depth D where a^D falls under `p_reach`: at a = 0.8 and p_reach = 0.5, 3 tokens ahead;
at a = 0.95, 13; a draft that is always right (a = 1) is not limited. The bar is lower where the
measured timings say a drafted token is cheap (`cost_share`: its verification row as a share of a
one-token run, plus its drafting on the head as a share of a token's pass): rows that cost next
to nothing (an accelerator's batches) are worth drafting at a lower chance, while on CPUs, where a
row costs about a one-token run on every stage, p_reach holds. The run that is being
drafted gets the room left (`room`), so run lengths follow the measured acceptance, and the draft
is asked for no more than that (a draft rank too). One drafted token is always allowed when none
is in flight, so that the acceptance goes on being measured.

The rate is the acceptance of the request's recent verified tokens (each older one weighs DECAY
less per newer one), starting from PRIOR_RATE worth PRIOR_WEIGHT tokens: the first runs of a
request draft about as far as a fair draft deserves. Which tokens are drafted changes, never which
are committed: the output is `iterative`'s.
"""

from __future__ import annotations

import math

PRIOR_RATE = 0.9  # acceptance assumed before any token is verified (6 tokens ahead at p_reach 0.5)
PRIOR_WEIGHT = 4.0  # worth this many verified tokens
DECAY = 0.97  # weight of the past at each newly verified token (about the last 30 count)
MAX_DEPTH = 1 << 16  # "no limit"


def _ema(old: float | None, new: float, w: float = 0.2) -> float:
    return new if old is None else (1 - w) * old + w * new


class DraftBudget:
    """The measured acceptance of one request, and the drafting depth it allows.

    p_reach: the least probability that a drafted token is reached (0: no limit). Where the
    stages' timings say a drafted token costs less than that share of a token's pass (rows that
    are nearly free to verify, a cheap draft), the bar is that cost instead: `cost_share`.
    """

    def __init__(self, p_reach: float):
        self.p_reach = p_reach
        self.verified = 0.0  # decayed count of verified drafted tokens
        self.accepted = 0.0  # decayed count of those accepted
        # Timings (moving averages, seconds): the head's stage computing a one-token run, its
        # extra time per further row of a batch, a one-token run's pass through the whole
        # pipeline (launch to result), and drafting one token on the head.
        self.t_single: float | None = None
        self.t_row: float | None = None
        self.t_pass: float | None = None
        self.t_draft: float | None = None

    # -- timings ---------------------------------------------------------------------------
    def head_run(self, rows: int, seconds: float) -> None:
        """The head's stage computed a run of `rows` rows in `seconds` (inside its launch)."""
        if rows == 1:
            self.t_single = _ema(self.t_single, seconds)
        elif self.t_single is not None:
            self.t_row = _ema(self.t_row, max(seconds - self.t_single, 0.0) / (rows - 1))

    def single_pass(self, seconds: float) -> None:
        """A one-token run's result came back `seconds` after its launch."""
        self.t_pass = _ema(self.t_pass, seconds)

    def drafted(self, n_tokens: int, seconds: float) -> None:
        """The head drafted n_tokens in `seconds` (a draft on the head's own cores)."""
        if n_tokens > 0:
            self.t_draft = _ema(self.t_draft, seconds / n_tokens)

    def cost_share(self) -> float | None:
        """What a drafted token costs against what it saves once committed (a one-token run on
        every stage): its verification row, as a share of a one-token run (measured on the head's
        stage; every stage computes the row), plus its drafting, as a share of a token's pass
        through the pipeline. None until measured."""
        if self.t_single is None or self.t_row is None or not self.t_pass:
            return None
        row = min(self.t_row / self.t_single, 1.0) if self.t_single > 0 else 1.0
        return (self.t_draft or 0.0) / self.t_pass + row

    def bar(self) -> float:
        """The least probability of being reached that a drafted token must have."""
        cost = self.cost_share()
        return self.p_reach if cost is None else min(self.p_reach, cost)

    def observe(self, drafted: int, accepted: int) -> None:
        """drafted tokens were verified, of which the first `accepted` were accepted."""
        for i in range(drafted):
            self.verified = self.verified * DECAY + 1.0
            self.accepted = self.accepted * DECAY + (1.0 if i < accepted else 0.0)

    @property
    def rate(self) -> float:
        """The acceptance rate per drafted token, as measured so far (with the prior)."""
        return (self.accepted + PRIOR_RATE * PRIOR_WEIGHT) / (self.verified + PRIOR_WEIGHT)

    def depth(self) -> int:
        """How many drafted tokens may be in flight ahead of the last committed token."""
        a, bar = self.rate, self.bar()
        if bar <= 0 or a >= 1.0:
            return MAX_DEPTH
        if a <= 0.0:
            return 0
        return min(MAX_DEPTH, int(math.log(bar) / math.log(a) + 1e-9))

    def room(self, in_flight: int) -> int:
        """Tokens the next run may draft, with `in_flight` drafted tokens already ahead of the
        committed ones (at least one when none is)."""
        return max(self.depth() - in_flight, 1 if in_flight == 0 else 0)
