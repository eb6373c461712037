"""dsa_attention (indexer -> top-k -> sparse attention) and the index hash."""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("KILN_TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from kiln.kernels import dsa  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BACKENDS = ["torch", "triton"]


def _inputs(batch=2, tokens=10, heads=2, kv_heads=1, dim=8, index_heads=2, index_dim=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    shapes = [
        (batch, tokens, heads, dim), (batch, tokens, kv_heads, dim), (batch, tokens, kv_heads, dim),
        (batch, tokens, index_heads, index_dim), (batch, tokens, index_dim), (batch, tokens, index_heads),
    ]
    return [torch.randn(s, generator=gen).to(DEVICE) for s in shapes]


@pytest.mark.parametrize("backend", BACKENDS)
def test_topk_covering_every_earlier_key_equals_dense_causal_attention(backend):
    q, k, v, iq, ik, iw = _inputs(seed=1)
    out, indices = dsa.dsa_attention(q, k, v, iq, ik, iw, topk=16, backend=backend)
    dense = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.expand(-1, -1, 2, -1).transpose(1, 2),
        v.expand(-1, -1, 2, -1).transpose(1, 2), is_causal=True,
    ).transpose(1, 2)
    torch.testing.assert_close(out, dense, rtol=1e-5, atol=1e-5)
    tokens = q.shape[1]
    for t in range(tokens):  # each row selects exactly its t + 1 earlier keys, then -1
        assert sorted(indices[0, t, : t + 1].tolist()) == list(range(t + 1))
        assert (indices[:, t, t + 1 :] == -1).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_selection_follows_indexer_and_is_chunk_invariant(backend):
    q, k, v, iq, ik, iw = _inputs(seed=2)
    out, indices = dsa.dsa_attention(q, k, v, iq, ik, iw, topk=3, backend=backend)
    scores = dsa.indexer_scores(iq, ik, iw, backend="torch")
    assert torch.equal(indices, dsa.topk_indices(scores, 3, backend="torch"))
    chunked = dsa.dsa_attention(q, k, v, iq, ik, iw, topk=3, query_chunk=4, backend=backend)
    assert torch.equal(chunked.indices, indices)
    assert torch.equal(chunked.out, out)
    assert torch.equal(out, dsa.sparse_attention(q, k, v, indices, backend=backend))


def test_gradients_flow_to_attention_inputs_only():
    q, k, v, iq, ik, iw = _inputs(seed=3)
    for x in (q, k, v, iq):
        x.requires_grad_()
    out, _ = dsa.dsa_attention(q, k, v, iq, ik, iw, topk=4, backend="torch")
    out.sum().backward()
    assert q.grad is not None and k.grad is not None and v.grad is not None
    assert iq.grad is None  # the indexer is frozen


def test_index_hash_is_stable_and_sensitive():
    q, k, v, iq, ik, iw = _inputs(seed=4)
    _, indices = dsa.dsa_attention(q, k, v, iq, ik, iw, topk=4, backend="torch")
    h = dsa.index_hash(indices)
    assert 0 <= h < 2**64
    assert h == dsa.index_hash(torch.tensor(indices.tolist()))  # rebuilt from plain numbers
    assert h == dsa.index_hash(indices.transpose(0, 1).contiguous().transpose(0, 1))  # any layout
    changed = indices.clone()
    changed[1, 7, 0] += 1
    assert dsa.index_hash(changed) != h
    assert dsa.index_hash(indices.reshape(1, -1, 4)) != h  # same bytes, other shape
    assert dsa.index_hash(indices[1:2]) != dsa.index_hash(indices[0:1])
    with pytest.raises(ValueError, match="int64"):
        dsa.index_hash(indices.int())


def test_index_hash_value_is_fixed_across_releases():
    # Trajectories store these hashes; a change of scheme would make old and new ones disagree.
    indices = torch.tensor([[[0, -1], [1, 0]]])
    assert dsa.index_hash(indices) == dsa.index_hash(torch.tensor([[[0, -1], [1, 0]]], dtype=torch.int64))
    import hashlib

    digest = hashlib.blake2b(digest_size=8, person=b"kiln-dsa-idx")
    digest.update(b"(1, 2, 2)")
    digest.update(b"".join(x.to_bytes(8, "little", signed=True) for x in [0, -1, 1, 0]))
    assert dsa.index_hash(indices) == int.from_bytes(digest.digest(), "little")
