"""Whether drafting pays on a pipeline of one stage, measured run by run.

With one stage nothing is idle: the draft and every verification row take the same cores the
target's next token would. On a CPU, where a batch of k rows costs about k single-token runs
(BENCHMARKS.md, "PipeInfer on three topologies"), a drafted token pays only if it is accepted more
often than its drafting and its verification row cost, in single-token runs. A 0.5B draft of a
1.5B target never does (BENCHMARKS.md, "Drafting only while it pays, on one rank"); prompt lookup
does on text that copies its prompt.

So `pipeinfer` on one stage keeps a balance, in seconds: each speculative run adds the time its
accepted tokens saved (accepted x the time of a one-token run) and subtracts what it cost (the
drafting plus the run's own compute); the past decays at each run. While the balance is negative,
the head stops drafting and decodes one token at a time, with a probe every `interval` tokens
(the interval doubles after each probe that did not pay, up to MAX_INTERVAL), so a request whose
text turns copyable later gets its speculation back. When the drafting alone cost more than its
run could have saved with every token accepted (a 0.5B draft of a 1.5B target on a CPU), no
acceptance rate would pay for it, and drafting ends for the request: probing would not help
either, since a draft model must first catch up on every token it skipped. Which runs are launched changes, never what
is committed: the tokens are those of `iterative`.

A draft model must first read the prompt (its prompt pass, a sizeable share of the target's
prefill: BENCHMARKS.md, "The draft's prompt pass, deferred behind a probe") before it can propose
anything, and on one stage that pass takes the cores too. So it is deferred: the first draft of a
request is a probe from the last PROBE_CONTEXT tokens only (what drafting and verification cost
does not depend on how much context the draft read), and the prompt pass runs only once a probe
says the draft is not hopeless.
What a job has learned stays with the job (`DraftMemory`): a draft found hopeless is not probed
again by its later requests (a server's, a benchmark's, a chat's turns).

Not used with several stages (speculative runs fill pipeline bubbles there, a different account)
nor with a draft rank (its own cores).
"""

from __future__ import annotations

DECAY = 0.7  # weight of the balance so far at each speculative run: about the last 3 runs count
FIRST_INTERVAL = 8  # one-token runs before the first probe after a pause
MAX_INTERVAL = 256
SLACK = 0.05  # a deficit under this share of a one-token run (a lookup that found nothing) is no loss
PROBE_CONTEXT = 32  # tokens a draft model reads before its probe, instead of the whole prompt


class DraftMemory:
    """What the requests of one job learned about its drafters on this stage."""

    def __init__(self) -> None:
        self.hopeless: set[str] = set()  # drafter names (`Drafter.name`) that cannot pay here


class DraftEconomy:
    def __init__(self) -> None:
        self.t_single: float | None = None  # seconds of a one-token run (moving average)
        self.balance = 0.0  # seconds saved minus seconds spent, recent runs weighted most
        self.interval = FIRST_INTERVAL
        self.wait = 0  # one-token runs left before the next probe; 0: drafting is on
        self.probe_due = False  # the pause is over: the next draft is a probe
        self.probing = False  # a probe is under way, judged by its own result
        self.pauses = 0  # times drafting was switched off (a metric)
        self.off = False  # drafting ended for this request
        # The last attempt: drafting seconds, tokens launched, their run's seconds.
        self.draft_s, self.n_launched, self.run_s = 0.0, 0, 0.0

    def single_run(self, seconds: float) -> None:
        """A one-token, non-speculative run took `seconds`; count down to the next probe."""
        self.t_single = seconds if self.t_single is None else 0.8 * self.t_single + 0.2 * seconds
        if self.wait > 0:
            self.wait -= 1
            self.probe_due = self.wait == 0

    def new_run(self) -> None:
        """A draft (and perhaps a speculative run) begins: the balance so far decays."""
        self.balance *= DECAY
        self.draft_s, self.n_launched, self.run_s = 0.0, 0, 0.0

    def drafted(self, seconds: float) -> None:
        """Drafting took `seconds`."""
        self.balance -= seconds
        self.draft_s += seconds

    def spent(self, seconds: float, n_tokens: int) -> None:
        """A speculative run of n_tokens drafted tokens took `seconds` to compute."""
        self.balance -= seconds
        self.run_s += seconds
        self.n_launched += n_tokens

    def accepted(self, n: int) -> None:
        """n drafted tokens were accepted: each saved a one-token run."""
        if n > 0 and self.t_single is not None:
            self.balance += n * self.t_single

    def hopeless(self) -> bool:
        """The last attempt's drafting alone cost more than its run could have saved with every
        token accepted: no acceptance rate makes this draft pay here."""
        return (self.n_launched > 0 and self.t_single is not None
                and self.draft_s > self.n_launched * self.t_single - self.run_s)

    def cost_probe_passed(self) -> bool:
        """Judge a probe drafted from a short context (the prompt not read) by its cost alone, its
        tokens having been drafted without the prompt: if it is hopeless, drafting ends; otherwise
        the account starts afresh."""
        self.off = self.hopeless()
        self.pauses += self.off
        self.balance = 0.0
        return not self.off

    def may_draft(self) -> bool:
        """Whether to draft now. Called when every speculative run launched so far is verified
        (on one stage a run is computed at launch): drafting stops if the recent runs did not pay."""
        if self.wait > 0 or self.off:
            return False
        if self.probe_due:
            self.probe_due, self.probing, self.balance = False, True, 0.0
            return True
        if self.t_single is None or self.balance >= -SLACK * self.t_single:
            if self.probing:
                self.interval, self.probing = FIRST_INTERVAL, False
            return True
        if self.probing:
            self.interval = min(2 * self.interval, MAX_INTERVAL)
        self.probing = False
        self.off = self.hopeless()
        self.wait = self.interval
        self.pauses += 1
        return False
