"""DSA indexer scores and deterministic top-k: accuracy against float64, exact determinism.

The Triton kernels run compiled on a GPU and under Triton's interpreter on the CPU; the
interpreter must be switched on before triton is imported, hence the environment line first.
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("KILN_TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from kiln.kernels import dsa  # noqa: E402
from kiln.kernels.dsa import topk as topk_mod  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BACKENDS = ["torch", "triton"]


def _indexer_inputs(batch=2, tokens=24, keys=None, heads=3, dim=8, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    keys = tokens if keys is None else keys
    q = torch.randn(batch, tokens, heads, dim, generator=gen).to(dtype)
    k = torch.randn(batch, keys, dim, generator=gen).to(dtype)
    w = torch.randn(batch, tokens, heads, generator=gen).to(dtype)
    return q.to(DEVICE), k.to(DEVICE), w.to(DEVICE)


def _indexer_f64(q, k, w, offset):
    """Straight from the definition, in float64."""
    logits = torch.einsum("bthd,bsd->bths", q.double(), k.double())
    scores = (w.double()[..., None] * torch.relu(logits)).sum(dim=2)
    tokens, keys = q.shape[1], k.shape[1]
    future = torch.arange(keys, device=q.device)[None, :] > torch.arange(tokens, device=q.device)[:, None] + offset
    return scores.masked_fill(future, float("-inf"))


def _oracle_topk(row: list[float], k: int) -> list[int]:
    """Best-first by (score, lower index) over finite scores, -1 padded."""
    finite = [i for i, x in enumerate(row) if x == x and abs(x) != float("inf")]
    order = sorted(finite, key=lambda i: (-row[i], i))[:k]
    return order + [-1] * (k - len(order))


# ------------------------------------------------------------------------------------ indexer


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_indexer_matches_float64_definition(backend, dtype):
    q, k, w = _indexer_inputs(dtype=dtype, seed=1)
    got = dsa.indexer_scores(q, k, w, backend=backend)
    want = _indexer_f64(q, k, w, offset=0)
    assert got.dtype == torch.float32 and got.shape == (2, 24, 24)
    assert torch.equal(torch.isneginf(got), torch.isneginf(want))
    finite = torch.isfinite(want)
    # bfloat16 inputs multiply exactly in float32, so both dtypes carry only accumulation error.
    torch.testing.assert_close(got.double()[finite], want[finite], rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_indexer_float64_inputs_stay_float64(backend):
    q, k, w = _indexer_inputs(dtype=torch.float64, tokens=12, seed=2)
    got = dsa.indexer_scores(q, k, w, backend=backend)
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, _indexer_f64(q, k, w, 0), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("backend", BACKENDS)
def test_indexer_decode_offset_matches_prefill_rows(backend):
    q, k, w = _indexer_inputs(tokens=20, seed=3)
    full = dsa.indexer_scores(q, k, w, backend=backend)
    last = dsa.indexer_scores(q[:, -3:], k, w[:, -3:], backend=backend)  # offset defaults to 17
    explicit = dsa.indexer_scores(q[:, -3:], k, w[:, -3:], offset=17, backend=backend)
    assert torch.equal(last, explicit)
    assert torch.equal(torch.isneginf(last), torch.isneginf(full[:, -3:]))
    torch.testing.assert_close(last, full[:, -3:], rtol=1e-6, atol=1e-6)
    assert torch.isneginf(last[:, 0, 18:]).all() and torch.isfinite(last[:, 0, :18]).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_indexer_bitwise_deterministic_and_batch_invariant(backend):
    q, k, w = _indexer_inputs(batch=3, seed=4)
    first = dsa.indexer_scores(q, k, w, backend=backend)
    assert torch.equal(first, dsa.indexer_scores(q, k, w, backend=backend))
    alone = dsa.indexer_scores(q[1:2], k[1:2], w[1:2], backend=backend)
    assert torch.equal(alone[0], first[1])
    perm = torch.tensor([2, 0, 1])
    permuted = dsa.indexer_scores(q[perm], k[perm], w[perm], backend=backend)
    assert torch.equal(permuted, first[perm])


def test_indexer_rejects_bad_shapes_and_backend():
    q, k, w = _indexer_inputs()
    with pytest.raises(ValueError, match="w must be"):
        dsa.indexer_scores(q, k, w[:, :, :1])
    with pytest.raises(ValueError, match="backend"):
        dsa.indexer_scores(q, k, w, backend="cuda")
    with pytest.raises(ValueError, match="offset"):
        dsa.indexer_scores(q, k[:, :5], w)


# --------------------------------------------------------------------------------------- topk


@pytest.mark.parametrize("backend", BACKENDS)
def test_topk_random_scores_match_oracle(backend):
    gen = torch.Generator().manual_seed(5)
    scores = torch.randn(2, 12, 150, generator=gen)  # more than one 64-wide block per row
    got = dsa.topk_indices(scores.to(DEVICE), 20, backend=backend).cpu()
    assert got.dtype == torch.int64 and got.shape == (2, 12, 20)
    for b in range(2):
        for t in range(12):
            assert got[b, t].tolist() == _oracle_topk(scores[b, t].tolist(), 20)


@pytest.mark.parametrize("backend", BACKENDS)
def test_topk_ties_signed_zeros_and_short_rows(backend):
    gen = torch.Generator().manual_seed(6)
    ties = torch.randint(-2, 3, (1, 5, 70), generator=gen).float()  # few distinct values
    zeros = torch.zeros(1, 5, 70)
    zeros[0, :, ::3] = -0.0  # -0.0 must tie with +0.0, so lower indices win
    zeros[0, 1, 5] = 1e-30
    short = torch.full((1, 5, 70), float("-inf"))
    short[0, 0, :3] = torch.tensor([0.5, 2.0, 0.5])
    short[0, 1, 60] = float("nan")
    short[0, 1, 61] = float("inf")  # non-finite: never selectable
    short[0, 1, 62] = 1.0
    scores = torch.cat([ties, zeros, short], dim=0)
    got = dsa.topk_indices(scores.to(DEVICE), 16, backend=backend).cpu()
    for b in range(3):
        for t in range(5):
            assert got[b, t].tolist() == _oracle_topk(scores[b, t].tolist(), 16), (b, t)
    assert got[1, 0].tolist() == list(range(16))
    assert got[1, 1, 0].item() == 5
    assert got[2, 0].tolist()[:4] == [1, 0, 2, -1]
    assert got[2, 1].tolist()[:2] == [62, -1]
    assert (got[2, 2:] == -1).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_topk_k_larger_than_row_pads(backend):
    scores = torch.tensor([[[3.0, 1.0, 2.0]]])
    got = dsa.topk_indices(scores.to(DEVICE), 5, backend=backend).cpu()
    assert got.tolist() == [[[0, 2, 1, -1, -1]]]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_topk_low_and_high_precision_scores(dtype):
    gen = torch.Generator().manual_seed(7)
    scores = torch.randn(1, 4, 90, generator=gen).to(dtype)  # bf16 rounding makes real ties
    got = dsa.topk_indices(scores, 30, backend="torch")
    for t in range(4):
        assert got[0, t].tolist() == _oracle_topk(scores[0, t].double().tolist(), 30)
    if dtype != torch.float64:
        assert torch.equal(dsa.topk_indices(scores.to(DEVICE), 30, backend="triton").cpu(), got)


@pytest.mark.parametrize("backend", BACKENDS)
def test_topk_bitwise_deterministic_and_batch_invariant(backend):
    gen = torch.Generator().manual_seed(8)
    scores = torch.randint(0, 4, (3, 9, 80), generator=gen).float().to(DEVICE)
    first = dsa.topk_indices(scores, 24, backend=backend)
    assert torch.equal(first, dsa.topk_indices(scores, 24, backend=backend))
    assert torch.equal(dsa.topk_indices(scores[2:3], 24, backend=backend)[0], first[2])
    assert torch.equal(dsa.topk_indices(scores[:, 4:5], 24, backend=backend)[:, 0], first[:, 4])
    perm = torch.tensor([1, 2, 0])
    assert torch.equal(dsa.topk_indices(scores[perm], 24, backend=backend), first[perm])


def test_topk_backends_agree_and_differ_from_plain_torch_topk_semantics():
    gen = torch.Generator().manual_seed(9)
    scores = torch.zeros(1, 3, 64)
    scores[0, 1] = torch.randint(0, 2, (64,), generator=gen).float()
    reference = dsa.topk_indices(scores, 8, backend="torch")
    assert torch.equal(dsa.topk_indices(scores.to(DEVICE), 8, backend="triton").cpu(), reference)
    assert reference[0, 0].tolist() == list(range(8))  # an all-zero row: the first 8 keys


def test_pack_keys_order_is_score_then_lower_index():
    scores = torch.tensor([[[-1.0, -0.0, 0.0, 2.0, -2.0, 2.0, float("-inf")]]])
    packed = topk_mod.pack_keys(scores)[0, 0].tolist()
    assert packed[1] > packed[2]  # equal zeros: the lower index ranks higher
    assert packed[3] > packed[5] > packed[1] > packed[0] > packed[4] > packed[6]


def test_topk_rejects_bad_arguments():
    with pytest.raises(ValueError, match="k must be"):
        dsa.topk_indices(torch.zeros(1, 1, 4), 0)
    with pytest.raises(ValueError, match="scores must be"):
        dsa.topk_indices(torch.zeros(1, 4), 2)
    with pytest.raises(ValueError, match="float64"):
        dsa.topk_indices(torch.zeros(1, 1, 4, dtype=torch.float64, device=DEVICE), 2, backend="triton")


@pytest.mark.gpu
def test_gpu_indexer_and_topk_match_reference_at_scale():
    q, k, w = _indexer_inputs(batch=2, tokens=1024, heads=8, dim=64, dtype=torch.bfloat16, seed=10)
    got = dsa.indexer_scores(q, k, w, backend="triton")
    want = _indexer_f64(q, k, w, 0)
    finite = torch.isfinite(want)
    torch.testing.assert_close(got.double()[finite], want[finite], rtol=1e-4, atol=1e-3)
    idx = dsa.topk_indices(got, 256, backend="triton")
    assert torch.equal(idx, dsa.topk_indices(got.cpu(), 256, backend="torch").to(idx.device))
    assert torch.equal(idx, dsa.topk_indices(got, 256, backend="triton"))
