"""The check before loading that a job fits each host's memory limit (runtime/loading.py): the ranks
that share a host share its limit, so what they load is added up, and a draft model (on the head or
on a draft rank) is counted with its KV cache."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from pipeinfer_cli.errors import UsageError
from pipeinfer_cli.models.gguf_info import read_model_info
from pipeinfer_cli.runtime import cpu_share
from pipeinfer_cli.runtime.loading import check_memory_limit, host_memory_needs
from pipeinfer_cli.planner.layout import RankPlan, Topology


def job(model, n_ctx: int = 4096, draft=None):
    return SimpleNamespace(model_path=model, n_ctx=n_ctx, engine_ctx=n_ctx, draft_path=draft,
                           draft_label=None if draft is None else "smollm2-135m-instruct")


def two_stages(n_layer: int, draft_rank: bool = False) -> Topology:
    half = n_layer // 2
    ranks = [RankPlan(0, "head", (0, half), 1), RankPlan(1, "stage", (half, n_layer), 1)]
    if draft_rank:
        ranks.append(RankPlan(2, "draft", (0, 0), 1))
    return Topology(ranks, 2, 2 if draft_rank else None, [0.5, 0.5])


def test_ranks_that_share_a_host_are_added_up(smollm2_path, monkeypatch):
    """Each of 2 ranks fits the limit alone, not both: on one host they are refused (naming both),
    on hosts of their own they load."""
    info = read_model_info(smollm2_path)
    cfg, topo = job(smollm2_path), two_stages(info.n_layer)
    needs = host_memory_needs(cfg, topo, 0, ["a", "a"], False)
    assert [n.rank for n in needs] == [0, 1]
    total = sum(n.bytes for n in needs)
    assert max(n.bytes for n in needs) < total * 0.7
    monkeypatch.setattr(cpu_share, "memory_limit_bytes", lambda *a: int(total * 0.8))
    check_memory_limit(cfg, topo, 0, ["a", "b"], False)  # a host each: fits
    for rank in (0, 1):
        with pytest.raises(UsageError) as e:
            check_memory_limit(cfg, topo, rank, ["a", "a"], False)
        line = str(e.value)
        assert line.startswith("ranks 0, 1 (host a) need about") and "together" in line, line
        assert "memory limit is" in line and "(cgroup)" in line and "fewer ranks on this host" in line


def test_the_head_s_draft_model_is_counted(smollm2_path, monkeypatch):
    info = read_model_info(smollm2_path)
    cfg, topo = job(smollm2_path, draft=smollm2_path), two_stages(info.n_layer)
    alone = host_memory_needs(cfg, topo, 0, ["a", "b"], False)
    with_draft = host_memory_needs(cfg, topo, 0, ["a", "b"], True)
    assert len(alone) == 1 and len(with_draft) == 2
    assert with_draft[1].bytes >= info.file_size and "draft model" in with_draft[1].what
    monkeypatch.setattr(cpu_share, "memory_limit_bytes", lambda *a: alone[0].bytes + info.file_size // 2)
    check_memory_limit(cfg, topo, 0, ["a", "b"], False)  # no draft in the job: fits
    with pytest.raises(UsageError, match="the draft model smollm2-135m-instruct and its KV cache"):
        check_memory_limit(cfg, topo, 0, ["a", "b"], True)
    # a draft rank holds the draft model; the head then does not
    topo3 = two_stages(info.n_layer, draft_rank=True)
    assert len(host_memory_needs(cfg, topo3, 0, ["a", "b", "c"], True)) == 1
    (d,) = host_memory_needs(cfg, topo3, 2, ["a", "b", "c"], True)
    assert d.rank == 2 and d.bytes == with_draft[1].bytes
