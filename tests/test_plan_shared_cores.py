"""Ranks that share a host's cores (planner/shared_cores.py): the processor-sharing arithmetic on
hand-computed cases, and what it changes in a prediction: nothing where the host's CPUs suffice or
one stage computes at a time, a slower pipeinfer where three single-thread ranks overlap on two."""

from __future__ import annotations

from dataclasses import replace

import pytest

from planning import make_profile, prompt_trace, rank_costs
from pipeinfer_cli.decode.session import DecodeOptions
from pipeinfer_cli.planner.predict import Topology, build_pipeline, predict
from pipeinfer_cli.planner.replay import SyntheticChains
from pipeinfer_cli.planner.shared_cores import Computation, HostCPU


def _drain(cpu: HostCPU) -> dict[str, float]:
    """Run a host's computations to their ends, as the simulation does: the earliest end first,
    the others re-rated at that moment."""
    ends = {}
    while cpu.running:
        c = min(cpu.running, key=lambda c: c.end)
        t = c.end
        cpu.finish(t, c)
        ends[c.task] = t
    return ends


def test_two_computations_on_one_cpu_share_it():
    cpu = HostCPU(1.0)
    a, b = Computation(1, 0.010, 0.0, task="a"), Computation(1, 0.010, 0.0, task="b")
    cpu.start(0.0, a)
    cpu.start(0.0, b)
    assert a.rate == b.rate == 0.5
    assert _drain(cpu) == pytest.approx({"a": 0.020, "b": 0.020})


def test_a_host_below_one_cpu_slowed_its_rank_in_calibration_already():
    """A rank of 1 thread on a host of a quarter CPU was calibrated at that quota: alone it runs at
    its measured speed (not a quarter of it, which predicted 8 capped hosts 3.6x too slow); a second
    computation there halves both, as on a host of one CPU."""
    cpu = HostCPU(0.25)
    a = Computation(1, 0.010, 0.0, task="a")
    cpu.start(0.0, a)
    assert a.rate == 1.0 and _drain(cpu) == {"a": 0.010}
    a, b = Computation(1, 0.010, 0.0, task="a"), Computation(1, 0.010, 0.0, task="b")
    cpu.start(0.0, a)
    cpu.start(0.0, b)
    assert a.rate == b.rate == 0.5
    assert _drain(cpu) == pytest.approx({"a": 0.020, "b": 0.020})
    two = HostCPU(0.5)  # a 2-thread rank on half a CPU, calibrated there, and a 1-thread draft beside it
    c, d = Computation(2, 0.010, 0.0, task="c"), Computation(1, 0.010, 0.0, task="d")
    two.start(0.0, c)
    assert c.rate == 1.0
    two.start(0.0, d)
    assert c.rate == pytest.approx(2 / 3) and d.rate == pytest.approx(1 / 3)


def test_a_computation_that_starts_later_shares_only_while_both_run():
    # a alone for 5 ms (5 ms of work left), then both at half speed: a's 5 ms take 10 (ends at 15),
    # b has done 5 of its 10 ms by then and finishes alone at 20.
    cpu = HostCPU(1.0)
    a, b = Computation(1, 0.010, 0.0, task="a"), Computation(1, 0.010, 0.005, task="b")
    cpu.start(0.0, a)
    cpu.start(0.005, b)
    assert _drain(cpu) == pytest.approx({"a": 0.015, "b": 0.020})


def test_threads_within_the_host_s_cpus_run_at_their_own_speed():
    cpu = HostCPU(2.0)
    a, b = Computation(1, 0.010, 0.0, task="a"), Computation(1, 0.003, 0.0, task="b")
    cpu.start(0.0, a)
    cpu.start(0.0, b)
    assert _drain(cpu) == {"a": 0.010, "b": 0.003}  # exactly start + work: never rebased
    # three computations of one thread on two CPUs: each at two thirds of its speed
    three = [Computation(1, 0.010, 0.0, task=i) for i in range(3)]
    for c in three:
        cpu.start(0.0, c)
    assert _drain(cpu) == pytest.approx({0: 0.015, 1: 0.015, 2: 0.015})


def one_host(n_ranks: int, usable: float = 2.0, threads: int = 1, **costs):
    """n ranks on one host ("vm") of `usable` CPUs, each computing with `threads`."""
    return [replace(rank_costs(i, **costs), host="vm", threads=threads, usable_cpus=usable, ranks_per_host=n_ranks)
            for i in range(n_ranks)]


def split(n: int, n_layer: int = 21) -> list[tuple[int, int]]:
    per = n_layer // n
    return [(i * per, (i + 1) * per if i < n - 1 else n_layer) for i in range(n)]


def predictions(ranks, mode: str, draft=None, **opts):
    prof = make_profile(len(ranks), n_layer=21, ranks=ranks, latency_s=1e-4, draft_token_s=0.5e-3)
    pt = prompt_trace(n_gen=48)
    topo = Topology(list(range(len(ranks))), split(len(ranks)), draft)
    return predict(prof, topo, mode, pt, DecodeOptions(**opts), SyntheticChains(pt, 0.8, 24)).to_json()


def own_hosts(n_ranks: int, **costs):
    return [replace(rank_costs(i, **costs), threads=1, usable_cpus=2.0) for i in range(n_ranks)]


def test_three_single_thread_ranks_on_two_cpus_slow_pipeinfer_down():
    """pipeinfer keeps several stages computing at once: on one host of 2 CPUs, 3 ranks stretch
    each other's computations, so it is slower than the same ranks on hosts of their own."""
    costs = dict(per_row=0.05e-3)
    shared = predictions(one_host(3, **costs), "pipeinfer", "head")
    alone = predictions(own_hosts(3, **costs), "pipeinfer", "head")
    assert shared["tok_per_s"] < 0.97 * alone["tok_per_s"]
    assert shared["n_gen"] == alone["n_gen"] == 48  # lossless either way


def test_one_stage_at_a_time_is_unchanged_by_sharing():
    """iterative computes one stage at a time: the shared host never has more than one rank busy."""
    assert predictions(one_host(3), "iterative") == predictions(own_hosts(3), "iterative")


def test_two_single_thread_ranks_on_two_cpus_are_unchanged():
    for mode, draft in (("iterative", None), ("speculative", "head"), ("pipeinfer", "head")):
        shared = predictions(one_host(2, per_row=0.05e-3), mode, draft)
        assert shared == predictions(own_hosts(2, per_row=0.05e-3), mode, draft), mode


def test_the_event_model_gives_the_closed_form_schedule_where_nothing_shares(monkeypatch):
    """Forced through the hosts' CPU model, ranks on hosts of their own get the very figures of the
    closed-form schedule (bit for bit), cancellations and a draft rank included."""
    from functools import partial

    from pipeinfer_cli.planner import predict as p
    from pipeinfer_cli.planner.sim_pipeline import SimulatedPipeline

    prof = make_profile(4, n_layer=21, ranks=own_hosts(4, per_row=0.05e-3, overhead_s=1e-4),
                        latency_s=2e-4, bytes_per_s=1e8, draft_token_s=1e-3)
    pt = prompt_trace(n_gen=40)
    for draft in ("head", 3):
        topo = Topology([0, 1, 2], split(3), draft)
        out = []
        for forced in (None, True):
            monkeypatch.setattr(p, "SimulatedPipeline", partial(SimulatedPipeline, shared_cores=forced))
            assert (build_pipeline(prof, topo, pt, DecodeOptions(), 4096).sim is not None) == bool(forced)
            out.append(predict(prof, topo, "pipeinfer", pt, DecodeOptions(), SyntheticChains(pt, 0.6, 24)).to_json())
        assert out[0] == out[1], draft
        assert out[0]["runs"]["cancelled"] > 0


def test_a_draft_rank_on_the_head_s_host_competes_with_it():
    """Target ranks and a draft rank on one host of 2 CPUs, pipeinfer: the draft computing beside
    the two stages stretches them (and they it)."""
    costs = dict(per_row=0.05e-3)

    def run(ranks):
        prof = make_profile(3, n_layer=21, ranks=ranks, latency_s=1e-4, draft_token_s=2e-3)
        pt = prompt_trace(n_gen=48)
        return predict(prof, Topology([0, 1], split(2), 2), "pipeinfer", pt, DecodeOptions(),
                       SyntheticChains(pt, 0.8, 24)).to_json()

    assert run(one_host(3, **costs))["tok_per_s"] < run(own_hosts(3, **costs))["tok_per_s"]


# -- a job the model cannot describe is refused -----------------------------------------------------
def test_unmodelled_names_the_host_and_the_fix():
    from pipeinfer_cli.planner.shared_cores import unmodelled

    assert unmodelled([(0, "vm", 1, 2.0), (1, "vm", 1, 2.0), (2, "vm", 1, 2.0)]) is None  # one thread each
    assert unmodelled([(0, "vm", 2, 2.0), (1, "other", 2, 2.0)]) is None  # a host each
    assert unmodelled([(0, "vm", 2, 4.0), (1, "vm", 2, 4.0)]) is None  # enough CPUs
    line = unmodelled([(0, "vm", 2, 2.0), (1, "vm", 2, 2.0)])
    assert line.startswith("ranks 0, 1 compute at once on vm with 2/2 threads, 4 threads on its 2 usable CPUs")
    assert "--threads 1" in line


def test_plan_refuses_multi_thread_ranks_overlapping_on_too_few_cpus(smollm2_path, tmp_path):
    """Two ranks of 2 threads on one host of 2 CPUs (as calibrated): iterative computes one at a time
    and is planned; pipeinfer overlaps them and is refused in one line, --force plans it anyway."""
    import json
    import os
    import subprocess
    import sys

    from pipeinfer_cli.models.gguf_info import read_model_info
    from pipeinfer_cli.planner.identity import model_sha256

    info = read_model_info(smollm2_path)
    ranks = [replace(rank_costs(r), host="nodeA", threads=2, usable_cpus=2.0, ranks_per_host=2) for r in range(2)]
    prof = make_profile(2, n_layer=info.n_layer, ranks=ranks, file_bytes=info.file_size,
                        sha256=model_sha256(smollm2_path))
    prof.model.layer_bytes, prof.model.n_embd = info.layer_bytes, info.n_embd
    path = tmp_path / "p.json"
    prof.save(path)

    def plan(*args):
        return subprocess.run([sys.executable, "-m", "pipeinfer_cli", "plan", str(smollm2_path), "--profile", str(path),
                               "-p", "Hi", "-n", "4", "--draft", "lookup", "--threads", "2", *args],
                              capture_output=True, text=True, timeout=300, env=dict(os.environ))

    r = plan("--modes", "iterative,pipeinfer")
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    (line,) = r.stderr.strip().splitlines()
    assert line.startswith("Error: pipeinfer: ranks 0, 1 compute at once on nodeA with 2/2 threads"), line
    assert "or plan --modes iterative alone; or pass --force to plan anyway" in line
    ok = plan("--modes", "iterative", "--json")
    assert ok.returncode == 0, ok.stderr
    forced = plan("--modes", "pipeinfer", "--json", "--force")
    assert forced.returncode == 0 and "--force: planning anyway" in forced.stderr, forced.stderr
    assert json.loads(forced.stdout)["modes"]["pipeinfer"]["tok_per_s"] > 0


def test_the_head_and_a_stage_on_one_cpu_stretch_each_other_in_the_pipeline():
    """Two single-thread ranks on a host of 1 CPU, 10 layers of 1 ms each. Run A: the head alone,
    0-10 ms. Run B, launched at once: the head's layers of B and stage 1's of A share the CPU from
    10 ms, both end at 30 ms; stage 1 then computes B alone until 40 ms."""
    prof = make_profile(2, ranks=one_host(2, usable=1.0))
    pipe = build_pipeline(prof, Topology([0, 1], [(0, 10), (10, 20)]), prompt_trace(), DecodeOptions(), 4096)
    assert pipe.sim is not None
    a = pipe.launch([1], [0], [[0]], [True])
    assert pipe.t == pytest.approx(0.010)
    b = pipe.launch([2], [1], [[0]], [True])
    assert pipe.t == pytest.approx(0.030)  # the head's 10 ms took 20
    ra, rb = pipe.inflight
    assert (ra.starts, ra.ends) == (pytest.approx([0.010]), pytest.approx([0.030]))
    assert (rb.starts, rb.ends) == (pytest.approx([0.030]), pytest.approx([0.040]))
    assert [pipe.next_result().run_id for _ in range(2)] == [a, b]
    assert pipe.t == pytest.approx(0.040)
    assert pipe.busy_s == pytest.approx([0.030, 0.030])  # stretched time counts as busy


def test_a_cancel_under_contention_skips_or_stops_the_run():
    """As above; B cancelled once the head has sent it: its cancel overtakes it, stage 1 skips it
    (its fixed cost only, nil here). Cancelled while stage 1 computes it: it stops after one layer
    at the stretched rate (alone by then: 1 ms)."""
    prof = make_profile(2, ranks=one_host(2, usable=1.0))
    topo = Topology([0, 1], [(0, 10), (10, 20)])
    pipe = build_pipeline(prof, topo, prompt_trace(), DecodeOptions(), 4096)
    pipe.launch([1], [0], [[0]], [True])
    b = pipe.launch([2], [1], [[0]], [True])
    pipe.cancel([b])
    rb = pipe.inflight[1]
    assert rb.computed == [False] and rb.ends[0] - rb.starts[0] == pytest.approx(0.0, abs=1e-9)
    assert pipe.next_result().tokens is not None and pipe.next_result().tokens is None

    pipe = build_pipeline(prof, topo, prompt_trace(), DecodeOptions(), 4096)
    pipe.launch([1], [0], [[0]], [True])
    b = pipe.launch([2], [1], [[0]], [True])
    pipe.next_result()  # A's result, at 30 ms: stage 1 starts B then, alone
    pipe.t = 0.035
    pipe.cancel([b])
    rb = pipe.inflight[0]
    assert rb.computed == [False] and rb.ends == pytest.approx([0.036])
