"""Triton kernels behind `sparse_attention`: forward, dQ, and dK/dV by key.

Layouts (strides are passed, so any layout works; contiguous is fastest):
    q, out, grad_out, dq   [batch, tokens, heads, dim]
    k, v, dk, dv           [batch, keys, kv_heads, dim]
    indices                [batch, tokens, topk] int64, -1 = unused slot
    lse, delta             [batch, tokens, heads] float32 (float64 for float64 inputs)
    tokens_by_key          int32/int64 flat list: for each (batch, key), its querying tokens,
                           ascending; seg_start[b * keys + s] .. seg_start[b * keys + s + 1]
Programs: forward and dQ run one per (token, batch, kv head) and hold the G = heads / kv_heads
query heads of that kv head as rows; dK/dV runs one per (key, batch, kv head).

The kernels are plain functions; `backend.jit` decorates them (compiled or interpreted). They
call no other Triton function, which keeps both variants independent of each other.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import triton
import triton.language as tl


@dataclass(frozen=True)
class Plan:
    """Block sizes and arithmetic for one dtype and head group."""

    acc_torch: torch.dtype
    block_m: int
    meta: dict[str, Any] = field(default_factory=dict)


def plan(dtype: torch.dtype, group: int, dim: int) -> Plan:
    f64 = dtype == torch.float64
    block_g = triton.next_power_of_2(group)
    block_d = max(16, triton.next_power_of_2(dim))
    # tl.dot needs every side >= 16 on a GPU; small head groups use broadcast-and-sum instead.
    use_dot = not f64 and block_g >= 16
    block_n = 64 if use_dot else 32
    return Plan(
        acc_torch=torch.float64 if f64 else torch.float32,
        block_m=max(1, 64 // block_g),
        meta=dict(
            BLOCK_N=block_n, BLOCK_G=block_g, BLOCK_D=block_d, USE_DOT=use_dot,
            ACC_DTYPE=tl.float64 if f64 else tl.float32,
        ),
    )


def forward_kernel(
    q_ptr, k_ptr, v_ptr, idx_ptr, out_ptr, lse_ptr,
    N, G, D, scale,
    sqb, sqt, sqh, sqd,
    skb, sks, skh, skd,
    svb, svs, svh, svd,
    sib, sit, sin,
    sob, sot, soh, sod,
    slb, slt, slh,
    BLOCK_N: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr,
    USE_DOT: tl.constexpr, ACC_DTYPE: tl.constexpr,
):
    t = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    kh = tl.program_id(2)
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    heads = kh * G + offs_g
    mask_g = offs_g < G
    mask_d = offs_d < D
    mask_gd = mask_g[:, None] & mask_d[None, :]
    q = tl.load(
        q_ptr + b * sqb + t * sqt + heads[:, None] * sqh + offs_d[None, :] * sqd,
        mask=mask_gd, other=0.0,
    ).to(ACC_DTYPE)

    m = tl.full([BLOCK_G], float("-inf"), ACC_DTYPE)
    total = tl.zeros([BLOCK_G], ACC_DTYPE)
    acc = tl.zeros([BLOCK_G, BLOCK_D], ACC_DTYPE)
    for start in range(0, N, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        idx = tl.load(idx_ptr + b * sib + t * sit + offs_n * sin, mask=offs_n < N, other=-1)
        valid = idx >= 0
        safe = tl.where(valid, idx, 0)
        mask_nd = valid[:, None] & mask_d[None, :]
        kt = tl.load(
            k_ptr + b * skb + safe[:, None] * sks + kh * skh + offs_d[None, :] * skd,
            mask=mask_nd, other=0.0,
        ).to(ACC_DTYPE)
        vt = tl.load(
            v_ptr + b * svb + safe[:, None] * svs + kh * svh + offs_d[None, :] * svd,
            mask=mask_nd, other=0.0,
        ).to(ACC_DTYPE)
        if USE_DOT:
            logits = tl.dot(q, tl.trans(kt), input_precision="ieee")
        else:
            logits = tl.sum(q[:, None, :] * kt[None, :, :], axis=2)
        logits = tl.where(valid[None, :], logits * scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(logits, axis=1))
        # An all-unused block keeps m at -inf; shift by 0 then so exp() sees -inf, never nan.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m - m_safe)
        p = tl.exp(logits - m_safe[:, None])
        total = total * alpha + tl.sum(p, axis=1)
        if USE_DOT:
            pv = tl.dot(p, vt, input_precision="ieee")
        else:
            pv = tl.sum(p[:, :, None] * vt[None, :, :], axis=1)
        acc = acc * alpha[:, None] + pv
        m = m_new

    has_any = total > 0.0
    out = tl.where(has_any[:, None], acc / tl.where(has_any, total, 1.0)[:, None], 0.0)
    lse = tl.where(has_any, m + tl.log(tl.where(has_any, total, 1.0)), float("-inf"))
    tl.store(out_ptr + b * sob + t * sot + heads[:, None] * soh + offs_d[None, :] * sod,
             out.to(out_ptr.dtype.element_ty), mask=mask_gd)
    tl.store(lse_ptr + b * slb + t * slt + heads * slh, lse, mask=mask_g)


def dq_kernel(
    q_ptr, k_ptr, v_ptr, idx_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr,
    N, G, D, scale,
    sqb, sqt, sqh, sqd,
    skb, sks, skh, skd,
    svb, svs, svh, svd,
    sib, sit, sin,
    sdob, sdot, sdoh, sdod,
    slb, slt, slh,
    sdb, sdt, sdh,
    sdqb, sdqt, sdqh, sdqd,
    BLOCK_N: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr,
    USE_DOT: tl.constexpr, ACC_DTYPE: tl.constexpr,
):
    t = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    kh = tl.program_id(2)
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    heads = kh * G + offs_g
    mask_g = offs_g < G
    mask_d = offs_d < D
    mask_gd = mask_g[:, None] & mask_d[None, :]
    q = tl.load(
        q_ptr + b * sqb + t * sqt + heads[:, None] * sqh + offs_d[None, :] * sqd,
        mask=mask_gd, other=0.0,
    ).to(ACC_DTYPE)
    do = tl.load(
        do_ptr + b * sdob + t * sdot + heads[:, None] * sdoh + offs_d[None, :] * sdod,
        mask=mask_gd, other=0.0,
    ).to(ACC_DTYPE)
    lse = tl.load(lse_ptr + b * slb + t * slt + heads * slh, mask=mask_g, other=0.0).to(ACC_DTYPE)
    delta = tl.load(delta_ptr + b * sdb + t * sdt + heads * sdh, mask=mask_g, other=0.0).to(ACC_DTYPE)

    dq = tl.zeros([BLOCK_G, BLOCK_D], ACC_DTYPE)
    for start in range(0, N, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        idx = tl.load(idx_ptr + b * sib + t * sit + offs_n * sin, mask=offs_n < N, other=-1)
        valid = idx >= 0
        safe = tl.where(valid, idx, 0)
        mask_nd = valid[:, None] & mask_d[None, :]
        kt = tl.load(
            k_ptr + b * skb + safe[:, None] * sks + kh * skh + offs_d[None, :] * skd,
            mask=mask_nd, other=0.0,
        ).to(ACC_DTYPE)
        vt = tl.load(
            v_ptr + b * svb + safe[:, None] * svs + kh * svh + offs_d[None, :] * svd,
            mask=mask_nd, other=0.0,
        ).to(ACC_DTYPE)
        if USE_DOT:
            logits = tl.dot(q, tl.trans(kt), input_precision="ieee")
            dp = tl.dot(do, tl.trans(vt), input_precision="ieee")
        else:
            logits = tl.sum(q[:, None, :] * kt[None, :, :], axis=2)
            dp = tl.sum(do[:, None, :] * vt[None, :, :], axis=2)
        p = tl.where(valid[None, :], tl.exp(logits * scale - lse[:, None]), 0.0)
        ds = p * (dp - delta[:, None])
        if USE_DOT:
            dq += tl.dot(ds, kt, input_precision="ieee")
        else:
            dq += tl.sum(ds[:, :, None] * kt[None, :, :], axis=1)
    dq = dq * scale
    tl.store(dq_ptr + b * sdqb + t * sdqt + heads[:, None] * sdqh + offs_d[None, :] * sdqd,
             dq.to(dq_ptr.dtype.element_ty), mask=mask_gd)


def dkv_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, tok_ptr, seg_ptr, dk_ptr, dv_ptr,
    S, G, D, scale,
    sqb, sqt, sqh, sqd,
    skb, sks, skh, skd,
    svb, svs, svh, svd,
    sdob, sdot, sdoh, sdod,
    slb, slt, slh,
    sdb, sdt, sdh,
    sdkb, sdks, sdkh, sdkd,
    sdvb, sdvs, sdvh, sdvd,
    BLOCK_M: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, ACC_DTYPE: tl.constexpr,
):
    s = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    kh = tl.program_id(2)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < D
    seg = b * S + s
    first = tl.load(seg_ptr + seg)
    last = tl.load(seg_ptr + seg + 1)
    k_row = tl.load(k_ptr + b * skb + s * sks + kh * skh + offs_d * skd, mask=mask_d, other=0.0).to(ACC_DTYPE)
    v_row = tl.load(v_ptr + b * svb + s * svs + kh * svh + offs_d * svd, mask=mask_d, other=0.0).to(ACC_DTYPE)

    # Rows r = (contributor, head in group); contributors are taken BLOCK_M at a time, in the
    # ascending token order of this key's own list.
    r = tl.arange(0, BLOCK_M * BLOCK_G)
    g = r % BLOCK_G
    heads = kh * G + g
    dk = tl.zeros([BLOCK_D], ACC_DTYPE)
    dv = tl.zeros([BLOCK_D], ACC_DTYPE)
    for c in range(first, last, BLOCK_M):
        pos = c + r // BLOCK_G
        ok = (pos < last) & (g < G)
        t = tl.load(tok_ptr + pos, mask=ok, other=0).to(tl.int64)
        mask_rd = ok[:, None] & mask_d[None, :]
        q = tl.load(q_ptr + b * sqb + t[:, None] * sqt + heads[:, None] * sqh + offs_d[None, :] * sqd,
                    mask=mask_rd, other=0.0).to(ACC_DTYPE)
        do = tl.load(do_ptr + b * sdob + t[:, None] * sdot + heads[:, None] * sdoh + offs_d[None, :] * sdod,
                     mask=mask_rd, other=0.0).to(ACC_DTYPE)
        lse = tl.load(lse_ptr + b * slb + t * slt + heads * slh, mask=ok, other=0.0).to(ACC_DTYPE)
        delta = tl.load(delta_ptr + b * sdb + t * sdt + heads * sdh, mask=ok, other=0.0).to(ACC_DTYPE)
        logits = tl.sum(q * k_row[None, :], axis=1) * scale
        p = tl.where(ok, tl.exp(logits - lse), 0.0)
        dp = tl.sum(do * v_row[None, :], axis=1)
        ds = p * (dp - delta)
        dv += tl.sum(p[:, None] * do, axis=0)
        dk += tl.sum(ds[:, None] * q, axis=0)
    dk = dk * scale
    tl.store(dk_ptr + b * sdkb + s * sdks + kh * sdkh + offs_d * sdkd, dk.to(dk_ptr.dtype.element_ty), mask=mask_d)
    tl.store(dv_ptr + b * sdvb + s * sdvs + kh * sdvh + offs_d * sdvd, dv.to(dv_ptr.dtype.element_ty), mask=mask_d)
