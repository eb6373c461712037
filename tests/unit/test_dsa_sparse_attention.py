"""DSA sparse attention: forward and backward against float64, gradcheck, exact determinism.

Sizes stay tiny because the Triton kernels run under Triton's interpreter on the CPU, which must
be switched on before triton is imported, hence the environment line first.
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("KILN_TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from kiln.kernels import dsa  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BACKENDS = ["torch", "triton"]


def _inputs(batch=2, tokens=12, heads=4, kv_heads=2, dim=8, topk=5, dtype=torch.float32, seed=0):
    """Random q/k/v and causal top-k indices (random scores, so rows pick scattered keys)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, tokens, heads, dim, generator=gen).to(dtype)
    k = torch.randn(batch, tokens, kv_heads, dim, generator=gen).to(dtype)
    v = torch.randn(batch, tokens, kv_heads, dim, generator=gen).to(dtype)
    scores = torch.rand(batch, tokens, tokens, generator=gen)
    scores = scores.masked_fill(torch.ones(tokens, tokens, dtype=torch.bool).triu(1), float("-inf"))
    indices = dsa.topk_indices(scores, topk, backend="torch")
    return [x.to(DEVICE) for x in (q, k, v, indices)]


def _dense_f64(q, k, v, indices, scale=None):
    """The definition, in float64: softmax over the selected keys of a dense score matrix."""
    batch, tokens, heads, dim = q.shape
    keys, kv_heads = k.shape[1], k.shape[2]
    scale = dim**-0.5 if scale is None else scale
    rep = heads // kv_heads
    kd = k.double().repeat_interleave(rep, dim=2)
    vd = v.double().repeat_interleave(rep, dim=2)
    logits = torch.einsum("bthd,bshd->bhts", q.double(), kd) * scale
    allowed = torch.zeros(batch, tokens, keys + 1, dtype=torch.bool, device=q.device)
    allowed.scatter_(2, torch.where(indices >= 0, indices, keys), True)
    allowed = allowed[..., :keys][:, None]
    logits = logits.masked_fill(~allowed, float("-inf"))
    p = torch.softmax(logits, dim=-1).nan_to_num(0.0)
    return torch.einsum("bhts,bshd->bthd", p, vd)


def _grads(q, k, v, indices, backend, grad_out):
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    out = dsa.sparse_attention(q, k, v, indices, backend=backend)
    return (out, *torch.autograd.grad(out, (q, k, v), grad_out))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "dtype,tol", [(torch.float64, 1e-10), (torch.float32, 2e-5), (torch.bfloat16, 2e-2)]
)
def test_forward_and_backward_match_float64(backend, dtype, tol):
    q, k, v, indices = _inputs(dtype=dtype, seed=1)
    gen = torch.Generator().manual_seed(11)
    grad_out = torch.randn(q.shape, generator=gen).to(dtype).to(DEVICE)
    out, dq, dk, dv = _grads(q, k, v, indices, backend, grad_out)
    qd, kd, vd = (x.detach().double().requires_grad_() for x in (q, k, v))
    want = _dense_f64(qd, kd, vd, indices)
    wq, wk, wv = torch.autograd.grad(want, (qd, kd, vd), grad_out.double())
    assert out.dtype == dtype and dq.dtype == dtype and dk.dtype == dtype
    for got, ref in ((out, want), (dq, wq), (dk, wk), (dv, wv)):
        torch.testing.assert_close(got.double(), ref.detach(), rtol=tol, atol=tol)


@pytest.mark.parametrize("backend", BACKENDS)
def test_scale_argument_and_single_kv_head(backend):
    q, k, v, indices = _inputs(heads=3, kv_heads=1, seed=2)
    got = dsa.sparse_attention(q, k, v, indices, scale=0.3, backend=backend)
    torch.testing.assert_close(got.double(), _dense_f64(q, k, v, indices, scale=0.3), rtol=2e-5, atol=2e-5)


def test_gradcheck_float64_torch_path():
    q, k, v, indices = _inputs(batch=1, tokens=5, heads=2, kv_heads=1, dim=3, topk=3, dtype=torch.float64, seed=3)
    args = [x.requires_grad_() for x in (q, k, v)]
    assert torch.autograd.gradcheck(lambda a, b, c: dsa.sparse_attention(a, b, c, indices, backend="torch"), args)


@pytest.mark.slow
def test_gradcheck_float64_triton_path():
    q, k, v, indices = _inputs(batch=1, tokens=4, heads=2, kv_heads=1, dim=3, topk=2, dtype=torch.float64, seed=4)
    args = [x.requires_grad_() for x in (q, k, v)]
    assert torch.autograd.gradcheck(lambda a, b, c: dsa.sparse_attention(a, b, c, indices, backend="triton"), args)


def test_triton_gradients_equal_torch_gradients_in_float64():
    # Backed by the torch path's gradcheck above: a fast stand-in for gradcheck on the kernels.
    q, k, v, indices = _inputs(batch=1, tokens=9, dtype=torch.float64, seed=5)
    grad_out = torch.randn_like(q)
    for got, ref in zip(_grads(q, k, v, indices, "triton", grad_out), _grads(q, k, v, indices, "torch", grad_out)):
        torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("backend", BACKENDS)
def test_bitwise_deterministic_batch_invariant_and_permutation_invariant(backend):
    q, k, v, indices = _inputs(batch=3, tokens=10, seed=6)
    grad_out = torch.randn(q.shape, generator=torch.Generator().manual_seed(12)).to(DEVICE)
    first = _grads(q, k, v, indices, backend, grad_out)
    again = _grads(q, k, v, indices, backend, grad_out)
    for a, b in zip(first, again):
        assert torch.equal(a, b)
    alone = _grads(q[1:2], k[1:2], v[1:2], indices[1:2], backend, grad_out[1:2])
    for a, b in zip(alone, first):
        assert torch.equal(a[0], b[1])
    perm = torch.tensor([2, 0, 1], device=q.device)
    permuted = _grads(q[perm], k[perm], v[perm], indices[perm], backend, grad_out[perm])
    for a, b in zip(permuted, first):
        assert torch.equal(a, b[perm])


@pytest.mark.parametrize("backend", BACKENDS)
def test_unused_slots_empty_rows_and_duplicates(backend):
    q, k, v, indices = _inputs(batch=1, tokens=6, topk=4, seed=7)
    indices = indices.clone()
    indices[0, 3] = -1  # a row with nothing selected: zeros out, no gradient
    indices[0, 5] = torch.tensor([2, -1, 2, 0])  # a key listed twice counts twice
    grad_out = torch.ones_like(q)
    out, dq, dk, dv = _grads(q, k, v, indices, backend, grad_out)
    assert torch.equal(out[0, 3], torch.zeros_like(out[0, 3]))
    assert torch.equal(dq[0, 3], torch.zeros_like(dq[0, 3]))
    torch.testing.assert_close(out.double(), _dense_f64_with_duplicates(q, k, v, indices), rtol=2e-5, atol=2e-5)
    ref = _grads(q.double(), k.double(), v.double(), indices, "torch", grad_out.double())
    for got, want in zip((out, dq, dk, dv), ref):
        torch.testing.assert_close(got.double(), want, rtol=2e-5, atol=2e-5)


def _dense_f64_with_duplicates(q, k, v, indices):
    """Loop form of the definition, one slot at a time (duplicates weigh twice)."""
    batch, tokens, heads, dim = q.shape
    group = heads // k.shape[2]
    out = torch.zeros(q.shape, dtype=torch.float64)
    for b in range(batch):
        for t in range(tokens):
            slots = [s for s in indices[b, t].tolist() if s >= 0]
            for h in range(heads):
                if not slots:
                    continue
                kh = h // group
                logits = torch.stack([q[b, t, h].double() @ k[b, s, kh].double() for s in slots]) * dim**-0.5
                p = torch.softmax(logits, dim=0)
                out[b, t, h] = sum(p[i] * v[b, s, kh].double() for i, s in enumerate(slots))
    return out.to(q.device)


def test_rejects_bad_indices_and_shapes():
    q, k, v, indices = _inputs()
    with pytest.raises(ValueError, match="indices must lie"):
        dsa.sparse_attention(q, k, v, torch.full_like(indices, 99))
    with pytest.raises(ValueError, match="indices must be int64"):
        dsa.sparse_attention(q, k, v, indices.int())
    with pytest.raises(ValueError, match="multiple of kv_heads"):
        dsa.sparse_attention(q[:, :, :3], k, v, indices)


@pytest.mark.gpu
def test_gpu_compiled_kernels_match_reference_and_repeat_exactly():
    q, k, v, indices = _inputs(batch=2, tokens=512, heads=16, kv_heads=1, dim=64, topk=128, dtype=torch.bfloat16, seed=8)
    grad_out = torch.randn_like(q)
    got = _grads(q, k, v, indices, "triton", grad_out)
    ref = _grads(q.float(), k.float(), v.float(), indices, "torch", grad_out.float())
    for a, b in zip(got, ref):
        torch.testing.assert_close(a.float(), b, rtol=3e-2, atol=3e-2)
    for a, b in zip(got, _grads(q, k, v, indices, "triton", grad_out)):
        assert torch.equal(a, b)
