"""Token trees are lossless in the native engine: a branch whose cells do not sit at cell index ==
position (several branches hold the same positions) still gets, bit for bit, the logits of plain
one-token decoding, because batch-invariant attention then gathers its cells in position order."""

from __future__ import annotations

import numpy as np
import pytest

from tinygguf import write_tiny_model

from pipeinfer_cli.native import LayerEngine


@pytest.fixture(scope="module", params=["llama", "qwen2", "gemma3"])  # gemma3: window 4 on 2 of 3 layers
def model(request, tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("tree") / f"{request.param}.gguf", arch=request.param, n_layer=3,
                            n_vocab=300, seed=5)


def plain(path, prompt, branch):
    """Logits of plain decoding: the prompt, then the branch one token at a time, in a fresh cache."""
    e = LayerEngine(str(path), 0, 3, n_ctx=256, n_seq_max=8)
    n = len(prompt)
    e.eval(tokens=prompt, pos=list(range(n)), seq_ids=[[0]] * n, output=[False] * (n - 1) + [True])
    return np.stack([e.eval(tokens=[t], pos=[n + i], seq_ids=[[0]], output=[True], batch_invariant=True)[0]
                     for i, t in enumerate(branch)])


@pytest.mark.parametrize("order", [(0, 1, 2), (2, 0, 1)])
def test_every_branch_of_a_tree_matches_plain_decoding(model, order):
    prompt = list(range(10, 40))
    branches = [[7, 11, 12, 13], [7, 21, 22, 23], [7, 31, 32, 33]]  # shared first token, split at 1
    want = [plain(model, prompt, b) for b in branches]
    e = LayerEngine(str(model), 0, 3, n_ctx=256, n_seq_max=8)
    n = len(prompt)
    e.eval(tokens=prompt, pos=list(range(n)), seq_ids=[[0]] * n, output=[False] * (n - 1) + [True])
    e.seq_cp_many(0, [1, 2, 3])
    toks, pos, sids, rows = [7], [n], [[1, 2, 3]], {}
    for b in order:  # branch layout in the batch (and so in the cache) varies
        rows[b] = [0]
        for i, t in enumerate(branches[b][1:], start=1):
            rows[b].append(len(toks))
            toks.append(t)
            pos.append(n + i)
            sids.append([b + 1])
    out = e.eval(tokens=toks, pos=pos, seq_ids=sids, output=[True] * len(toks), batch_invariant=True)
    for b in range(3):
        np.testing.assert_array_equal(out[rows[b]], want[b], err_msg=f"branch {b}")
    # Commit branch 2 (its cells are not at index == position), drop the others, decode on: still exact.
    e.seq_cp(3, 0, n, n + 4)
    for s in (1, 2, 3):
        e.seq_rm(s)
    assert e.kv_used_cells() == n + 4
    nxt = e.eval(tokens=[99], pos=[n + 4], seq_ids=[[0]], output=[True], batch_invariant=True)
    ref = plain(model, prompt, branches[2] + [99])
    np.testing.assert_array_equal(nxt[0], ref[-1])
