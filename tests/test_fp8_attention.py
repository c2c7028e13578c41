"""minivllm.attention.fp8_attention: FA3-style fp8 attention (Q and P in e4m3) on the CPU."""
from __future__ import annotations

import math

import pytest
import torch

from minivllm.attention.fp8_attention import fp8_attention_ref, to_e4m3
from minivllm.numerics import round_to_fp8_e4m3

LN2 = math.log(2)  # softmax_scale * log2(e) == 1.0 exactly (checked below)


def _sdpa64(q, k, v, causal=True):
    """float64 softmax(q k^T / sqrt(D)) v, GQA, causal over the last n positions."""
    n, H, D = q.shape
    L, Hkv, _ = k.shape
    k = k.double().repeat_interleave(H // Hkv, 1)
    v = v.double().repeat_interleave(H // Hkv, 1)
    s = torch.einsum("nhd,lhd->hnl", q.double(), k) * D ** -0.5
    if causal:
        s = s.masked_fill(torch.arange(L)[None, :] > torch.arange(L - n, L)[:, None], -math.inf)
    return torch.einsum("hnl,lhd->nhd", s.softmax(-1), v)


def _cache(L, Hkv, D, seed, spread=1.0):
    g = torch.Generator().manual_seed(seed)
    k = (torch.randn(L, Hkv, D, generator=g) * spread).to(torch.float8_e4m3fn)
    v = torch.randn(L, Hkv, D, generator=g).to(torch.float8_e4m3fn)
    return k, v


def test_to_e4m3_matches_the_integer_rounding_oracle():
    g = torch.Generator().manual_seed(0)
    x = torch.cat([torch.randn(20000, generator=g) * 10.0 ** torch.randint(-4, 4, (20000,), generator=g),
                   torch.tensor([448.0, 464.0, 480.0, 1e6, -1e6, 2.0 ** -10, 3 * 2.0 ** -11,
                                 2.0 ** -10 * 1.0001, math.inf, -math.inf, 0.0])])
    assert torch.equal(to_e4m3(x), round_to_fp8_e4m3(x, saturate=True))


def test_without_fp8_casts_it_is_the_dequantize_path():
    """quantize_q=False, quantize_p=False: softmax(q (k8 ks)^T) (v8 vs), per-head scales,
    GQA, several tiles, causal and not."""
    q = torch.randn(7, 6, 32, generator=torch.Generator().manual_seed(1))
    k8, v8 = _cache(300, 2, 32, seed=2)
    ks, vs = torch.tensor([0.5, 2.0]), torch.tensor([0.25, 3.0])
    for causal in (True, False):
        got = fp8_attention_ref(q, k8, v8, ks, vs, quantize_q=False, quantize_p=False,
                                block_n=64, causal=causal)
        want = _sdpa64(q, k8.float() * ks[None, :, None], v8.float() * vs[None, :, None], causal)
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)


def test_fp8_casts_are_identities_on_representable_inputs():
    """Q on the e4m3 grid (q_scale 1) and scores whose exp2 are powers of two inside e4m3's
    range: rounding Q and P changes nothing, bit for bit."""
    assert LN2 * math.log2(math.e) == 1.0
    g = torch.Generator().manual_seed(3)
    q = torch.randint(-1, 2, (4, 2, 8), generator=g).float()
    k8 = torch.randint(-1, 2, (40, 1, 8), generator=g).float().to(torch.float8_e4m3fn)
    v8 = torch.randn(40, 1, 8, generator=g).to(torch.float8_e4m3fn)
    # integer scores in [-8, 8]: P = 2^(s - max + 8) >= 2^-8, on e4m3's grid
    plain = fp8_attention_ref(q, k8, v8, softmax_scale=LN2, quantize_q=False,
                              quantize_p=False, block_n=16)
    fp8 = fp8_attention_ref(q, k8, v8, softmax_scale=LN2, block_n=16)
    assert torch.equal(plain, fp8)
    q_off = fp8_attention_ref(q + 0.01, k8, v8, softmax_scale=LN2, block_n=16)
    assert not torch.equal(q_off, fp8_attention_ref(q + 0.01, k8, v8, softmax_scale=LN2,
                                                    quantize_q=False, block_n=16))


def _one_row(exponents, max_offset):
    """One query over keys whose softmax weights relative to the largest are 2^-e (e in
    ``exponents``, the first 0), V one-hot: out[j] is the weight key j kept."""
    L = len(exponents)
    D = max(L, 2)
    q = torch.zeros(1, 1, D)
    q[0, 0, :2] = 1.0
    e = torch.tensor(exponents, dtype=torch.float32)
    k = torch.zeros(L, 1, D)
    k[:, 0, 0] = -e.clamp(max=16)      # s_j = -e_j, split over two e4m3 values (17 is not
    k[:, 0, 1] = -(e - e.clamp(max=16))  # on the grid, 16 + 1 is)
    v = torch.eye(L, D)[:, None, :]
    out, st = fp8_attention_ref(q, k.to(torch.float8_e4m3fn), v.to(torch.float8_e4m3fn),
                                softmax_scale=LN2, causal=False, max_offset=max_offset,
                                return_stats=True)
    return out[0, 0], st


@pytest.mark.parametrize("max_offset", [8, 0])
def test_small_weights_flush_below_half_the_smallest_subnormal(max_offset):
    """P = 2^(max_offset - e): e4m3's smallest subnormal is 2^-9, and 2^-10 (half of it, a
    tie) rounds to even, i.e. 0. So weights 2^-(10 + max_offset) and below vanish."""
    exps = [0, 1, 5, 9, 10, 12, 16, 17, 18, 19, 24]
    assert float(to_e4m3(torch.tensor(2.0 ** -9))) == 2.0 ** -9
    assert float(to_e4m3(torch.tensor(2.0 ** -10))) == 0.0
    out, st = _one_row(exps, max_offset)
    kept = [e for e, o in zip(exps, out.tolist()) if o > 0]
    assert kept == [e for e in exps if e <= 9 + max_offset]
    true_w = torch.tensor([2.0 ** -e for e in exps], dtype=torch.float64)
    true_w /= true_w.sum()
    lost = sum(float(w) for e, w in zip(exps, true_w) if e > 9 + max_offset)
    assert float(st["flushed_mass"][0, 0]) == pytest.approx(lost, rel=1e-5)
    assert int(st["flushed_count"][0, 0]) == sum(e > 9 + max_offset for e in exps)
    # the kept weights are exact powers of two: out[j] = 2^-e_j / sum(float32 P)
    z = sum(2.0 ** -e for e in exps)
    for e, o in zip(exps, out.tolist()):
        if e <= 9 + max_offset:
            assert o == pytest.approx(2.0 ** -e / z, rel=1e-6)


def test_error_grows_with_each_fp8_cast_on_random_inputs():
    """On random inputs the dequantize path (no cast) matches float64 to float32 rounding;
    each cast adds an error orders of magnitude larger."""
    g = torch.Generator().manual_seed(5)
    q = torch.randn(16, 4, 64, generator=g) * 2
    k8, v8 = _cache(200, 2, 64, seed=6, spread=2.0)
    want = _sdpa64(q, k8.float(), v8.float())

    def err(**kw):
        return float((fp8_attention_ref(q, k8, v8, **kw).double() - want).abs().max())

    e_none = err(quantize_q=False, quantize_p=False)
    e_q, e_p, e_qp = err(quantize_p=False), err(quantize_q=False), err()
    assert e_none < 1e-5
    assert min(e_q, e_p, e_qp) > 100 * e_none
    # P in [0, 1] (no offset) flushes at least as many weights as FA3's P in [0, 256]
    _, s8 = fp8_attention_ref(q, k8, v8, return_stats=True)
    _, s0 = fp8_attention_ref(q, k8, v8, max_offset=0, return_stats=True)
    assert float(s0["flushed_count"].sum()) >= float(s8["flushed_count"].sum())
    assert float(s0["flushed_count"].sum()) > 0


def test_two_level_accumulation_beats_a_narrow_running_accumulator():
    g = torch.Generator().manual_seed(7)
    q = torch.randn(8, 2, 32, generator=g) * 0.3
    k8, v8 = _cache(2048, 2, 32, seed=8)
    want = _sdpa64(q, k8.float(), v8.float())
    kw = dict(quantize_q=False, quantize_p=False, block_n=32, acc_mantissa_bits=7)
    one = float((fp8_attention_ref(q, k8, v8, two_level=False, **kw).double() - want).abs().mean())
    two = float((fp8_attention_ref(q, k8, v8, two_level=True, **kw).double() - want).abs().mean())
    assert two < one / 2
    # float32 accumulation: two_level changes nothing
    a = fp8_attention_ref(q, k8, v8, two_level=False, quantize_q=False, block_n=32)
    b = fp8_attention_ref(q, k8, v8, two_level=True, quantize_q=False, block_n=32)
    assert torch.equal(a, b)


def test_q_scale_and_descales_fold_into_the_exponent():
    """Q8 = e4m3(q / q_scale) and the descale multiplies the scores: the query 4 q with
    q_scale 4 is stored as the same Q8 as q with q_scale 1, and its scores are 4x, i.e.
    the attention of q with a 4x softmax scale, bit for bit (4 is a power of two)."""
    g = torch.Generator().manual_seed(9)
    q = torch.randn(5, 2, 16, generator=g)
    k8, v8 = _cache(50, 1, 16, seed=10)
    a = fp8_attention_ref(q, k8, v8, softmax_scale=4 * 16 ** -0.5)
    b = fp8_attention_ref(q * 4.0, k8, v8, q_scale=4.0)
    assert torch.equal(a, b)
    c = fp8_attention_ref(q * 4.0, k8, v8, q_scale=1.0)  # Q8 rounded on another grid point
    assert not torch.equal(b, c)


def test_bad_inputs_raise():
    q = torch.randn(2, 2, 8)
    k8, v8 = _cache(4, 1, 8, seed=0)
    with pytest.raises(ValueError):
        fp8_attention_ref(q, k8.float(), v8)
    with pytest.raises(ValueError):
        fp8_attention_ref(q, k8, v8, k_scale=torch.tensor([1.0, 2.0]))
    with pytest.raises(ValueError):
        fp8_attention_ref(q, k8, v8, q_scale=0.0)
    with pytest.raises(ValueError):
        fp8_attention_ref(q, k8, v8, max_offset=9)
    with pytest.raises(ValueError):
        fp8_attention_ref(q, k8, v8, acc_mantissa_bits=0)
    with pytest.raises(ValueError):
        fp8_attention_ref(torch.randn(5, 2, 8), k8, v8)  # n > L
    with pytest.raises(ValueError):
        fp8_attention_ref(torch.randn(2, 3, 8), k8[:, :1].repeat(1, 2, 1), v8[:, :1].repeat(1, 2, 1))
