"""FP4 weights (minivllm/quantization/fp4.py): E2M1 rounding, packing, MXFP4 and NVFP4
scales, and the engine's quantization="mxfp4" / "modelopt_fp4" methods."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from minivllm.numerics import round_to_format
from minivllm.quantization import fp4

GRID = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def _nearest_even(v: float) -> float:
    """Brute force: the E2M1 value nearest |v| (saturating), ties to the even code."""
    a = min(abs(v), 6.0)
    best = min(range(8), key=lambda k: (abs(GRID[k] - a), k % 2))
    return -GRID[best] if v < 0 or (v == 0 and str(v).startswith("-")) else GRID[best]


def test_e2m1_rounding_matches_brute_force_and_round_to_format():
    g = torch.Generator().manual_seed(0)
    x = torch.cat([torch.randn(4000, generator=g) * 3,
                   torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, 6.5, 1e6]),
                   -torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, 6.5, 1e6]),
                   torch.arange(-800, 801) / 128])
    got = fp4.e2m1_values(fp4.e2m1_codes(x))
    want = torch.tensor([_nearest_even(float(v)) for v in x])
    assert torch.equal(got, want)
    assert torch.equal(got, round_to_format(x, "fp4_e2m1", saturate=True))
    # the midpoints go to the even code: 0.25->0, 0.75->1, 1.25->1, 1.75->2, 2.5->2, 3.5->4, 5->4
    mids = fp4.e2m1_values(fp4.e2m1_codes(torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])))
    assert mids.tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]


def test_codes_and_packing_layout():
    codes = fp4.e2m1_codes(torch.tensor([0.5, -6.0, 0.0, -0.0]))
    assert codes.tolist() == [1, 15, 0, 8]
    packed = fp4.pack_fp4(codes[None])
    assert packed.tolist() == [[0xF1, 0x80]]  # even index in the low nibble
    assert torch.equal(fp4.unpack_fp4(packed)[0], codes)
    with pytest.raises(ValueError, match="even"):
        fp4.pack_fp4(codes[None, :3])


def test_mxfp4_uses_the_ocp_shared_exponent_rule():
    w = torch.zeros(3, 64)
    w[0, :32] = torch.linspace(-6, 6, 32)       # amax 6: e = floor(log2 6) - 2 = 0
    w[0, 32:] = torch.linspace(-0.7, 0.7, 32)   # amax 0.7: e = -1 - 2 = -3
    w[1, :32] = 1e-3                             # amax 1e-3: e = -10 - 2 = -12
    # row 1's second block and row 2 are zero: e = -127 (byte 0)
    packed, scales = fp4.quantize_mxfp4(w)
    assert scales.tolist() == [[127, 124], [115, 0], [0, 0]]
    deq = fp4.dequantize_mxfp4(packed, scales)
    for r in range(3):
        for b in range(2):
            s = 2.0 ** (int(scales[r, b]) - 127)
            block = w[r, 32 * b:32 * b + 32]
            want = torch.tensor([_nearest_even(float(v) / s) * s for v in block])
            assert torch.equal(deq[r, 32 * b:32 * b + 32], want), (r, b)


def test_nvfp4_scales_follow_modelopt():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(8, 48, generator=g)
    w[3, 16:32] = 0.0  # a zero block
    packed, bscale, gscale = fp4.quantize_nvfp4(w)
    amax = float(w.abs().max())
    assert float(gscale) == pytest.approx(amax / (6 * 448), rel=1e-6)
    want_b = (w.reshape(8, 3, 16).abs().amax(-1) / 6 / gscale).to(torch.float8_e4m3fn)
    assert torch.equal(bscale.float(), want_b.float()) and float(bscale.float()[3, 1]) == 0.0
    deq = fp4.dequantize_nvfp4(packed, bscale, gscale)
    s = (bscale.float() * gscale).repeat_interleave(16, dim=1)
    want = torch.tensor([[_nearest_even(float(v) / float(d)) * float(d) if d > 0 else 0.0
                          for v, d in zip(row_w, row_s)] for row_w, row_s in zip(w, s)])
    err = (deq - want).abs().max()
    print("NVFP4 dequantized vs brute force, max abs diff", float(err))
    assert err <= 1e-6 * amax  # float32: the same products, rounding of the scale product


def test_nvfp4_is_closer_than_mxfp4_on_gaussian_weights():
    g = torch.Generator().manual_seed(2)
    w = torch.randn(256, 512, generator=g) * 0.02
    rel = {}
    p, s = fp4.quantize_mxfp4(w)
    rel["mxfp4"] = float((fp4.dequantize_mxfp4(p, s) - w).norm() / w.norm())
    p, b, gs = fp4.quantize_nvfp4(w)
    rel["nvfp4"] = float((fp4.dequantize_nvfp4(p, b, gs) - w).norm() / w.norm())
    print("relative Frobenius error", rel)
    assert rel["nvfp4"] < 0.9 * rel["mxfp4"]  # measured 0.095 vs 0.114


@pytest.mark.parametrize("bad, match", [
    (torch.randn(4, 40), "multiple of the block size"),
    (torch.full((2, 32), float("nan")), "NaN or infinite"),
    (torch.randn(32), "2-D float"),
])
def test_bad_weights_are_refused(bad, match):
    with pytest.raises(ValueError, match=match):
        fp4.quantize_mxfp4(bad)


@pytest.mark.parametrize("method", ["mxfp4", "modelopt_fp4"])
def test_the_engine_serves_fp4_weights(tiny_model_dir, method):
    from minivllm import LLM, SamplingParams
    from minivllm.layers.linear import QuantLinear

    kw = dict(model=str(tiny_model_dir), dtype="float32", num_gpu_blocks_override=32,
              max_model_len=64)
    llm = LLM(**kw, quantization=method)
    layers = [m for m in llm.llm_engine.model_runner.model.modules()
              if isinstance(m, QuantLinear)]
    assert layers and all(m.method.cfg.method == method for m in layers)
    lin = layers[0]
    # the layer computes with exactly the dequantized stored tensors
    w = lin.method.dequantize(lin.stored_tensors())
    assert torch.equal(lin.dequantized_weight(torch.float32), w)
    out = llm.generate([3, 7, 11], SamplingParams(temperature=0.0, max_tokens=4,
                                                  logprobs=1))[0].outputs[0]
    assert len(out.token_ids) == 4
    assert all(torch.isfinite(torch.tensor(lp[t].logprob)) for lp, t in
               zip(out.logprobs, out.token_ids))


def test_corrupt_fp4_scales_are_refused():
    from minivllm.layers.linear import make_method
    from minivllm.quantization import parse_quantization

    mx = make_method(parse_quantization("mxfp4", None))
    t = mx.quantize(torch.randn(4, 64))
    t["weight_scale"][0, 0] = 255
    with pytest.raises(ValueError, match="255"):
        mx.check_tensors(t, 4, 64)
    nv = make_method(parse_quantization("modelopt_fp4", None))
    t = nv.quantize(torch.randn(4, 64))
    t["weight_scale_2"] = torch.tensor(-1.0)
    with pytest.raises(ValueError, match="weight_scale_2 must be finite and positive"):
        nv.check_tensors(t, 4, 64)


def test_byte_table_decodes_every_byte_like_the_codes():
    """_dequantize_blocks decodes packed bytes through a 256-entry table; it must give
    e2m1_values(unpack_fp4(.)) for every byte, signs of zero included (code 8 is -0.0)."""
    packed = torch.arange(256, dtype=torch.uint8).reshape(8, 32)
    got = fp4._dequantize_blocks(packed, torch.ones(8, 4))
    want = fp4.e2m1_values(fp4.unpack_fp4(packed))
    assert torch.equal(got, want)
    assert torch.equal(torch.signbit(got), torch.signbit(want))
    assert int(torch.signbit(want).sum()) == 256  # half of the 512 codes are >= 8


def _nvfp4_act_brute_force(row: list[float], g: float) -> list[float]:
    """One row, block by block, element by element: the E4M3 block scale (saturating at
    448) from the block's amax, then each element to the nearest E2M1 value."""
    f32 = np.float32
    out = []
    for b in range(0, len(row), 16):
        block = [f32(v) for v in row[b:b + 16]]
        s = float(torch.tensor(min(float(max(abs(v) for v in block) / f32(6) / f32(g)), 448.0))
                  .to(torch.float8_e4m3fn).float())
        d = f32(s) * f32(g)  # float32 arithmetic, as the quantizer computes it
        out += [float(f32(_nearest_even(float(v / d))) * d) if s > 0 else 0.0 for v in block]
    return out


def test_nvfp4_activations_match_a_brute_force_block_quantizer():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, 64, generator=g) * torch.tensor([0.01, 1, 30, 300, 3])[:, None]
    x[1, 16:32] = 0.0                                       # a zero block stays zero
    x[2, 5] = 4000.0                                        # one outlier in a block
    input_scale = fp4.nvfp4_input_scale(x.abs().max())
    got = fp4.fake_quantize_nvfp4_activations(x, input_scale)
    want = torch.tensor([_nvfp4_act_brute_force(r.tolist(), float(input_scale)) for r in x])
    assert got.dtype == torch.float32 and got.shape == x.shape
    assert torch.equal(got, want)
    assert bool((got[1, 16:32] == 0).all())
    # the block's largest element maps to 6 within the E4M3 scale's rounding (3 mantissa bits)
    blk = got[2, :16]
    assert abs(float(blk.abs().max()) - 4000.0) / 4000.0 < 1 / 16 + 1e-6
    # a row quantized alone equals the same row inside the batch (static per-tensor scale)
    assert torch.equal(fp4.fake_quantize_nvfp4_activations(x[3:4], input_scale), got[3:4])
    # leading dimensions are kept
    assert torch.equal(fp4.fake_quantize_nvfp4_activations(x.reshape(5, 1, 64), input_scale),
                       got.reshape(5, 1, 64))


def test_nvfp4_activations_saturate_above_the_calibrated_amax():
    x = torch.full((1, 16), 3.0)
    x[0, 0] = 100.0
    input_scale = fp4.nvfp4_input_scale(10.0)   # calibrated on amax 10, the run sees 100
    got = fp4.fake_quantize_nvfp4_activations(x, input_scale)
    top = 6 * 448 * float(input_scale)          # 10: block scale 448, element 6
    assert torch.isfinite(got).all()
    assert float(got[0, 0]) == pytest.approx(top, rel=1e-6)
    assert float(got.abs().max()) == pytest.approx(top, rel=1e-6)


@pytest.mark.parametrize("x, scale, match", [
    (torch.ones(2, 24), 1.0, "multiple of 16"),
    (torch.tensor([[float("nan")] * 16]), 1.0, "NaN"),
    (torch.ones(2, 16), 0.0, "input_scale"),
    (torch.ones(2, 16), float("inf"), "input_scale"),
])
def test_nvfp4_activation_errors(x, scale, match):
    with pytest.raises(ValueError, match=match):
        fp4.fake_quantize_nvfp4_activations(x, scale)


def test_nvfp4_input_scale_is_amax_over_6_times_448():
    assert float(fp4.nvfp4_input_scale(2688.0)) == 1.0
    with pytest.raises(ValueError, match="amax"):
        fp4.nvfp4_input_scale(0.0)
