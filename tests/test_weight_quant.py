"""Weight quantization algorithms (minivllm.quantization.weight_quant) on small random
matrices: error bounds derived from each format, GPTQ/AWQ beating round-to-nearest on the
layer output, fp8 linear against a float64 reference, and argument errors.

Tolerances: "ULP slack" below is 1e-5 of a quantization step, far under the error a wrong
rounding rule or scale would cause (half a step or more)."""

from __future__ import annotations

import pytest
import torch

from minivllm.quantization import weight_quant as wq

pytestmark = pytest.mark.usefixtures("one_thread")

STEP_SLACK = 1e-5  # of one quantization step: float32 rounding in w / scale and q * scale
SHAPES = [(48, 256), (5, 384)]
GROUP_SIZES = [32, 64, 128]


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def weight(out: int, inp: int, seed: int, outlier_rows: int = 2) -> torch.Tensor:
    """N(0, 0.05^2) weights; the first `outlier_rows` rows get a few entries 30x larger."""
    g = gen(seed)
    w = torch.randn(out, inp, generator=g) * 0.05
    for r in range(min(outlier_rows, out)):
        cols = torch.randperm(inp, generator=g)[:3]
        w[r, cols] = 1.5 * torch.sign(torch.randn(3, generator=g))
    return w


def per_group(t: torch.Tensor, group_size: int) -> torch.Tensor:
    """[out, n_groups] -> [out, in]: each group's value repeated over its columns."""
    return t.repeat_interleave(group_size, dim=1)


def out_err(x: torch.Tensor, w: torch.Tensor, w_hat: torch.Tensor) -> float:
    """||x w^T - x w_hat^T||_F"""
    return float((x @ w.T - x @ w_hat.T).norm())


# --- int8 ----------------------------------------------------------------------------------

@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("granularity", ["tensor", "channel"])
def test_int8_round_trip_within_half_step(shape, granularity):
    w = weight(*shape, seed=1)
    q, scale = wq.quantize_int8(w, granularity)
    assert q.dtype == torch.int8 and q.shape == w.shape
    if granularity == "tensor":
        assert scale.shape == () and float(scale) == pytest.approx(float(w.abs().max()) / 127, rel=1e-6)
    else:
        assert scale.shape == (shape[0], 1)
        torch.testing.assert_close(scale, w.abs().amax(1, keepdim=True) / 127, rtol=1e-6, atol=0)
    # full range used: the largest |w| of each scale's span maps to +-127
    span_max = q.abs().max() if granularity == "tensor" else q.abs().amax(1)
    assert bool((span_max == 127).all())
    err = (w - wq.dequantize_int8(q, scale)).abs()
    worst = float((err / scale).max())
    assert worst <= 0.5 + STEP_SLACK, f"max |w - deq| / scale = {worst} > 1/2"


def test_int8_per_channel_error_not_above_per_tensor():
    w = weight(48, 256, seed=2, outlier_rows=4)
    mse = {g: float((w - wq.dequantize_int8(*wq.quantize_int8(w, g))).pow(2).mean())
           for g in ("tensor", "channel")}
    assert mse["channel"] < 0.5 * mse["tensor"], f"mse per channel/tensor: {mse}"

    # every row with the same amax: per-channel scales all equal the per-tensor scale
    same = weight(48, 256, seed=3, outlier_rows=0)
    same[:, 7] = 0.4
    deq_t = wq.dequantize_int8(*wq.quantize_int8(same, "tensor"))
    deq_c = wq.dequantize_int8(*wq.quantize_int8(same, "channel"))
    assert torch.equal(deq_t, deq_c), f"max diff {float((deq_t - deq_c).abs().max())}"


def test_int8_zero_matrix_gets_unit_scale():
    q, scale = wq.quantize_int8(torch.zeros(3, 4), "channel")
    assert torch.equal(scale, torch.ones(3, 1)) and not q.any()


# --- int4 ----------------------------------------------------------------------------------

@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("group_size", GROUP_SIZES)
def test_int4_symmetric_round_trip(shape, group_size):
    w = weight(*shape, seed=4)
    q, scale, zero = wq.quantize_int4(w, group_size, symmetric=True)
    n_groups = shape[1] // group_size
    assert (q.dtype, scale.dtype, zero.dtype) == (torch.uint8, torch.float32, torch.uint8)
    assert q.shape == w.shape and scale.shape == zero.shape == (shape[0], n_groups)
    assert bool((zero == 8).all()) and int(q.max()) <= 15
    wg = w.reshape(shape[0], n_groups, group_size)
    torch.testing.assert_close(scale, wg.abs().amax(-1) / 7, rtol=1e-6, atol=0)
    signed = (q.to(torch.int16) - 8).reshape(shape[0], n_groups, group_size)
    assert bool((signed.abs().amax(-1) == 7).all()), "each group's amax must map to +-7"
    deq = wq.dequantize_int4(q, scale, zero, group_size)
    worst = float(((w - deq).abs() / per_group(scale, group_size)).max())
    assert worst <= 0.5 + STEP_SLACK, f"max |w - deq| / scale = {worst} > 1/2"


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("group_size", GROUP_SIZES)
def test_int4_asymmetric_round_trip(shape, group_size):
    """Bound: the grid (k - zero) * scale, k = 0..15, spans 15 steps like [lo, hi], but the
    integer zero point shifts it by |round(-lo/scale) - (-lo/scale)| <= 1/2 step, so one end
    of [lo, hi] can stick out by up to half a step. Such values saturate at the end code
    and are still within scale/2; interior values round to within scale/2. Hence
    |w - deq| <= scale / 2 everywhere (not the looser `scale`)."""
    w = weight(*shape, seed=5)
    q, scale, zero = wq.quantize_int4(w, group_size, symmetric=False)
    n_groups = shape[1] // group_size
    wg = w.reshape(shape[0], n_groups, group_size)
    lo, hi = wg.amin(-1), wg.amax(-1)
    assert bool((lo < 0).all() & (hi > 0).all())  # so the range-includes-0 rule is moot here
    torch.testing.assert_close(scale, (hi - lo) / 15, rtol=1e-6, atol=0)
    assert torch.equal(zero, torch.round(-lo / scale).to(torch.uint8))
    qg = q.reshape(shape[0], n_groups, group_size)
    assert bool((qg.amin(-1) == 0).all() & (qg.amax(-1) == 15).all()), "codes must span 0..15"
    deq = wq.dequantize_int4(q, scale, zero, group_size)
    worst = float(((w - deq).abs() / per_group(scale, group_size)).max())
    assert worst <= 0.5 + STEP_SLACK, f"max |w - deq| / scale = {worst} > 1/2"


def test_int4_asymmetric_one_sign_group_keeps_its_grid():
    """An all-positive group: the range is [0, max], zero point 0, error still <= scale/2
    (with zero clamped from min > 0 instead, most values would saturate at code 15)."""
    w = torch.linspace(0.5, 1.0, 32).reshape(1, 32)
    q, scale, zero = wq.quantize_int4(w, 32, symmetric=False)
    assert int(zero) == 0 and float(scale) == pytest.approx(1.0 / 15, rel=1e-6)
    err = float((w - wq.dequantize_int4(q, scale, zero, 32)).abs().max())
    assert err <= float(scale) * (0.5 + STEP_SLACK), f"max err {err}, scale {float(scale)}"


@pytest.mark.parametrize("symmetric", [True, False])
def test_int4_clip_ratio_shrinks_range(symmetric):
    w = weight(8, 128, seed=6)
    ratio = torch.full((8, 4), 0.5)
    ratio[:, 0] = 1.0
    _, s_full, _ = wq.quantize_int4(w, 32, symmetric)
    q, s_clip, zero = wq.quantize_int4(w, 32, symmetric, clip_ratio=ratio)
    torch.testing.assert_close(s_clip, s_full * ratio, rtol=1e-6, atol=0)
    deq = wq.dequantize_int4(q, s_clip, zero, 32)
    step = per_group(s_clip, 32)
    lo = per_group(-zero.float() * s_clip, 32)
    hi = per_group((15 - zero.float()) * s_clip, 32)
    inside = (w >= lo) & (w <= hi)
    worst_in = float(((w - deq).abs() / step)[inside].max())
    assert worst_in <= 0.5 + STEP_SLACK, f"in-range max err/scale {worst_in}"
    # beyond the grid: saturated at the end codes
    assert bool((q[w > hi] == 15).all() & (q[w < lo] == 0).all())
    assert int((~inside).sum()) > 0


def test_int4_zero_group_dequantizes_to_zero():
    w = weight(4, 64, seed=7)
    w[2, 32:] = 0.0
    for symmetric in (True, False):
        q, scale, zero = wq.quantize_int4(w, 32, symmetric)
        assert float(scale[2, 1]) == 1.0
        assert not wq.dequantize_int4(q, scale, zero, 32)[2, 32:].any()


# --- pack / unpack -------------------------------------------------------------------------

def test_pack_unpack_round_trip_and_nibble_order():
    q = torch.randint(0, 16, (48, 256), generator=gen(8), dtype=torch.uint8)
    packed = wq.pack_int4(q)
    assert packed.shape == (48, 128) and packed.dtype == torch.uint8
    assert torch.equal(wq.unpack_int4(packed), q)
    assert wq.pack_int4(torch.tensor([[1, 2, 15, 0]], dtype=torch.uint8)).tolist() == [[0x21, 0x0F]]
    assert wq.weight_bytes(packed) == 48 * 128


def test_pack_rejects_bad_codes():
    with pytest.raises(ValueError, match=r"q holds values up to 16"):
        wq.pack_int4(torch.tensor([[16, 0]], dtype=torch.uint8))
    with pytest.raises(ValueError, match=r"in_features must be even"):
        wq.pack_int4(torch.zeros(2, 3, dtype=torch.uint8))
    with pytest.raises(ValueError, match=r"q must be a 2-D torch.uint8"):
        wq.pack_int4(torch.zeros(2, 4, dtype=torch.int32))


# --- GPTQ ----------------------------------------------------------------------------------

IN_GPTQ = 256


@pytest.fixture(scope="module")
def gptq_data():
    """Correlated, unequal-scale inputs X = (Z @ A) * c with 6 channels 10x larger,
    a calibration batch and a held-out batch from the same distribution, and a weight."""
    g = gen(10)
    mix = torch.randn(IN_GPTQ, IN_GPTQ, generator=g) / IN_GPTQ ** 0.5
    col_scale = torch.ones(IN_GPTQ)
    col_scale[torch.randperm(IN_GPTQ, generator=g)[:6]] = 10.0

    def batch(n):
        return (torch.randn(n, IN_GPTQ, generator=g) @ mix) * col_scale

    x_cal, x_held = batch(1024), batch(1024)
    return x_cal, x_held, wq.hessian_from_inputs(x_cal), weight(48, IN_GPTQ, seed=11)


@pytest.mark.parametrize("group_size", [32, 128])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_beats_rtn_on_layer_output(gptq_data, group_size, symmetric, act_order):
    x_cal, x_held, h, w = gptq_data
    q, scale, zero = wq.gptq_quantize(w, h, group_size, symmetric, act_order=act_order)
    n_groups = IN_GPTQ // group_size
    assert q.dtype == zero.dtype == torch.uint8 and q.shape == w.shape
    assert int(q.max()) <= 15 and int(zero.max()) <= 15
    assert scale.shape == zero.shape == (48, n_groups)
    assert bool(torch.isfinite(scale).all() & (scale > 0).all())
    if symmetric:
        assert bool((zero == 8).all())
    _, s_rtn, z_rtn = wq.quantize_int4(w, group_size, symmetric)
    if act_order:  # static groups: parameters from the original weights
        assert torch.equal(scale, s_rtn) and torch.equal(zero, z_rtn)
    else:  # nothing updates the first group before the sweep reaches it
        assert torch.equal(scale[:, 0], s_rtn[:, 0]) and torch.equal(zero[:, 0], z_rtn[:, 0])

    deq = wq.dequantize_int4(q, scale, zero, group_size)
    rtn = wq.dequantize_int4(*wq.quantize_int4(w, group_size, symmetric), group_size)
    cal = out_err(x_cal, w, deq) / out_err(x_cal, w, rtn)
    held = out_err(x_held, w, deq) / out_err(x_held, w, rtn)
    assert cal < 0.9, f"GPTQ/RTN output error on calibration batch = {cal:.3f}"
    assert held < 0.95, f"GPTQ/RTN output error on held-out batch = {held:.3f}"


@pytest.mark.parametrize("symmetric", [True, False])
def test_int4_short_last_group(symmetric):
    """in=80 with groups of 32: groups [0,32), [32,64), [64,80). The short group's scale and
    zero equal those of quantizing its 16 columns on their own, and the half-step bound
    holds for every column (SmolLM2's 576 inputs with group 128 end in a group of 64)."""
    w = weight(12, 80, seed=50)
    q, scale, zero = wq.quantize_int4(w, 32, symmetric)
    assert q.shape == (12, 80) and scale.shape == zero.shape == (12, 3)
    _, s_tail, z_tail = wq.quantize_int4(w[:, 64:], 16, symmetric)
    assert torch.equal(scale[:, 2:], s_tail) and torch.equal(zero[:, 2:], z_tail)
    _, s_head, z_head = wq.quantize_int4(w[:, :64], 32, symmetric)
    assert torch.equal(scale[:, :2], s_head) and torch.equal(zero[:, :2], z_head)
    err = (w - wq.dequantize_int4(q, scale, zero, 32)).abs()
    bound = scale.repeat_interleave(32, dim=1)[:, :80] / 2 * (1 + 1e-6)
    assert bool((err <= bound).all()), f"max err/step = {float((err / (2 * bound)).max()):.4f}"


def test_gptq_short_last_group_beats_rtn(gptq_data):
    x_cal, _, h, w = gptq_data
    w, h, x = w[:, :224], h[:224, :224], x_cal[:, :224]  # 224 = 128 + 96
    for act_order in (False, True):
        q, scale, zero = wq.gptq_quantize(w, h, 128, True, act_order=act_order)
        assert scale.shape == (48, 2)
        deq = wq.dequantize_int4(q, scale, zero, 128)
        rtn = wq.dequantize_int4(*wq.quantize_int4(w, 128, True), 128)
        ratio = out_err(x, w, deq) / out_err(x, w, rtn)
        assert ratio < 0.95, f"GPTQ/RTN output error (act_order={act_order}) = {ratio:.3f}"


def test_awq_short_last_group(awq_data):
    x, x_salient, weights = awq_data
    w, xx = weights[0][:, :160], x_salient[:, :160]  # 160 = 128 + 32
    s, info = wq.awq_search_scale([w], xx, 128, False)
    assert info["best_loss"] <= info["rtn_loss"]
    q, scale, zero = wq.awq_quantize(w, s, xx, 128, False)
    assert scale.shape == (48, 2)
    y = (xx / s) @ wq.dequantize_int4(q, scale, zero, 128).T
    rtn = out_err(xx, w, wq.dequantize_int4(*wq.quantize_int4(w, 128, False), 128))
    assert float((y - xx @ w.T).norm()) <= rtn * (1 + 1e-6)


@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_with_diagonal_hessian_is_rtn(act_order):
    """Uncorrelated inputs: H^-1 is diagonal, no error reaches other columns, GPTQ == RTN."""
    w = weight(16, 128, seed=12)
    h = torch.diag(torch.rand(128, generator=gen(13)) + 0.5)
    for symmetric in (True, False):
        got = wq.gptq_quantize(w, h, 32, symmetric, act_order=act_order)
        want = wq.quantize_int4(w, 32, symmetric)
        for a, b in zip(got, want):
            assert torch.equal(a, b), f"max diff {float((a.float() - b.float()).abs().max())}"


@pytest.mark.parametrize("symmetric", [True, False])
def test_gptq_lazy_batches_do_not_change_the_result(gptq_data, symmetric):
    """block_size=1 is the plain column-by-column algorithm. With 128, groups start
    mid-block; their parameters must still see every earlier update (reading only the
    outer weights, as the reference does, changes ~25% of the codes here)."""
    _, _, h, w = gptq_data
    q1 = wq.gptq_quantize(w, h, 32, symmetric, block_size=1)[0]
    q128 = wq.gptq_quantize(w, h, 32, symmetric, block_size=128)[0]
    agree = float((q1 == q128).float().mean())
    assert agree >= 0.99, f"codes agreeing between block sizes 1 and 128: {agree:.4f}"


def test_gptq_dead_input_column_is_zeroed(gptq_data):
    x_cal, _, _, w = gptq_data
    x = x_cal.clone()
    x[:, 5] = 0.0
    q, scale, zero = wq.gptq_quantize(w, wq.hessian_from_inputs(x), 32, symmetric=False)
    deq = wq.dequantize_int4(q, scale, zero, 32)
    assert bool(torch.isfinite(deq).all())
    assert not deq[:, 5].any(), f"dead column max |deq| {float(deq[:, 5].abs().max())}"


def test_accumulate_hessian_matches_one_shot(gptq_data):
    x_cal = gptq_data[0]
    h, n = wq.accumulate_hessian(None, x_cal[:300], 0)
    h, n = wq.accumulate_hessian(h, x_cal[300:], n)
    want = 2.0 / 1024 * (x_cal.double().T @ x_cal.double())
    assert n == 1024 and h.dtype == torch.float32
    rel = float((h.double() - want).abs().max() / want.abs().max())
    assert rel < 1e-5, f"relative max error {rel:.2e}"


def test_gptq_cholesky_failure_advises():
    w = weight(4, 2, seed=14, outlier_rows=0)
    h = torch.tensor([[1.0, 2.0], [2.0, 1.0]])  # eigenvalues 3 and -1
    with pytest.raises(ValueError, match=r"not positive definite with percdamp=0.01.*calibration"):
        wq.gptq_quantize(w, h, 2, symmetric=True)


# --- AWQ -----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def awq_data():
    """512 tokens x 256 channels, 4 salient channels 20x larger; q/k/v-like weights."""
    g = gen(20)
    x = torch.randn(512, 256, generator=g)
    x_salient = x.clone()
    x_salient[:, torch.randperm(256, generator=g)[:4]] *= 20.0
    weights = [torch.randn(out, 256, generator=g) * 0.05 for out in (48, 32, 32)]
    return x, x_salient, weights


def awq_loss_by_hand(weights, x, s, group_size, symmetric):
    total = 0.0
    for w in weights:
        deq = wq.dequantize_int4(*wq.quantize_int4(w * s, group_size, symmetric), group_size)
        total += float(((x / s) @ deq.T - x @ w.T).pow(2).mean())
    return total


@pytest.mark.parametrize("symmetric", [True, False])
def test_awq_scale_search_never_worse_than_rtn(awq_data, symmetric):
    x, x_salient, weights = awq_data
    for xx, must_gain in ((x, False), (x_salient, True)):
        s, info = wq.awq_search_scale(weights, xx, 64, symmetric)
        assert s.shape == (256,) and s.dtype == torch.float32
        rtn = awq_loss_by_hand(weights, xx, torch.ones(256), 64, symmetric)
        assert info["rtn_loss"] == pytest.approx(rtn, rel=1e-6), (info["rtn_loss"], rtn)
        recomputed = awq_loss_by_hand(weights, xx, s, 64, symmetric)
        assert info["best_loss"] == pytest.approx(recomputed, rel=1e-6)
        assert info["best_loss"] <= info["rtn_loss"], info
        assert info["best_loss"] == min(info["losses"]) and len(info["losses"]) == 20
        if must_gain:
            gain = info["best_loss"] / info["rtn_loss"]
            assert info["best_ratio"] > 0 and gain < 0.5, f"best/rtn loss {gain:.3f}, {info}"
            # salient channels are scaled up the most
            assert int(s.argmax()) in set(torch.nonzero(x_salient[0] != x[0]).flatten().tolist())


@pytest.mark.parametrize("symmetric", [True, False])
def test_awq_quantize_output_error_not_above_rtn(awq_data, symmetric):
    x, x_salient, weights = awq_data
    w = weights[0]
    for xx in (x, x_salient):
        s, _ = wq.awq_search_scale([w], xx, 64, symmetric)
        rtn = out_err(xx, w, wq.dequantize_int4(*wq.quantize_int4(w, 64, symmetric), 64))
        for clip in (False, True):
            q, scale, zero = wq.awq_quantize(w, s, xx, 64, symmetric, clip=clip)
            y = (xx / s) @ wq.dequantize_int4(q, scale, zero, 64).T
            ratio = float((y - xx @ w.T).norm()) / rtn
            assert ratio <= 1 + 1e-6, f"AWQ (clip={clip}) / RTN output error = {ratio:.4f}"


@pytest.mark.parametrize("symmetric", [True, False])
def test_awq_clip_picks_per_group_minimum(awq_data, symmetric):
    """Each group's chosen ratio gives a group output error <= that of every candidate
    (checked against r = 1 and r = 0.55), and heavy-tailed weights get clipped somewhere."""
    x = awq_data[0][:256]  # <= n_sample_tokens: every token is used
    w = torch.randn(70, 256, generator=gen(21)).pow(3) * 0.02  # heavy tails; 70 rows: 2 chunks
    ratio = wq.awq_search_clip(w, x, 64, symmetric)
    candidates = {round(1 - k / 20, 6) for k in range(10)}
    assert ratio.shape == (70, 4)
    assert {round(float(r), 6) for r in ratio.flatten()} <= candidates
    assert float(ratio.min()) < 1.0

    xg = x.reshape(256, 4, 64)

    def group_err(clip):
        deq = wq.dequantize_int4(*wq.quantize_int4(w, 64, symmetric, clip), 64)
        diff = (w - deq).reshape(70, 4, 64)
        return torch.einsum("tgk,rgk->rtg", xg, diff).pow(2).mean(1)

    chosen = group_err(ratio)
    for r in (1.0, 0.55):
        other = group_err(torch.full((70, 4), r))
        worst = float((chosen - other).max() / other.mean())
        assert worst <= 1e-5, f"chosen clip worse than r={r} by {worst:.2e} (relative)"


# --- fp8 -----------------------------------------------------------------------------------

E4M3_MIN_NORMAL = 2.0 ** -6


@pytest.mark.parametrize("granularity", ["tensor", "channel"])
def test_fp8_weight_round_trip_bounds(granularity):
    """e4m3 keeps 3 mantissa bits: a normal value v (|v| >= 2^-6) in [2^e, 2^(e+1)) lies on
    a grid of step 2^(e-3), so rounding errs by <= 2^(e-4) <= 2^-4 |v|. Subnormals have the
    fixed step 2^-9, so |error| <= 2^-10 in scaled units, i.e. 2^-10 * scale."""
    w = weight(48, 256, seed=30)
    w[:, :16] *= 1e-3  # tiny values land in e4m3's subnormal range after scaling
    q, scale = wq.quantize_fp8_weight(w, granularity)
    assert q.dtype == torch.float8_e4m3fn
    assert scale.shape == (() if granularity == "tensor" else (48, 1))
    deq = q.float() * scale
    full_scale = scale.expand_as(w)
    normal = (w / full_scale).abs() >= E4M3_MIN_NORMAL
    assert int(normal.sum()) > 0 and int((~normal).sum()) > 0
    rel = float(((deq - w).abs() / w.abs())[normal].max())
    assert rel <= 2.0 ** -4 * (1 + 1e-6), f"normal-range relative error {rel} > 2^-4"
    sub = float(((deq - w).abs() / full_scale)[~normal].max())
    assert sub <= 2.0 ** -10 * (1 + 1e-6), f"subnormal error / scale {sub} > 2^-10"
    assert float(q.float().abs().max()) == 448.0


def fp8_linear_reference(x, q_w, w_scale, x_scale, bias):
    """float64: per-token (x_scale None) or static activation quantization, then the
    exact product of the fp8 codes, rescaled, plus bias."""
    x64 = x.double()
    if x_scale is None:
        xs = (x64.abs().amax(-1, keepdim=True) / 448).clamp(min=1 / (448 * 512))
    else:
        xs = x_scale.double()
    codes = (x64 / xs).clamp(-448, 448).to(torch.float8_e4m3fn).double()
    return (codes @ q_w.double().T) * xs * w_scale.double().reshape(-1) + bias.double()


@pytest.mark.parametrize("granularity", ["tensor", "channel"])
def test_fp8_linear_matches_float64_reference(granularity):
    g = gen(31)
    x = torch.randn(16, 256, generator=g)
    x[3] *= 50.0  # a loud token: per-token scales matter
    x[5] = 0.0  # an all-zero token: dynamic scale floor
    w = weight(48, 256, seed=32)
    bias = torch.randn(48, generator=g)
    q_w, w_scale = wq.quantize_fp8_weight(w, granularity)
    plain = x @ w.T + bias
    static = (x.abs().max() / 448 * 0.5).reshape(())  # saturates the loudest values
    outs = {}
    for name, xs in (("dynamic", None), ("static", static)):
        y = wq.fp8_linear(x, q_w, w_scale, xs, bias=bias)
        assert y.dtype == torch.float32 and y.shape == (16, 48)
        ref = fp8_linear_reference(x, q_w, w_scale, xs, bias)
        err = float((y.double() - ref).abs().max() / ref.abs().max())
        assert err < 1e-6, f"{name}: max |y - ref| / max |ref| = {err:.2e}"
        moved = float((y - plain).abs().max() / plain.abs().max())
        assert moved > 1e-3, f"{name}: fp8 output too close to the float matmul ({moved:.2e})"
        outs[name] = y
    assert not torch.allclose(outs["dynamic"], outs["static"])
    assert torch.equal(outs["dynamic"][5], bias)
    y16 = wq.fp8_linear(x.to(torch.bfloat16), q_w, w_scale, None, out_dtype=torch.bfloat16)
    assert y16.dtype == torch.bfloat16


def test_fp8_activation_scales():
    x = torch.tensor([[1.0, -896.0, 3.0], [0.0, 0.0, 0.0]])
    x_q, s = wq.quantize_fp8_activation(x, None)
    assert s.shape == (2, 1)
    assert s[0, 0] == 2.0 and s[1, 0] == pytest.approx(1 / (448 * 512))
    assert x_q[0].float().tolist() == [0.5, -448.0, 1.5] and not x_q[1].float().any()
    x_q, s = wq.quantize_fp8_activation(x, torch.tensor([1.0]))
    assert s.shape == () and float(x_q[0, 1].float()) == -448.0  # saturated, not NaN


# --- argument errors -----------------------------------------------------------------------

W = weight(4, 64, seed=40)
W_NAN = W.clone()
W_NAN[1, 3] = float("nan")
X = torch.randn(8, 64, generator=gen(41))
H = wq.hessian_from_inputs(X)


@pytest.mark.parametrize("call,pattern", [
    (lambda: wq.quantize_int4(W, 0, True), r"group_size must be positive"),
    (lambda: wq.quantize_int4(W, 32.0, True), r"group_size must be an int"),
    (lambda: wq.quantize_int4(W[0], 32, True), r"w must be 2-D"),
    (lambda: wq.quantize_int4(W_NAN, 32, True), r"w has 1 non-finite"),
    (lambda: wq.quantize_int4(W, 32, "yes"), r"symmetric must be True or False"),
    (lambda: wq.quantize_int4(W, 32, True, torch.zeros(4, 2)), r"clip_ratio values must lie in"),
    (lambda: wq.quantize_int4(W, 32, True, torch.ones(4, 3)), r"clip_ratio must have shape"),
    (lambda: wq.quantize_int8(W, "row"), r"granularity must be one of"),
    (lambda: wq.quantize_int8(W[0], "tensor"), r"w must be 2-D"),
    (lambda: wq.quantize_int8(W.long(), "tensor"), r"w must be a floating-point"),
    (lambda: wq.quantize_fp8_weight(W, "block"), r"granularity must be one of"),
    (lambda: wq.quantize_fp8_weight(W_NAN, "tensor"), r"w has 1 non-finite"),
    (lambda: wq.dequantize_int4(torch.zeros(4, 64, dtype=torch.uint8), torch.ones(4, 3),
                                torch.zeros(4, 2, dtype=torch.uint8), 32), r"scale must have shape"),
    (lambda: wq.gptq_quantize(W, H[:10, :10], 32, True), r"hessian must have shape"),
    (lambda: wq.gptq_quantize(W_NAN, H, 32, True), r"w has 1 non-finite"),
    (lambda: wq.gptq_quantize(W, H, 32, True, block_size=0), r"block_size must be positive"),
    (lambda: wq.gptq_quantize(W, H, 32, True, percdamp=-0.1), r"percdamp must be"),
    (lambda: wq.accumulate_hessian(None, X, 5), r"n_seen must be 0"),
    (lambda: wq.awq_search_scale([W], X[:, :32], 32, True), r"weights\[0\] has in_features=64"),
    (lambda: wq.awq_search_scale([], X, 32, True), r"weights must be a non-empty list"),
    (lambda: wq.awq_search_clip(W, X, 32, True, max_shrink=1.0), r"max_shrink must be in"),
    (lambda: wq.awq_quantize(W, -torch.ones(64), X, 32, True), r"s must be positive"),
    (lambda: wq.quantize_fp8_activation(X, torch.tensor(-1.0)), r"scale must be positive"),
    (lambda: wq.fp8_linear(X[:, :32], wq.quantize_fp8_weight(W, "tensor")[0],
                           torch.tensor(1.0), None), r"x must be \[\.\.\., 64\]"),
])
def test_bad_arguments_raise_value_error(call, pattern):
    with pytest.raises(ValueError, match=pattern):
        call()


def test_weight_bytes():
    q, scale, zero = wq.quantize_int4(W, 32, False)
    assert wq.weight_bytes(wq.pack_int4(q), scale, zero) == 4 * 32 + 4 * 2 * 4 + 4 * 2


def test_int4_range_overflow_is_refused():
    w = torch.tensor([[3e38, -3e38] * 16])
    with pytest.raises(ValueError, match="overflows float32"):
        wq.quantize_int4(w, 32, symmetric=False)
    q, scale, zero = wq.quantize_int4(w, 32, symmetric=True)  # amax / 7 is fine
    assert bool(torch.isfinite(scale).all())
