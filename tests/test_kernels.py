"""The Triton kernels in :mod:`minivllm_kernels` against their PyTorch references (``*_ref``).

Every output buffer and cache is POISONED before a kernel runs (NaN for 16/32-bit
dtypes; for 1-byte dtypes a byte the kernel never writes: 0xFF, a NaN, for fp8 and
0x80 = -128, outside the symmetric int8 grid, for int8), so a row the kernel forgot to
write, or wrote where it must not, is caught. Inputs are ragged (sequence lengths around
block sizes and around multiples of the decode split size, 512), block tables are
scattered (random permutations of block ids) and padded with the id of a poisoned "trap"
block, and the axes below are each covered several times by hand-written case lists
rather than a full cross product (the interpreter is slow):

* block sizes 16 and 32, head dims 64 and 128 (and 96, a padded tile), GQA ratios 1, 3
  and 8 (and 2);
* compute dtypes float32, float16, bfloat16; cache dtypes float32, float16, bfloat16,
  fp8 e4m3, fp8 e5m2, int8;
* scales static per tensor ([] tensor), static per KV head ([num_kv_heads]) and dynamic
  (``k_scale_cache``/``v_scale_cache`` [num_slots, num_kv_heads] float32).

The store kernel must match its reference byte for byte; the attention kernels within
the tolerances below (the reference dequantizes the same stored bytes, so quantized
caches get the compute dtype's tolerance); batch invariance is checked bitwise.

Runs in Triton's interpreter on CPU (minivllm_kernels._triton sets TRITON_INTERPRET=1 without
CUDA) and unchanged on a CUDA GPU.
"""

from __future__ import annotations

import pytest
import torch

from minivllm_kernels import paged_attention as PA
from minivllm_kernels._triton import INTERPRET, tl, triton
from minivllm_kernels.activation import silu_and_mul, silu_and_mul_ref
from minivllm_kernels.batch_invariant import (linear_batch_invariant, matmul_batch_invariant, matmul_ref,
                                     rms_norm_batch_invariant, rms_norm_batch_invariant_ref)
from minivllm_kernels.paged_attention import (SPLIT_SIZE, paged_attention_decode,
                                     paged_attention_decode_ref)
from minivllm_kernels.prefill_attention import paged_prefill_attention, paged_prefill_attention_ref
from minivllm_kernels.reshape_and_cache import reshape_and_cache, reshape_and_cache_ref
from minivllm_kernels.rms_norm import fused_add_rms_norm, fused_add_rms_norm_ref, rms_norm, rms_norm_ref

DEVICE = "cpu" if INTERPRET else "cuda"

# float16 overflow to inf is tested on purpose; NumPy (the interpreter) warns about it
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
E4M3, E5M2, I8 = torch.float8_e4m3fn, torch.float8_e5m2, torch.int8
QUANTIZED = (E4M3, E5M2, I8)
QMAX = {E4M3: 448.0, E5M2: 57344.0, I8: 127.0}  # from the formats' definitions

# Attention outputs (magnitude ~1) vs the reference: max |out - ref| / max(1, |ref|).
ATTN_TOL = {F32: 2e-5, F16: 2e-3, BF16: 1.6e-2}
# RMSNorm, float32: relative error (16-bit dtypes: 1 ulp of the dtype, see assert_ulp).
RMS_F32_RTOL = 2e-6

_MANTISSA = {F32: 23, F16: 10, BF16: 7}
_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32}

assert SPLIT_SIZE == 512, "the ragged lengths below are chosen around 512-token splits"


# ----------------------------------------------------------------------------- helpers

def poison_(t: torch.Tensor) -> torch.Tensor:
    """Fill with a value no kernel writes: NaN, or 0xFF (fp8 NaN) / 0x80 (int8 -128)."""
    if t.element_size() == 1:
        t.view(torch.uint8).fill_(0x80 if t.dtype == I8 else 0xFF)
    else:
        t.fill_(float("nan"))
    return t


def is_poison(t: torch.Tensor) -> torch.Tensor:
    if t.element_size() == 1:
        return t.view(torch.uint8) == (0x80 if t.dtype == I8 else 0xFF)
    return torch.isnan(t)


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits, as integers (so NaN == NaN and -0 != +0 in comparisons)."""
    return t.contiguous().view(_INT_VIEW[t.element_size()])


def assert_bitwise(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    assert a.shape == b.shape and a.dtype == b.dtype, \
        f"{what}: {tuple(a.shape)}/{a.dtype} vs {tuple(b.shape)}/{b.dtype}"
    diff = bits(a) != bits(b)
    if diff.any():
        err = (a.float() - b.float()).abs().nan_to_num(float("inf")).max().item()
        raise AssertionError(f"{what}: {int(diff.sum())} of {diff.numel()} elements differ "
                             f"in their bits (max abs difference {err:.3g})")


def randn(*shape, dtype=F32, scale=1.0) -> torch.Tensor:
    """Seeded CPU draw moved to DEVICE: the same numbers on CPU and CUDA."""
    return (torch.randn(*shape) * scale).to(device=DEVICE, dtype=dtype)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def assert_attn_close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, what: str):
    tol = ATTN_TOL[dtype]
    assert torch.isfinite(ref.float()).all(), f"{what}: the reference is not finite"
    err = (out.float() - ref.float()).abs() / ref.float().abs().clamp(min=1.0)
    n_bad = int((~torch.isfinite(out.float())).sum())
    worst = err.nan_to_num(float("inf")).max().item()
    where = tuple(int(i) for i in torch.nonzero(err.nan_to_num(float("inf")) == worst)[0])
    assert n_bad == 0 and worst <= tol, (f"{what}: max error {worst:.3g} (tol {tol}) at "
                                         f"{where}; {n_bad} non-finite outputs")


def ulp(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Spacing of ``dtype``'s grid at |x| (float32 tensor)."""
    tiny = torch.finfo(dtype).tiny
    e = torch.floor(torch.log2(x.float().abs().clamp(min=tiny)))
    return torch.exp2(e - _MANTISSA[dtype])


def assert_ulp(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, what: str,
               n_ulp: float = 1.0, extra: torch.Tensor | float = 0.0) -> None:
    """|out - ref| <= n_ulp ulps of dtype at max(|out|, |ref|) (+ extra)."""
    o, r = out.float(), ref.float()
    assert torch.isfinite(r).all(), f"{what}: the reference is not finite"
    bound = n_ulp * ulp(torch.maximum(o.abs(), r.abs()), dtype) + extra
    ratio = ((o - r).abs() / bound).nan_to_num(float("inf"))
    worst = ratio.max().item()
    assert worst <= 1.0, (f"{what}: max error {(o - r).abs().max().item():.3g}, "
                          f"{worst:.3g} x the bound ({n_ulp} ulp of {dtype})")


# ------------------------------------------------------------- paged-cache construction

def make_block_tables(seq_lens, block_size, bt_dtype=torch.int32, pad_cols=2, spare=3):
    """Scattered block tables: distinct physical blocks from a random permutation of all
    block ids; each row padded (pad_cols extra columns, and shorter rows up to the
    longest) with the id of a trap block that no sequence owns (it stays poisoned).
    Returns (block_tables on DEVICE, num_blocks)."""
    need = [cdiv(n, block_size) for n in seq_lens]
    num_blocks = sum(need) + spare + 1
    perm = torch.randperm(num_blocks).tolist()
    trap = perm.pop()
    bt = torch.full((len(seq_lens), max(need + [0]) + pad_cols), trap, dtype=bt_dtype)
    for b, n in enumerate(need):
        bt[b, :n] = torch.tensor(perm[:n], dtype=bt_dtype)
        perm = perm[n:]
    return bt.to(DEVICE), num_blocks


def slots_of(bt_row: torch.Tensor, block_size: int, n: int) -> torch.Tensor:
    pos = torch.arange(n, device=bt_row.device)
    return bt_row.long()[pos // block_size] * block_size + pos % block_size


def make_scales(mode, cache_dtype, kv_heads, num_slots, k, v):
    """Scale arguments for a cache (none for float caches). Static scales leave the
    largest values saturated (0.9 x amax / qmax)."""
    if cache_dtype not in QUANTIZED:
        assert mode is None
        return {}
    q = QMAX[cache_dtype]
    if mode == "tensor":
        return dict(k_scale=(0.9 * k.float().abs().max() / q).to(DEVICE),
                    v_scale=(0.9 * v.float().abs().max() / q).to(DEVICE))
    if mode == "head":
        return dict(k_scale=(0.9 * k.float().abs().amax(dim=(0, 2)) / q).to(DEVICE),
                    v_scale=(0.9 * v.float().abs().amax(dim=(0, 2)) / q).to(DEVICE))
    assert mode == "dynamic"
    return dict(k_scale_cache=poison_(torch.empty(num_slots, kv_heads, device=DEVICE)),
                v_scale_cache=poison_(torch.empty(num_slots, kv_heads, device=DEVICE)))


def fill_paged_cache(seq_lens, kv_heads, head_dim, block_size, cache_dtype, kv_dtype, mode,
                     bt_dtype=torch.int32):
    """A poisoned paged cache holding random K/V for positions [0, seq_len) of each
    sequence, written by the *reference* store. Heads have different ranges. Returns the
    keyword arguments of the attention kernels (caches, block tables, scales)."""
    bt, num_blocks = make_block_tables(seq_lens, block_size, bt_dtype)
    num_slots = num_blocks * block_size
    kc = poison_(torch.empty(num_slots, kv_heads, head_dim, dtype=cache_dtype, device=DEVICE))
    vc = poison_(torch.empty_like(kc))
    total = sum(seq_lens)
    head_range = torch.linspace(0.5, 2.0, kv_heads)[:, None]
    k = (torch.randn(total, kv_heads, head_dim) * head_range).to(DEVICE, kv_dtype)
    v = (torch.randn(total, kv_heads, head_dim) * head_range.flip(0)).to(DEVICE, kv_dtype)
    scales = make_scales(mode, cache_dtype, kv_heads, num_slots, k, v)
    if total:
        slots = torch.cat([slots_of(bt[b], block_size, n) for b, n in enumerate(seq_lens)])
        reshape_and_cache_ref(k, v, kc, vc, slots, **scales)
    return dict(key_cache=kc, value_cache=vc, block_tables=bt, **scales)


# --------------------------------------------------------------------- reshape_and_cache

# (input dtype, cache dtype, scale mode, kv heads, head dim, tokens, block size)
STORE_CASES = [
    (F32, F32, None, 2, 64, 37, 16),
    (F16, F16, None, 1, 128, 16, 32),
    (BF16, BF16, None, 3, 64, 33, 16),
    (F32, F16, None, 2, 64, 20, 32),       # rounding to f16, overflow to inf
    (F32, BF16, None, 1, 128, 31, 16),     # rounding to bf16
    (BF16, F32, None, 2, 64, 17, 32),
    (F32, E4M3, "tensor", 2, 64, 37, 16),
    (F16, E4M3, "head", 3, 128, 15, 32),
    (BF16, E4M3, "dynamic", 2, 64, 40, 16),
    (F32, E4M3, "dynamic", 1, 128, 9, 32),
    (F32, E5M2, "head", 2, 64, 33, 16),
    (BF16, E5M2, "tensor", 1, 64, 16, 32),
    (F16, E5M2, "dynamic", 3, 64, 23, 16),
    (F32, I8, "head", 2, 128, 37, 32),
    (F16, I8, "tensor", 2, 64, 18, 16),
    (BF16, I8, "dynamic", 1, 64, 50, 16),
    (F32, I8, "dynamic", 3, 128, 7, 32),
    (F16, E4M3, "dynamic", 2, 96, 21, 16),  # head_dim not a power of 2 (padded tiles)
]


def _store_id(c):
    return f"{str(c[0])[6:]}->{str(c[1])[6:]}-{c[2]}-H{c[3]}-D{c[4]}-T{c[5]}-bs{c[6]}"


@pytest.mark.parametrize("in_dtype,cache_dtype,mode,H,D,T,bs", STORE_CASES,
                         ids=[_store_id(c) for c in STORE_CASES])
def test_reshape_and_cache_matches_ref(in_dtype, cache_dtype, mode, H, D, T, bs):
    torch.manual_seed(100 + STORE_CASES.index((in_dtype, cache_dtype, mode, H, D, T, bs)))
    # token positions of two sequences in scattered blocks; a few tokens are padding
    bt, num_blocks = make_block_tables([T // 2 + 1, T - T // 2 - 1 + 5], bs)
    slots = torch.cat([slots_of(bt[0], bs, T // 2 + 1), slots_of(bt[1], bs, T - T // 2 + 4)])
    slots = slots[torch.randperm(slots.numel(), device=DEVICE)][:T].clone()
    skipped = slots[[1, T // 2, T - 1]].clone()
    slots[[1, T // 2, T - 1]] = torch.tensor([-1, -7, -1], device=DEVICE)
    slot_mapping = slots.to(torch.int32 if T % 2 else torch.int64)
    num_slots = num_blocks * bs

    # K/V as slices of a fused qkv row (strided, last dim contiguous), heads of
    # different ranges, some saturating values, an all-zero (token, head) row. Tokens 0
    # and 2 are never padding (T >= 7).
    qkv = randn(T, 3 * H + 1, D, dtype=F32)
    qkv[:, H:2 * H] *= torch.linspace(0.25, 4.0, H, device=DEVICE)[None, :, None]
    key, value = qkv[:, H:2 * H], qkv[:, 2 * H:3 * H]
    value[0, 0] = 0.0
    key[0, H - 1] = 0.0
    if cache_dtype == F16:
        key[2, 0, :3] = torch.tensor([7e4, -1e5, 65519.0])  # inf, -inf, rounds to 65504
    if mode in ("tensor", "head"):
        q = QMAX[cache_dtype]
        sk = torch.linspace(0.01, 0.05, H) if mode == "head" else torch.tensor(0.02)
        sv = torch.linspace(0.03, 0.02, H) if mode == "head" else torch.tensor(0.03)
        # x / scale up to ~2.5 x qmax: saturates to +-qmax
        key[2, :, :5] = (torch.tensor([1.3, -1.7, 2.5, -1.01, 1.5]) * q
                         * sk.reshape(-1, 1)).to(DEVICE)
        value[0, :, :2] = (torch.tensor([-2.0, 1.2]) * q * sv.reshape(-1, 1)).to(DEVICE)
        scales = dict(k_scale=sk.to(DEVICE), v_scale=sv.to(DEVICE))
    elif mode == "dynamic":
        scales = dict(k_scale_cache=poison_(torch.empty(num_slots, H, device=DEVICE)),
                      v_scale_cache=poison_(torch.empty(num_slots, H, device=DEVICE)))
        key[2, 0, 7] = 1e3  # one outlier sets its row's scale
    else:
        scales = {}
    key, value = key.to(in_dtype), value.to(in_dtype)

    kc = poison_(torch.empty(num_slots, H, D, dtype=cache_dtype, device=DEVICE))
    vc = poison_(torch.empty_like(kc))
    kc_ref, vc_ref = kc.clone(), vc.clone()
    scales_ref = {n: t.clone() if n.endswith("cache") else t for n, t in scales.items()}
    reshape_and_cache(key, value, kc, vc, slot_mapping, **scales)
    reshape_and_cache_ref(key, value, kc_ref, vc_ref, slot_mapping, **scales_ref)

    for name, got, want in (("key_cache", kc, kc_ref), ("value_cache", vc, vc_ref)):
        diff = bits(got) != bits(want)
        if diff.any():
            i = tuple(torch.nonzero(diff)[0].tolist())
            raise AssertionError(
                f"{name}: {int(diff.sum())} stored values in {int(diff.any(-1).sum())} (slot, "
                f"head) rows differ from the reference, e.g. at {i}: kernel "
                f"{got[i].float().item()!r} (bits {bits(got)[i].item():#x}) vs ref "
                f"{want[i].float().item()!r} (bits {bits(want)[i].item():#x})")
        written = torch.zeros(num_slots, dtype=torch.bool, device=DEVICE)
        written[slot_mapping[slot_mapping >= 0].long()] = True
        assert is_poison(got[~written]).all(), f"{name}: a row no token maps to was written"
        assert not is_poison(got[written]).any(), f"{name}: a mapped row was not written"
        assert is_poison(got[skipped]).all(), f"{name}: a negative slot was written"
    for name in ("k_scale_cache", "v_scale_cache"):
        if name in scales:
            assert_bitwise(scales[name], scales_ref[name], name)
            assert torch.isnan(scales[name][skipped]).all()
    # independent of the reference
    r0, r2 = int(slot_mapping[0]), int(slot_mapping[2])
    if mode == "dynamic":
        # an all-zero row gets scale 1.0; a row's largest element is stored as qmax
        assert scales["v_scale_cache"][r0, 0].item() == 1.0
        assert (vc[r0, 0].float() == 0).all()
        assert kc[r2, 0, 7].float().item() == QMAX[cache_dtype]
        assert scales["k_scale_cache"][r2, 0].item() == pytest.approx(1e3 / QMAX[cache_dtype])
    elif mode is not None:
        # x / scale beyond +-qmax saturates
        q = QMAX[cache_dtype]
        assert kc[r2, :, :5].float().cpu().tolist() == [[q, -q, q, -q, q]] * H
        assert vc[r0, :, :2].float().cpu().tolist() == [[-q, q]] * H


def _store_one(x_vals: torch.Tensor, cache_dtype, scale) -> torch.Tensor:
    """Store x_vals [T, H, D] (float32) with a static scale, through the kernel and the
    reference; assert identical bytes; return the kernel's cache (slot t = row t)."""
    T, H, D = x_vals.shape
    x = x_vals.to(DEVICE)
    caches = [poison_(torch.empty(T + 2, H, D, dtype=cache_dtype, device=DEVICE))
              for _ in range(4)]
    slots = torch.arange(T, device=DEVICE)
    s = torch.as_tensor(scale, dtype=F32).to(DEVICE)
    kw = dict(k_scale=s, v_scale=s) if cache_dtype in QUANTIZED else {}
    reshape_and_cache(x, x, caches[0], caches[1], slots, **kw)
    reshape_and_cache_ref(x, x, caches[2], caches[3], slots, **kw)
    diff = bits(caches[0]) != bits(caches[2])
    if diff.any():
        i = tuple(torch.nonzero(diff)[0].tolist())
        raise AssertionError(f"{cache_dtype}: {int(diff.sum())} stored values differ from the "
                             f"reference, e.g. x={x_vals[i].item()!r} -> kernel "
                             f"{caches[0][i].float().item()} vs ref {caches[2][i].float().item()}")
    assert is_poison(caches[0][T:]).all()
    return caches[0][:T]


def _grid_edges(cache_dtype) -> torch.Tensor:
    """Values on, between (ties) and just beside the ties of a storage grid, and beyond
    its range (float32, before the scale)."""
    if cache_dtype == I8:
        grid = torch.arange(-128.0, 129.0)
    elif cache_dtype in (E4M3, E5M2):
        allb = torch.arange(256, dtype=torch.uint8).view(cache_dtype).float()
        grid = allb[torch.isfinite(allb)]
    else:  # 16-bit float: random grid points across binades and their upper neighbours
        g = (torch.rand(300) + 0.5) * torch.exp2(torch.randint(-20, 15, (300,)).float())
        g = torch.cat([g, torch.tensor([1.0, 2.0, 256.0])]).to(cache_dtype)
        up = (g.view(torch.int16) + 1).view(cache_dtype)  # next grid point (g > 0)
        grid = torch.cat([g, up]).float()
        grid = torch.cat([grid, -grid])
        grid = grid[torch.isfinite(grid)]
    grid = torch.unique(grid)
    mids = (grid[1:] + grid[:-1]) / 2  # exact in float32
    vals = torch.cat([grid, mids, torch.nextafter(mids, torch.tensor(float("inf"))),
                      torch.nextafter(mids, torch.tensor(float("-inf")))])
    if cache_dtype in QUANTIZED:
        q = QMAX[cache_dtype]
        vals = torch.cat([vals, torch.tensor([q * 1.01, -q * 1.01, q * 1.5, -q * 4, 1e9, -1e30])])
    else:
        fmax = torch.finfo(cache_dtype).max
        vals = torch.cat([vals, torch.tensor([fmax * 1.001, -fmax * 1.5, 3e38])])
    return vals + 0.0  # (-0.0 + 0.0 = +0.0: -0.0 has its own test below)


@pytest.mark.parametrize("cache_dtype", [E4M3, E5M2, I8, F16, BF16], ids=str)
@pytest.mark.parametrize("mode", ["tensor", "head"])
def test_store_rounding_ties_and_saturation(cache_dtype, mode):
    """Exact ties round half to even, values beyond the range saturate (fp8/int8) or
    overflow (float16), byte-identical to the reference, on every grid point of the
    quantized formats. Power-of-two scales keep x / scale exact."""
    torch.manual_seed(7)
    vals = _grid_edges(cache_dtype)
    D = 64
    T = cdiv(vals.numel(), D)
    y = torch.zeros(T * D)
    y[:vals.numel()] = vals
    y = y.view(T, 1, D)
    if mode == "tensor":
        scale = torch.tensor(0.5)
        x = y * 0.5
    else:  # per head: head 1 holds the same values on another scale
        scale = torch.tensor([0.25, 4.0])
        y = torch.cat([y, y.flip(0)], dim=1)
        x = y * scale[None, :, None]
    if cache_dtype not in QUANTIZED:
        x = y  # no scale for float caches
    stored = _store_one(x, cache_dtype, scale).float().cpu()
    # stated semantics, checked without the reference for the quantized formats
    if cache_dtype in QUANTIZED:
        q = QMAX[cache_dtype]
        assert stored.abs().max().item() == q
        assert (stored[y >= q] == q).all() and (stored[y <= -q] == -q).all()
    if cache_dtype == I8:
        # exact ties, half to even; -128 never stored
        assert torch.equal(stored[y == 2.5], torch.full_like(stored[y == 2.5], 2.0))
        assert torch.equal(stored[y == -3.5], torch.full_like(stored[y == -3.5], -4.0))
        assert torch.equal(stored[y == 0.5], torch.zeros_like(stored[y == 0.5]))
        assert torch.equal(stored[y == 1.5], torch.full_like(stored[y == 1.5], 2.0))
        assert torch.equal(stored[y == 126.5], torch.full_like(stored[y == 126.5], 126.0))
        assert stored.min().item() == -127.0


@pytest.mark.parametrize("cache_dtype,cases", [
    (E4M3, [(1.0625, 1.0), (1.1875, 1.25), (-1.1875, -1.25), (2.0 ** -10, 0.0),
            (3 * 2.0 ** -10, 2.0 ** -8), (464.0, 448.0), (-1e6, -448.0), (0.5 - 2 ** -25, 0.5),
            (-2.0 ** -10, -0.0), (-2.0 ** -12, -0.0)]),
    (E5M2, [(1.125, 1.0), (1.375, 1.5), (2.0 ** -17, 0.0), (3 * 2.0 ** -17, 2.0 ** -15),
            (61440.0, 57344.0), (-7e4, -57344.0), (-2.0 ** -17, -0.0), (-2.0 ** -20, -0.0)]),
    (I8, [(2.5, 2.0), (-3.5, -4.0), (0.5, 0.0), (-0.5, 0.0), (0.5 - 2 ** -25, 0.0),
          (1.5 + 2 ** -22, 2.0), (127.5, 127.0), (-200.0, -127.0)]),
    (BF16, [(1 + 2.0 ** -8, 1.0), (1 + 3 * 2.0 ** -8, 1 + 2.0 ** -6), (3.4e38, float("inf"))]),
    (F16, [(1 + 2.0 ** -11, 1.0), (1 + 3 * 2.0 ** -11, 1 + 2.0 ** -9), (65520.0, float("inf")),
           (65519.0, 65504.0)]),
], ids=["e4m3", "e5m2", "int8", "bf16", "f16"])
def test_store_known_values(cache_dtype, cases):
    """Hand-computed round-to-nearest-even / saturation results: (x / scale, stored
    value) pairs; the quantized formats store with scale 0.5 (x = 0.5 * value, exact)."""
    y = torch.tensor([c[0] for c in cases], dtype=F32)
    want = torch.tensor([c[1] for c in cases], dtype=F32)
    x = y * 0.5 if cache_dtype in QUANTIZED else y
    stored = _store_one(x.view(-1, 1, 1).expand(-1, 1, 16).contiguous(), cache_dtype, 0.5)
    got = stored[:, 0, 0].float().cpu()
    # compared as bits: -0.0 (a negative value that rounds to zero) keeps its sign in fp8
    assert torch.equal(got, want) and torch.equal(torch.signbit(got), torch.signbit(want)), \
        f"{cache_dtype}: {y.tolist()} -> {got.tolist()}, want {want.tolist()}"


@pytest.mark.parametrize("cache_dtype", [E4M3, E5M2], ids=str)
def test_store_fp8_keeps_the_sign_of_negative_zero(cache_dtype):
    """-0.0 is stored as -0 (0x80), as the reference stores it (torch's cast)."""
    x = torch.tensor([-0.0, 0.0]).view(-1, 1, 1).expand(-1, 1, 16).contiguous().to(DEVICE)
    c = [poison_(torch.empty(2, 1, 16, dtype=cache_dtype, device=DEVICE)) for _ in range(4)]
    slots = torch.arange(2, device=DEVICE)
    reshape_and_cache(x, x, c[0], c[1], slots, 0.5, 0.5)
    reshape_and_cache_ref(x, x, c[2], c[3], slots, 0.5, 0.5)
    assert c[2].view(torch.uint8)[:, 0, 0].tolist() == [0x80, 0]  # the reference
    assert_bitwise(c[0], c[2], "fp8 cache bytes")


# ------------------------------------------------------------------------ decode attention

# (q dtype, cache dtype, scale mode, block size, head dim, heads, kv heads, seq lens)
DECODE_CASES = [
    (F32, F32, None, 16, 64, 4, 4, [1, 15, 16, 17, 0, 530]),
    (F16, F16, None, 32, 128, 3, 1, [31, 32, 33, 511, 1]),
    (BF16, BF16, None, 16, 64, 8, 1, [512, 513, 17, 0]),
    (F32, BF16, None, 32, 64, 8, 1, [32, 33, 0, 600]),
    (F32, F16, None, 16, 64, 3, 1, [16, 1537]),
    (F16, F32, None, 32, 128, 2, 2, [33, 100]),
    (BF16, F16, None, 16, 128, 4, 4, [1, 200]),
    (F32, E4M3, "tensor", 16, 128, 2, 2, [1, 16, 600]),
    (F16, E4M3, "head", 32, 64, 6, 2, [33, 0, 64, 1025]),
    (BF16, E4M3, "dynamic", 16, 64, 8, 1, [17, 520, 3]),
    (F16, E4M3, "dynamic", 32, 128, 2, 2, [0, 0, 5]),
    (F32, E5M2, "head", 32, 64, 3, 3, [1, 31, 1024]),
    (BF16, E5M2, "dynamic", 16, 128, 3, 1, [15, 16, 700]),
    (F16, E5M2, "tensor", 16, 64, 8, 1, [1, 2, 513]),
    (F32, I8, "dynamic", 32, 128, 8, 1, [32, 1, 1100]),
    (F16, I8, "tensor", 16, 64, 2, 2, [0, 17, 1536]),
    (BF16, I8, "head", 32, 64, 6, 2, [65, 511, 512]),
    (F32, I8, "head", 16, 64, 3, 1, [1023, 1024, 1025]),
    (F16, I8, "dynamic", 16, 96, 4, 2, [1, 40, 513]),  # head_dim not a power of 2
]


def _attn_id(c):
    return (f"q{str(c[0])[6:]}-{str(c[1])[6:]}-{c[2]}-bs{c[3]}-D{c[4]}-H{c[5]}/{c[6]}-"
            f"{'_'.join(map(str, c[7]))}")


@pytest.mark.parametrize("dtype,cache_dtype,mode,bs,D,H,KV,seq_lens", DECODE_CASES,
                         ids=[_attn_id(c) for c in DECODE_CASES])
def test_paged_attention_decode_matches_ref(dtype, cache_dtype, mode, bs, D, H, KV, seq_lens):
    case = DECODE_CASES.index((dtype, cache_dtype, mode, bs, D, H, KV, seq_lens))
    torch.manual_seed(200 + case)
    bt_dtype = torch.int64 if case % 3 == 2 else torch.int32
    kv = fill_paged_cache(seq_lens, KV, D, bs, cache_dtype, dtype, mode, bt_dtype)
    B = len(seq_lens)
    q = randn(B, H + 2, D, dtype=dtype)[:, 1:H + 1]  # strided, like a slice of qkv
    sl = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    out_buf = poison_(torch.empty(B, H + 1, D, dtype=dtype, device=DEVICE))
    out = out_buf[:, :H]  # a strided output view; column H must stay poisoned
    res = paged_attention_decode(q, block_size=bs, seq_lens=sl, scale=D ** -0.5, out=out, **kv)
    assert res.data_ptr() == out.data_ptr() and res.shape == (B, H, D)
    assert is_poison(out_buf[:, H]).all(), "wrote outside the out view"
    ref = paged_attention_decode_ref(q, block_size=bs, seq_lens=sl, scale=D ** -0.5, **kv)
    assert_attn_close(out, ref, dtype, "decode vs ref")
    for b, n in enumerate(seq_lens):
        if n == 0:
            assert (out[b] == 0).all(), f"row {b} (seq_len 0) is not zero"
    # the defaults: out=None, max_seq_len inferred; same numbers
    assert_bitwise(paged_attention_decode(q, block_size=bs, seq_lens=sl, scale=D ** -0.5, **kv),
                   out, "out=None vs out=buffer")
    # every launch split gives the same bits: one split per program + the reduce kernel,
    # two or three splits per program, one program per whole sequence (no reduce)
    max_splits = -(-max(seq_lens) // SPLIT_SIZE)
    for spp in sorted({1, 2, 3, max_splits}):
        assert_bitwise(paged_attention_decode(q, block_size=bs, seq_lens=sl, scale=D ** -0.5,
                                              splits_per_program=spp, **kv),
                       out, f"splits_per_program={spp} vs default")


@pytest.mark.parametrize("dtype,cache_dtype,mode", [(F32, F32, None), (BF16, E4M3, "dynamic"),
                                                    (F16, I8, "head")], ids=str)
def test_decode_batch_invariant(dtype, cache_dtype, mode, monkeypatch):
    """A sequence's output is bit-identical alone, in a batch with longer sequences (more
    split programs), with a larger max_seq_len (CUDA graphs), and with padding rows."""
    torch.manual_seed(300)
    bs, D, H, KV = 16, 64, 3, 1
    lens = [30, 1600, 700, 1100]  # target: index 2 (2 splits); 1600 needs 4
    kv = fill_paged_cache(lens, KV, D, bs, cache_dtype, dtype, mode)
    bt = kv.pop("block_tables")
    q = randn(len(lens), H, D, dtype=dtype)
    sl = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    run = lambda q_, bt_, sl_, **kw: paged_attention_decode(  # noqa: E731
        q_, block_tables=bt_, seq_lens=sl_, block_size=bs, scale=D ** -0.5, **kv, **kw)
    batch = run(q, bt, sl)
    for t in range(len(lens)):
        alone = run(q[t:t + 1], bt[t:t + 1], sl[t:t + 1])
        assert_bitwise(alone[0], batch[t], f"seq {t} alone vs in the batch")
    alone = run(q[2:3], bt[2:3], sl[2:3], max_seq_len=4096)
    assert_bitwise(alone[0], batch[2], "max_seq_len=4096 vs the batch")
    # CUDA-graph style: padded with seq_len-0 rows, max_seq_len = a model maximum
    qp = torch.cat([q, randn(2, H, D, dtype=dtype)])
    btp = torch.cat([bt, bt[:2]])
    slp = torch.cat([sl, torch.zeros(2, dtype=torch.int32, device=DEVICE)])
    padded = run(qp, btp, slp, max_seq_len=2048)
    assert_bitwise(padded[:len(lens)], batch, "padded batch vs batch")
    assert (padded[len(lens):] == 0).all()
    # the launch split (GPU default: depends on the batch size) never changes the bits,
    # padding rows included
    for spp in (1, 2, 4):
        out = run(qp, btp, slp, max_seq_len=2048, splits_per_program=spp)
        assert_bitwise(out, padded, f"splits_per_program={spp} vs default")
    if not INTERPRET:  # the pipeline depth (chosen per launch) neither; the interpreter
        # has no pipeline
        for stages in (2, 3, 5):
            monkeypatch.setitem(PA.decode_config(cache_dtype), "num_stages", stages)
            for spp in (1, 4):  # one split per program; whole sequences
                out = run(qp, btp, slp, max_seq_len=2048, splits_per_program=spp)
                assert_bitwise(out, padded, f"num_stages={stages}, splits_per_program={spp}")
    ref = paged_attention_decode_ref(q, block_tables=bt, seq_lens=sl, block_size=bs,
                                     scale=D ** -0.5, **kv)
    assert_attn_close(batch, ref, dtype, "decode batch vs ref")


# The fp8 decode contract (the "folded" kernel, the default for fp8 caches): no bits to
# match, a tolerance. Error of a row = max |out - float64 truth| / max |V| of its keys, in
# units of the query dtype's unit roundoff u (tests/fp8_decode_cases.py). Measured by
# benchmarks/fp8_decode.py (3 seeds, CPU interpreter): folded at most 0.97 u for 16-bit
# queries, where the float cache holding the same dequantized values reaches 1.2-2.8 u
# (it rounds K*scale and V*scale to the query dtype; folded never does); float32 queries
# 15-30 u, where the exact kernel (the same 128-key tiles) gives 10-22 u and the float
# cache's 64-key tiles 3-13 u: in float32 the tile's summation order dominates, and exp
# turns a score's relative error into |score| times it. The bound, per query dtype:
# (at most this many u, and at most this factor times that kernel's error on the data).
FP8_CONTRACT = {BF16: (1.5, "float cache", 1.0), F16: (1.5, "float cache", 1.0),
                F32: (64.0, "exact", 4.0)}


@pytest.mark.parametrize("mode", ["head", "dynamic"])
@pytest.mark.parametrize("cache_dtype", [E4M3, E5M2], ids=str)
@pytest.mark.parametrize("dtype", [BF16, F16, F32], ids=str)
def test_fp8_folded_error_against_float64(dtype, cache_dtype, mode):
    from tests.fp8_decode_cases import (UNIT_ROUNDOFF, float_cache_case, normalized_error,
                                        random_case)
    seed = 17 + 5 * [BF16, F16, F32].index(dtype) + 2 * [E4M3, E5M2].index(cache_dtype) + \
        (mode == "dynamic")
    case = random_case(4, [1, 17, 530, 1300], 8, 2, 128, 16, cache_dtype, dtype, mode,
                       str(DEVICE), torch.Generator().manual_seed(seed))
    truth = PA.paged_attention_decode_f64(**case)
    u = UNIT_ROUNDOFF[dtype]
    err = {name: normalized_error(PA.paged_attention_decode(**case, fp8_kernel=name), truth,
                                  case) / u for name in PA.FP8_KERNELS}
    err["float cache"] = normalized_error(PA.paged_attention_decode(**float_cache_case(case)),
                                          truth, case) / u
    print(f"{dtype} {cache_dtype} {mode}: error / u = " +
          ", ".join(f"{k} {v:.3g}" for k, v in err.items()))
    bound, other, factor = FP8_CONTRACT[dtype]
    assert err["folded"] <= bound, f"folded error {err['folded']:.3g} u > {bound} u"
    assert err["folded"] <= factor * err[other], (
        f"folded error {err['folded']:.3g} u > {factor} x the {other}'s {err[other]:.3g} u")


@pytest.mark.parametrize("q_factor", [2.0 ** 60, 2.0 ** -60], ids=["2^60", "2^-60"])
def test_fp8_folded_bf16_queries_past_float16_range(q_factor):
    """bfloat16 queries far outside float16's range (|q| up to ~2^62, or ~2^-58: a plain
    cast to float16 gives inf, or 0) still meet the contract: the folded kernel's float16
    products scale q by a power of two first. Keys are scaled the other way so that the
    scores, and so the attention weights, stay those of ordinary data."""
    from tests.fp8_decode_cases import UNIT_ROUNDOFF, normalized_error, random_case
    case = random_case(3, [1, 130, 700], 8, 2, 128, 16, E4M3, BF16, "head", str(DEVICE),
                       torch.Generator().manual_seed(91))
    case["q"] = (case["q"].float() * q_factor).to(BF16)
    case["k_scale"] = case["k_scale"] / q_factor
    truth = PA.paged_attention_decode_f64(**case)
    out = PA.paged_attention_decode(**case)
    assert torch.isfinite(out).all()
    err = normalized_error(out, truth, case) / UNIT_ROUNDOFF[BF16]
    print(f"q x {q_factor:g}: folded error {err:.3g} u")
    assert err <= FP8_CONTRACT[BF16][0], f"folded error {err:.3g} u"


@triton.jit
def _fp8_to_f16_kernel(x_ptr, out_ptr, E4M3: tl.constexpr, KEEP_NAN: tl.constexpr):
    i = tl.arange(0, 256)
    tl.store(out_ptr + i, PA._fp8_to_f16(tl.load(x_ptr + i), E4M3, KEEP_NAN))


@pytest.mark.parametrize("keep_nan", [True, False])
@pytest.mark.parametrize("cache_dtype", [E4M3, E5M2], ids=str)
def test_fp8_to_f16_every_byte(cache_dtype, keep_nan):
    """The folded kernel's integer fp8 -> float16 conversion on all 256 bytes: e5m2 gives
    the value, e4m3 the value times 2**-8 (both exact: compared bit for bit with torch's
    conversion), NaN stays NaN (e4m3 without KEEP_NAN: its NaN may read as a number).
    On a GPU this runs the inline PTX; in the interpreter the same bit operations."""
    x = torch.arange(256, dtype=torch.uint8).view(cache_dtype)
    want = x.float() * (2.0 ** -8 if cache_dtype == E4M3 else 1.0)
    want = want.to(F16)
    out = torch.empty(256, dtype=F16, device=DEVICE)
    _fp8_to_f16_kernel[(1,)](x.to(DEVICE), out, E4M3=cache_dtype == E4M3, KEEP_NAN=keep_nan)
    out = out.cpu()
    nan = torch.isnan(want)
    assert nan.sum() == (2 if cache_dtype == E4M3 else 6)  # the formats' NaN encodings
    assert torch.equal(bits(out[~nan]), bits(want[~nan])), [
        (i, float(want[i]), float(out[i])) for i in range(256)
        if not nan[i] and bits(out[i:i + 1]) != bits(want[i:i + 1])][:8]
    if keep_nan or cache_dtype == E5M2:
        assert torch.isnan(out[nan]).all()


def test_fp8_kernel_choice():
    """An unknown fp8_kernel is refused before anything runs; a float cache ignores it."""
    kv = fill_paged_cache([5], 1, 64, 16, E4M3, F32, "tensor")
    q = randn(1, 2, 64)
    sl = torch.tensor([5], dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="fp8_kernel must be one of"):
        paged_attention_decode(q, block_size=16, seq_lens=sl, scale=0.125, fp8_kernel="fast",
                               **kv)
    a = paged_attention_decode(q, block_size=16, seq_lens=sl, scale=0.125, **kv)
    b = paged_attention_decode(q, block_size=16, seq_lens=sl, scale=0.125, fp8_kernel="exact",
                               **kv)
    assert_attn_close(a, b, F32, "folded vs exact")
    fc = fill_paged_cache([5], 1, 64, 16, F32, F32, None)
    assert_bitwise(paged_attention_decode(q, block_size=16, seq_lens=sl, scale=0.125, **fc),
                   paged_attention_decode(q, block_size=16, seq_lens=sl, scale=0.125,
                                          fp8_kernel="exact", **fc), "float cache, either")


# ----------------------------------------------------------------------- prefill attention

# (q dtype, cache dtype, scale mode, block size, head dim, heads, kv heads, [(ctx, qlen)])
PREFILL_CASES = [
    (F32, F32, None, 16, 64, 4, 4, [(0, 1), (0, 17), (5, 1), (40, 23), (16, 17)]),
    (F16, F16, None, 32, 128, 3, 1, [(0, 33), (31, 1), (0, 32), (33, 31)]),
    (BF16, BF16, None, 16, 64, 8, 1, [(0, 15), (15, 1), (500, 30)]),
    (F32, BF16, None, 32, 64, 8, 1, [(0, 5), (33, 33)]),
    (F32, F16, None, 16, 64, 3, 1, [(0, 48), (48, 1)]),
    (F16, F32, None, 32, 128, 2, 2, [(7, 25), (0, 1)]),
    (F32, E4M3, "tensor", 16, 128, 2, 2, [(0, 16), (1, 16), (47, 2)]),
    (F16, E4M3, "head", 32, 64, 6, 2, [(0, 40), (32, 1), (10, 31)]),
    (BF16, E4M3, "dynamic", 16, 64, 8, 1, [(0, 1), (17, 17), (60, 20)]),
    (F32, E5M2, "head", 32, 64, 3, 3, [(0, 50), (64, 1), (5, 33)]),
    (BF16, E5M2, "dynamic", 16, 128, 3, 1, [(0, 31), (16, 16)]),
    (F16, E5M2, "tensor", 16, 64, 8, 1, [(0, 9), (100, 12)]),
    (F32, I8, "dynamic", 32, 128, 8, 1, [(0, 33), (200, 17)]),
    (F16, I8, "tensor", 16, 64, 2, 2, [(0, 64), (511, 2), (3, 1)]),
    (BF16, I8, "head", 32, 64, 6, 2, [(0, 20), (31, 34)]),
    (F32, E5M2, "dynamic", 16, 96, 4, 2, [(0, 18), (20, 3)]),  # head_dim not a power of 2
]


def _prefill_id(c):
    return (f"q{str(c[0])[6:]}-{str(c[1])[6:]}-{c[2]}-bs{c[3]}-D{c[4]}-H{c[5]}/{c[6]}-"
            + "_".join(f"{a}+{n}" for a, n in c[7]))


def layout_queries(qlens, gaps=True):
    """Rows of q for each sequence: shuffled order, gaps of unused rows between them
    (and before the first / after the last) when gaps. Returns (starts, total rows)."""
    order = torch.randperm(len(qlens)).tolist() if gaps else list(range(len(qlens)))
    starts = [0] * len(qlens)
    row = 1 if gaps else 0
    for i, b in enumerate(order):
        starts[b] = row
        row += qlens[b] + (i % 3 if gaps else 0)
    return starts, row + (2 if gaps else 0)


@pytest.mark.parametrize("dtype,cache_dtype,mode,bs,D,H,KV,seqs", PREFILL_CASES,
                         ids=[_prefill_id(c) for c in PREFILL_CASES])
def test_paged_prefill_matches_ref(dtype, cache_dtype, mode, bs, D, H, KV, seqs):
    case = PREFILL_CASES.index((dtype, cache_dtype, mode, bs, D, H, KV, seqs))
    torch.manual_seed(400 + case)
    qlens = [n for _, n in seqs]
    seq_lens = [c + n for c, n in seqs]
    kv = fill_paged_cache(seq_lens, KV, D, bs, cache_dtype, dtype, mode,
                          torch.int64 if case % 3 == 1 else torch.int32)
    starts, T = layout_queries(qlens)
    owned = torch.zeros(T, dtype=torch.bool)
    for s, n in zip(starts, qlens):
        owned[s:s + n] = True
    owned = owned.to(DEVICE)
    q = randn(T, H, D, dtype=dtype)
    q[~owned] = float("nan")  # rows of no sequence: never read
    i32 = lambda xs: torch.tensor(xs, dtype=torch.int32, device=DEVICE)  # noqa: E731
    args = dict(query_starts=i32(starts), query_lens=i32(qlens), seq_lens=i32(seq_lens),
                block_size=bs, scale=D ** -0.5, **kv)
    out = poison_(torch.empty(T, H, D, dtype=dtype, device=DEVICE))
    res = paged_prefill_attention(q, out=out, **args)
    assert res.data_ptr() == out.data_ptr()
    ref = paged_prefill_attention_ref(q, out=poison_(torch.empty_like(out)), **args)
    assert is_poison(out[~owned]).all(), "a row of q that belongs to no sequence was written"
    assert_attn_close(out[owned], ref[owned], dtype, "prefill vs ref")
    # the defaults (out=None, max_query_len inferred) and a larger max_query_len agree
    again = paged_prefill_attention(q, max_query_len=max(qlens) + 40, **args)
    assert_bitwise(again[owned], out[owned], "max_query_len larger")


@pytest.mark.parametrize("dtype,cache_dtype,mode", [(F32, F32, None), (BF16, E5M2, "tensor"),
                                                    (F16, I8, "dynamic")], ids=str)
def test_prefill_batch_invariant(dtype, cache_dtype, mode):
    """Each sequence's rows are bit-identical alone and in a batch (other sequences with
    more query tiles, another row offset), and with a larger max_query_len."""
    torch.manual_seed(500)
    bs, D, H, KV = 16, 64, 3, 1
    seqs = [(0, 20), (40, 37), (3, 70), (530, 5)]
    qlens = [n for _, n in seqs]
    seq_lens = [c + n for c, n in seqs]
    kv = fill_paged_cache(seq_lens, KV, D, bs, cache_dtype, dtype, mode)
    bt = kv.pop("block_tables")
    starts, T = layout_queries(qlens, gaps=False)
    q = randn(T, H, D, dtype=dtype)
    i32 = lambda xs: torch.tensor(xs, dtype=torch.int32, device=DEVICE)  # noqa: E731
    batch = paged_prefill_attention(q, block_tables=bt, query_starts=i32(starts),
                                    query_lens=i32(qlens), seq_lens=i32(seq_lens),
                                    block_size=bs, scale=D ** -0.5, **kv)
    for b, (s, n) in enumerate(zip(starts, qlens)):
        for mql in (None, 128):
            alone = paged_prefill_attention(
                q[s:s + n], block_tables=bt[b:b + 1], query_starts=i32([0]),
                query_lens=i32([n]), seq_lens=i32([seq_lens[b]]), block_size=bs,
                scale=D ** -0.5, max_query_len=mql, **kv)
            assert_bitwise(alone, batch[s:s + n], f"seq {b} alone (max_query_len={mql})")
    ref = paged_prefill_attention_ref(q, block_tables=bt, query_starts=i32(starts),
                                      query_lens=i32(qlens), seq_lens=i32(seq_lens),
                                      block_size=bs, scale=D ** -0.5, **kv)
    assert_attn_close(batch, ref, dtype, "prefill batch vs ref")


def test_prefill_last_token_matches_decode():
    """The last query row of a prefill and a decode step over the same cache compute
    the same attention (different kernels, so within tolerance)."""
    torch.manual_seed(550)
    bs, D, H, KV = 16, 64, 6, 2
    seqs = [(0, 1), (30, 3), (600, 1)]
    seq_lens = [c + n for c, n in seqs]
    kv = fill_paged_cache(seq_lens, KV, D, bs, E4M3, F32, "head")
    qlens = [n for _, n in seqs]
    starts, T = layout_queries(qlens, gaps=False)
    q = randn(T, H, D)
    i32 = lambda xs: torch.tensor(xs, dtype=torch.int32, device=DEVICE)  # noqa: E731
    pre = paged_prefill_attention(q, query_starts=i32(starts), query_lens=i32(qlens),
                                  seq_lens=i32(seq_lens), block_size=bs, scale=D ** -0.5, **kv)
    last = [s + n - 1 for s, n in zip(starts, qlens)]
    dec = paged_attention_decode(q[last], seq_lens=i32(seq_lens), block_size=bs,
                                 scale=D ** -0.5, **kv)
    assert_attn_close(dec, pre[last], F32, "decode vs prefill last row")


@pytest.mark.parametrize("kernel", ["decode", "prefill"])
@pytest.mark.parametrize("cache_dtype", [I8, F32], ids=str)
def test_bf16_query_dequantizes_with_round_to_nearest(kernel, cache_dtype):
    """One key: softmax weight exactly 1, so the output is exactly the dequantized V,
    converted to bfloat16 as the reference converts it."""
    D, bs = 64, 16
    v_val = 1 + 2.0 ** -8 + 2.0 ** -10  # float32; nearest bf16 is 1 + 2^-7 (truncated: 1.0)
    if cache_dtype == I8:
        kc = torch.ones(bs, 1, D, dtype=I8, device=DEVICE)
        vc = torch.ones_like(kc)
        scales = dict(k_scale=torch.tensor(1.0, device=DEVICE),
                      v_scale=torch.tensor(v_val, device=DEVICE))
    else:
        kc = torch.ones(bs, 1, D, device=DEVICE)
        vc = torch.full((bs, 1, D), v_val, device=DEVICE)
        scales = {}
    q = torch.ones(1, 1, D, dtype=BF16, device=DEVICE)
    bt = torch.zeros(1, 1, dtype=torch.int32, device=DEVICE)
    one = torch.ones(1, dtype=torch.int32, device=DEVICE)
    common = dict(key_cache=kc, value_cache=vc, block_tables=bt, seq_lens=one, block_size=bs,
                  scale=D ** -0.5, **scales)
    zero = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    if kernel == "decode":
        out = paged_attention_decode(q, **common)
        ref = paged_attention_decode_ref(q, **common)
    else:
        out = paged_prefill_attention(q, query_starts=zero, query_lens=one, **common)
        ref = paged_prefill_attention_ref(q, query_starts=zero, query_lens=one, **common)
    assert (ref.float() == 1 + 2.0 ** -7).all()  # the reference rounds to nearest
    assert_bitwise(out, ref, f"{kernel} output (= V) vs ref")


# ------------------------------------------------------------------- batch-invariant matmul

def _matmul_bound(a, b, bias, ref, dtype):
    """|kernel - ref|: both sum in float32 (in different orders), then round to dtype:
    2 K eps32 sum|a||b| for the sums, plus 1 ulp of dtype for the final rounding."""
    K = a.shape[1]
    mag = a.float().abs() @ b.float().abs() + (bias.float().abs() if bias is not None else 0)
    f32 = 2 * K * 2.0 ** -24 * mag
    return f32 if dtype == F32 else f32 + ulp(ref.float().abs() + f32, dtype)


@pytest.mark.parametrize("dtype", [F32, BF16, F16], ids=str)
@pytest.mark.parametrize("with_bias", [False, True])
def test_matmul_batch_invariant(dtype, with_bias):
    torch.manual_seed(600)
    M, K, N = 64, 100, 80  # K and N not multiples of the tiles: masked tails
    a = randn(M, K, dtype=dtype)
    b = randn(K, N, dtype=dtype, scale=0.2)
    bias = randn(N, dtype=dtype) if with_bias else None
    full = matmul_batch_invariant(a, b, bias)
    assert full.shape == (M, N) and full.dtype == dtype
    for m in (1, 7, 33, 64):
        assert_bitwise(matmul_batch_invariant(a[:m].clone(), b, bias), full[:m], f"M={m}")
        # the other rows of the batch differ: row i still the same
        other = randn(m + 9, K, dtype=dtype)
        other[:m] = a[:m]
        assert_bitwise(matmul_batch_invariant(other, b, bias)[:m], full[:m], f"M={m} (+9 rows)")
    for i in (5, 40, 63):
        assert_bitwise(matmul_batch_invariant(a[i:i + 1], b, bias)[0], full[i], f"row {i} alone")
    ref = matmul_ref(a, b, bias)
    err = (full.float() - ref.float()).abs()
    bound = _matmul_bound(a, b, bias, ref, dtype)
    assert (err <= bound).all(), f"max error {err.max().item():.3g} vs bound " \
                                 f"{bound[err > bound].min().item():.3g}"


@pytest.mark.parametrize("dtype", [F32, BF16], ids=str)
def test_linear_batch_invariant(dtype):
    torch.manual_seed(610)
    x = randn(3, 11, 48, dtype=dtype)
    w = randn(70, 48, dtype=dtype, scale=0.2)  # weight.t() is a strided b
    bias = randn(70, dtype=dtype)
    y = linear_batch_invariant(x, w, bias)
    assert y.shape == (3, 11, 70)
    assert_bitwise(linear_batch_invariant(x[1:2, 4:9], w, bias), y[1:2, 4:9], "sub-batch")
    ref = matmul_ref(x.reshape(-1, 48), w.t(), bias)
    bound = _matmul_bound(x.reshape(-1, 48), w.t(), bias, ref, dtype)
    assert ((y.reshape(-1, 70).float() - ref.float()).abs() <= bound).all()


# ------------------------------------------------------------------------------- RMSNorm

# (dtype, rows, hidden, strided input)
RMS_CASES = [(F32, 7, 64, False), (F32, 19, 100, True), (F16, 9, 256, False),
             (F16, 4, 100, True), (BF16, 33, 64, False), (BF16, 5, 200, True)]


def _rms_inputs(dtype, rows, hidden, strided):
    big = randn(rows, hidden + 3, scale=2.0)
    big[:, :hidden] *= torch.logspace(-2, 2, rows, device=DEVICE)[:, None]  # wide ranges
    big[0] = 0.0  # an all-zero row: eps only
    x = big[:, 1:hidden + 1] if strided else big[:, :hidden].contiguous()
    return x.to(dtype), (1.0 + randn(hidden, scale=0.3)).to(dtype)


def _assert_rms_close(out, ref, dtype, what):
    if dtype == F32:
        assert torch.isfinite(ref).all()
        err = ((out - ref).abs() / ref.abs().clamp(min=1e-30)).nan_to_num(float("inf"))
        err = torch.where((ref == 0) & (out != 0), torch.full_like(err, float("inf")),
                          torch.where(ref == 0, torch.zeros_like(err), err))
        assert err.max().item() <= RMS_F32_RTOL, f"{what}: max rel error {err.max().item():.3g}"
    else:
        assert_ulp(out, ref, dtype, what)


@pytest.mark.parametrize("dtype,rows,hidden,strided", RMS_CASES, ids=str)
def test_rms_norm_matches_ref(dtype, rows, hidden, strided):
    torch.manual_seed(700 + hidden + rows)
    x, w = _rms_inputs(dtype, rows, hidden, strided)
    eps = 1e-6 if dtype == F32 else 1e-5
    out = rms_norm(x, w, eps)
    assert out.shape == x.shape and out.dtype == dtype
    _assert_rms_close(out, rms_norm_ref(x, w, eps), dtype, "rms_norm")
    assert (out[0] == 0).all()
    # leading dims are kept
    out3 = rms_norm(x.reshape(1, rows, hidden), w, eps)
    assert out3.shape == (1, rows, hidden)
    assert_bitwise(out3[0], out, "3-D input")


@pytest.mark.parametrize("dtype,rows,hidden,strided", RMS_CASES, ids=str)
def test_fused_add_rms_norm_matches_ref(dtype, rows, hidden, strided):
    torch.manual_seed(800 + hidden + rows)
    x, w = _rms_inputs(dtype, rows, hidden, strided)
    residual = randn(rows, hidden, dtype=dtype, scale=3.0)
    x_before, r_before = x.clone(), residual.clone()
    eps = 1e-6
    out, new_res = fused_add_rms_norm(x, residual, w, eps)
    ref_out, ref_res = fused_add_rms_norm_ref(x, residual, w, eps)
    assert_bitwise(new_res, ref_res, "new residual")  # one rounding of an exact sum
    _assert_rms_close(out, ref_out, dtype, "fused_add_rms_norm")
    assert_bitwise(x, x_before, "x modified")
    assert_bitwise(residual, r_before, "residual modified")
    # fused == unfused on the kernel side too
    assert_bitwise(out, rms_norm(new_res, w, eps), "fused vs rms_norm(new residual)")


@pytest.mark.parametrize("dtype", [F32, BF16, F16], ids=str)
def test_rms_norm_batch_invariant(dtype):
    torch.manual_seed(900)
    x, w = _rms_inputs(dtype, 33, 96, False)
    full = rms_norm_batch_invariant(x, w, 1e-6)
    for m in (1, 7, 33):
        assert_bitwise(rms_norm_batch_invariant(x[:m], w, 1e-6), full[:m], f"M={m}")
        other = randn(m + 5, 96, dtype=dtype)
        other[:m] = x[:m]
        assert_bitwise(rms_norm_batch_invariant(other, w, 1e-6)[:m], full[:m], f"M={m} (+5)")
    _assert_rms_close(full, rms_norm_batch_invariant_ref(x, w, 1e-6), dtype, "vs ref")


# ------------------------------------------------------------------------- silu_and_mul

# (dtype, tokens, intermediate, strided rows): 1000 is not a power of two, 1536 spans two
# 1024-wide programs with a masked tail
SILU_CASES = [(F32, 1, 64, False), (F32, 5, 1536, True), (F16, 3, 1000, False),
              (BF16, 33, 64, True), (BF16, 2, 1536, False)]


@pytest.mark.parametrize("dtype,rows,inter,strided", SILU_CASES, ids=str)
def test_silu_and_mul_matches_ref(dtype, rows, inter, strided):
    """Within 1 ulp of the dtype (float32: 4 ulp): Triton's exp may differ from
    PyTorch's by a few float32 ulp, which can move a rounding (see minivllm_kernels.activation)."""
    torch.manual_seed(950 + inter + rows)
    wide = randn(rows, 2 * inter + (8 if strided else 0), dtype=dtype, scale=4.0)
    x = wide[:, :2 * inter]  # strided: rows 2 * inter + 8 apart
    out = poison_(torch.empty(rows, inter, dtype=dtype, device=DEVICE))
    got = silu_and_mul(x, out=out)
    assert got is out and not is_poison(out).any(), "rows or columns left unwritten"
    assert_ulp(out, silu_and_mul_ref(x), dtype, "silu_and_mul", n_ulp=4 if dtype == F32 else 1)
    # batch invariance: a row's output does not depend on the other rows
    assert_bitwise(silu_and_mul(x[:1]), out[:1], "row 0 alone")
    assert silu_and_mul(x[:0]).shape == (0, inter)



def _small_kv(cache_dtype=F32, H=2, D=64, slots=32):
    return (torch.zeros(slots, H, D, dtype=cache_dtype, device=DEVICE),
            torch.zeros(slots, H, D, dtype=cache_dtype, device=DEVICE))


def _bad_calls():
    D, bs = 64, 16
    k = torch.zeros(3, 2, D, device=DEVICE)
    kc, vc = _small_kv()
    kc8, vc8 = _small_kv(I8)
    sm = torch.arange(3, device=DEVICE)
    q = torch.zeros(2, 4, D, device=DEVICE)
    bt = torch.zeros(2, 2, dtype=torch.int32, device=DEVICE)
    sl = torch.tensor([3, 5], dtype=torch.int32, device=DEVICE)
    qs, ql = sl.new_tensor([0, 1]), sl.new_tensor([1, 1])
    scs = torch.ones(32, 2, device=DEVICE)
    x = torch.zeros(5, 16, device=DEVICE)
    return {
        "store: value shape": lambda: reshape_and_cache(k, k[:, :1], kc, vc, sm),
        "store: cache head_dim": lambda: reshape_and_cache(k, k, kc[..., :32], vc[..., :32], sm),
        "store: slot_mapping length": lambda: reshape_and_cache(k, k, kc, vc, sm[:2]),
        "store: k_scale_cache alone": lambda: reshape_and_cache(k, k, kc8, vc8, sm,
                                                                k_scale_cache=scs),
        "store: scale cache on a float cache": lambda: reshape_and_cache(
            k, k, kc, vc, sm, k_scale_cache=scs, v_scale_cache=scs),
        "store: static scale shape": lambda: reshape_and_cache(
            k, k, kc8, vc8, sm, k_scale=torch.ones(3, device=DEVICE)),
        "store: non-contiguous cache": lambda: reshape_and_cache(
            k, k, kc.transpose(0, 1).contiguous().transpose(0, 1), vc, sm),
        "decode: head_dim": lambda: paged_attention_decode(q[..., :32], kc, vc, bt, sl, bs, 0.1),
        "decode: heads not a multiple of kv heads": lambda: paged_attention_decode(
            torch.zeros(2, 3, D, device=DEVICE), kc, vc, bt, sl, bs, 0.1),
        "decode: k/v cache shapes": lambda: paged_attention_decode(q, kc, vc[:16], bt, sl, bs, 0.1),
        "decode: static scale shape": lambda: paged_attention_decode(
            q, kc8, vc8, bt, sl, bs, 0.1, k_scale=torch.ones(5, device=DEVICE)),
        "decode: q last dim strided": lambda: paged_attention_decode(
            torch.zeros(2, 4, 2 * D, device=DEVICE)[..., ::2], kc, vc, bt, sl, bs, 0.1),
        "prefill: head_dim": lambda: paged_prefill_attention(
            torch.zeros(2, 4, 32, device=DEVICE), kc, vc, bt, qs, ql, sl, bs, 0.1),
        "prefill: non-contiguous cache": lambda: paged_prefill_attention(
            q, kc[::2], vc[::2], bt, qs, ql, sl, bs, 0.1),
        "rms_norm: weight shape": lambda: rms_norm(x, torch.ones(15, device=DEVICE), 1e-6),
        "rms_norm: weight dtype": lambda: rms_norm(x, torch.ones(16, device=DEVICE,
                                                                  dtype=F16), 1e-6),
        "fused: residual shape": lambda: fused_add_rms_norm(x, x[:4], torch.ones(16, device=DEVICE),
                                                            1e-6),
        "fused: residual dtype": lambda: fused_add_rms_norm(x, x.to(BF16),
                                                            torch.ones(16, device=DEVICE), 1e-6),
        "matmul: inner dims": lambda: matmul_batch_invariant(x, torch.zeros(15, 4, device=DEVICE)),
        "matmul: dtypes": lambda: matmul_batch_invariant(x, torch.zeros(16, 4, device=DEVICE,
                                                                        dtype=BF16)),
        "matmul: bias shape": lambda: matmul_batch_invariant(x, torch.zeros(16, 4, device=DEVICE),
                                                             torch.zeros(5, device=DEVICE)),
        "silu_and_mul: odd last dim": lambda: silu_and_mul(torch.zeros(2, 5, device=DEVICE)),
        "silu_and_mul: 1-D": lambda: silu_and_mul(torch.zeros(8, device=DEVICE)),
        "silu_and_mul: int dtype": lambda: silu_and_mul(torch.zeros(2, 8, dtype=torch.int32,
                                                                    device=DEVICE)),
        "silu_and_mul: strided last dim": lambda: silu_and_mul(
            torch.zeros(2, 16, device=DEVICE)[:, ::2]),
        "silu_and_mul: out shape": lambda: silu_and_mul(torch.zeros(2, 8, device=DEVICE),
                                                        out=torch.zeros(2, 8, device=DEVICE)),
        "matmul: 3-D": lambda: matmul_batch_invariant(x[None], torch.zeros(16, 4, device=DEVICE)),
    }


@pytest.mark.parametrize("name", list(_bad_calls()))
def test_bad_inputs_raise_value_error(name):
    with pytest.raises(ValueError):
        _bad_calls()[name]()


def test_mismatched_cache_dtypes_raise():
    """The storage format comes from key_cache: a value_cache of another dtype must be
    refused, not written or read with the key cache's rules."""
    kc, _ = _small_kv(F16)
    _, vc = _small_kv(I8)
    k = torch.zeros(3, 2, 64, dtype=F16, device=DEVICE)
    q = torch.zeros(2, 4, 64, dtype=F16, device=DEVICE)
    bt = torch.zeros(2, 2, dtype=torch.int32, device=DEVICE)
    sl = torch.tensor([3, 5], dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError):
        reshape_and_cache(k, k, kc, vc, torch.arange(3, device=DEVICE))
    with pytest.raises(ValueError):
        paged_attention_decode(q, kc, vc, bt, sl, 16, 0.1)
    with pytest.raises(ValueError):
        paged_prefill_attention(q, kc, vc, bt, sl.new_tensor([0, 1]), sl.new_tensor([1, 1]),
                                sl, 16, 0.1)


@pytest.mark.parametrize("case", ["decode out dtype", "decode out shape", "prefill out dtype",
                                  "decode k_scale_cache alone", "prefill k_scale_cache alone",
                                  "decode splits_per_program 0",
                                  "decode splits_per_program 1.5",
                                  "decode splits_per_program True"])
def test_attention_argument_checks(case):
    """`out` must match q; dynamic scale caches come in pairs (as in reshape_and_cache)."""
    D, bs = 64, 16
    q = torch.zeros(2, 4, D, device=DEVICE)
    kc, vc = _small_kv(I8)
    bt = torch.zeros(2, 2, dtype=torch.int32, device=DEVICE)
    sl = torch.tensor([3, 5], dtype=torch.int32, device=DEVICE)
    pre = dict(query_starts=sl.new_tensor([0, 1]), query_lens=sl.new_tensor([1, 1]))
    scs = torch.ones(32, 2, device=DEVICE)
    with pytest.raises(ValueError):
        if case == "decode out dtype":
            paged_attention_decode(q, kc, vc, bt, sl, bs, 0.1, out=torch.empty_like(q, dtype=F16))
        elif case == "decode out shape":
            paged_attention_decode(q, kc, vc, bt, sl, bs, 0.1,
                                   out=torch.empty(2, 4, D + 8, device=DEVICE))
        elif case == "prefill out dtype":
            paged_prefill_attention(q, kc, vc, bt, seq_lens=sl, block_size=bs, scale=0.1,
                                    out=torch.empty_like(q, dtype=F16), **pre)
        elif case == "decode k_scale_cache alone":
            paged_attention_decode(q, kc, vc, bt, sl, bs, 0.1, k_scale_cache=scs)
        elif case.startswith("decode splits_per_program"):
            value = {"0": 0, "1.5": 1.5, "True": True}[case.split()[-1]]
            paged_attention_decode(q, kc, vc, bt, sl, bs, 0.1, splits_per_program=value)
        else:
            paged_prefill_attention(q, kc, vc, bt, seq_lens=sl, block_size=bs, scale=0.1,
                                    k_scale_cache=scs, **pre)


@pytest.mark.parametrize("kernel", ["store", "decode", "prefill"])
def test_strided_index_tensors(kernel):
    """slot_mapping, seq_lens, query_starts/lens and block tables given as strided views
    (a column of a matrix, a transposed table) are honoured, or refused with ValueError."""
    torch.manual_seed(1000)
    D, bs = 64, 16
    col = lambda rows: torch.tensor(rows, dtype=torch.int32, device=DEVICE)[:, 0]  # noqa: E731
    try:
        if kernel == "store":
            k = randn(2, 1, D)
            c = [poison_(torch.empty(bs, 1, D, device=DEVICE)) for _ in range(4)]
            sm = col([[3, 9], [5, 9]]).long()  # [3, 5], stride 2
            reshape_and_cache(k, k, c[0], c[1], sm)
            reshape_and_cache_ref(k, k, c[2], c[3], sm)
            assert_bitwise(c[0], c[2], "cache")
            return
        kc, vc = randn(4 * bs, 1, D), randn(4 * bs, 1, D)
        bt = torch.tensor([[3, 1], [0, 2]], dtype=torch.int32, device=DEVICE).t()  # stride (1, 2)
        sl = col([[17, 7], [30, 7]])  # [17, 30]
        if kernel == "decode":
            q = randn(2, 1, D)
            out = paged_attention_decode(q, kc, vc, bt, sl, bs, D ** -0.5)
            ref = paged_attention_decode_ref(q, kc, vc, bt, sl, bs, D ** -0.5)
        else:
            q = randn(9, 1, D)
            args = (kc, vc, bt, col([[5, 0], [0, 0]]), col([[4, 1], [3, 1]]), sl, bs, D ** -0.5)
            out = paged_prefill_attention(q, *args, out=poison_(torch.empty_like(q)))
            ref = paged_prefill_attention_ref(q, *args, out=poison_(torch.empty_like(q)))
            assert is_poison(out[3:5]).all() and is_poison(out[9:]).all()
            rows = torch.tensor([0, 1, 2, 5, 6, 7, 8], device=DEVICE)
            out, ref = out[rows], ref[rows]
        assert_attn_close(out, ref, F32, f"{kernel} with strided index tensors")
    except ValueError:
        pass  # refusing the views is fine too
