"""Chapter 18's KV-scale delivery fault (faults.kv_scale_dropped, TensorRT-LLM PR #16916)
and the calibration reference kv_scales_from_amax, on the tiny random Llama.

The named metric is the mean KL (nats) of the fp8 engine's logits against the float32-KV
engine's on the same tokens: the fault must raise it far above the calibrated engine's,
on either side; with scales of 1.0 it must change nothing (bit-identical logits). The
expected effect of a dropped scale is written out independently: the stored values come
back multiplied by 1 / s (read side) or s (write side)."""

from __future__ import annotations

import pytest
import torch

from minivllm import LLM
from minivllm.precision import faults, metrics
from minivllm.quantization.kv_cache import (dequantize_kv, kv_scales_from_amax, qmax,
                                            quantize_kv)

pytestmark = pytest.mark.usefixtures("one_thread")

IDS = [5 + (7 * i) % 90 for i in range(20)]
CALIB = [[3 + (11 * i) % 97 for i in range(32)]]


def _llm(tiny_model_dir, kv="fp8_e4m3"):
    return LLM(str(tiny_model_dir), dtype="float32", kv_cache_dtype=kv, max_model_len=48,
               num_gpu_blocks_override=16, seed=0)


@pytest.fixture(scope="module")
def engines(tiny_model_dir):
    ref = _llm(tiny_model_dir, "float32")
    fp8 = _llm(tiny_model_dir)
    want = ref.score(IDS, output="logits")
    return ref, fp8, want


def test_fault_changes_nothing_with_scales_of_one(engines):
    _, fp8, _ = engines
    for c in fp8.llm_engine.model_runner.kv_caches:
        c.set_scales(torch.tensor(1.0), torch.tensor(1.0))
    clean = fp8.score(IDS, output="logits")
    for side in ("read", "write"):
        with faults.kv_scale_dropped(fp8, side):
            assert torch.equal(fp8.score(IDS, output="logits"), clean), side


def test_named_metric_finds_a_dropped_scale_on_either_side(engines):
    _, fp8, want = engines
    scales = fp8.llm_engine.calibrate_kv_scales(CALIB)
    k = torch.tensor(scales["k_scale"])
    assert bool((k < 0.1).all()), k  # tiny random K: far from 1.0, so the fault must bite
    calibrated = metrics.mean_kl(want, fp8.score(IDS, output="logits"))
    kls = {}
    for side in ("read", "write"):
        with faults.kv_scale_dropped(fp8, side):
            kls[side] = metrics.mean_kl(want, fp8.score(IDS, output="logits"))
    print(f"mean KL vs float32 KV: calibrated {calibrated:.3e}, read side dropped "
          f"{kls['read']:.3e}, write side dropped {kls['write']:.3e}")
    assert calibrated < 1e-2
    for side, kl in kls.items():
        assert kl > 100 * calibrated and kl > 1e-2, (side, kl, calibrated)
    # restored on exit
    assert metrics.mean_kl(want, fp8.score(IDS, output="logits")) == pytest.approx(calibrated,
                                                                                   rel=1e-6)


def test_dropped_scale_multiplies_the_stored_values(engines):
    """One layer's cache, written and read through the faulty steps: what comes back is
    the right read times 1/s (read side) or s (write side), written out by hand."""
    _, fp8, _ = engines
    s = torch.tensor(0.02)
    x = torch.randn(6, 2, 16) * 3
    stored = quantize_kv(x, torch.float8_e4m3fn, s)
    good = dequantize_kv(stored, torch.float32, s)
    read_dropped = faults.dequantize_kv_scale_dropped(stored, torch.float32, s)
    torch.testing.assert_close(read_dropped, good / s, rtol=1e-6, atol=0)
    written = faults.quantize_kv_scale_dropped(x, torch.float8_e4m3fn, s)
    back = dequantize_kv(written, torch.float32, s)
    # stored without the scale: x rounded to e4m3 directly (no saturation: |x| << 448)
    torch.testing.assert_close(back, x.to(torch.float8_e4m3fn).float() * s, rtol=0, atol=0)


def test_only_named_layers_drop_their_scale(engines):
    _, fp8, _ = engines
    fp8.llm_engine.calibrate_kv_scales(CALIB)
    caches = fp8.llm_engine.model_runner.kv_caches
    with faults.kv_scale_dropped(fp8, "read", layers=1):
        assert caches[1].dequantize is faults.dequantize_kv_scale_dropped
        assert caches[0].dequantize is dequantize_kv
    assert caches[1].dequantize is dequantize_kv


def test_bad_arguments_are_refused(engines, tiny_model_dir):
    ref, fp8, _ = engines
    with pytest.raises(ValueError, match="side must be one of"):
        with faults.kv_scale_dropped(fp8, "both"):
            pass
    with pytest.raises(ValueError, match="quantized KV cache"):
        with faults.kv_scale_dropped(ref, "read"):
            pass
    with pytest.raises(ValueError, match="layers must be indices"):
        with faults.kv_scale_dropped(fp8, "read", layers=7):
            pass
    with pytest.raises(TypeError, match="planted into an LLM"):
        with faults.kv_scale_dropped(fp8.llm_engine, "read"):
            pass


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2, torch.int8])
def test_kv_scales_from_amax(dtype):
    m = qmax(dtype)
    amax = torch.tensor([0.0, 1.5, 21.2, 1e-3])
    got = kv_scales_from_amax(amax, m)
    assert got.dtype == torch.float32 and got.shape == amax.shape
    assert got[0] == 1.0  # nothing stored: scale 1, never 0
    torch.testing.assert_close(got[1:] * m, amax[1:], rtol=1e-6, atol=0)
    # the calibrated maximum lands on the format's largest value, without saturating past it
    x = amax[1:, None] * torch.tensor([1.0, -1.0, 0.5])
    back = dequantize_kv(quantize_kv(x, dtype, got[1:, None]), torch.float32, got[1:, None])
    assert bool((back.abs().amax(dim=1) <= amax[1:] * (1 + 1e-6)).all())
    torch.testing.assert_close(back[:, 0], amax[1:], rtol=1e-6, atol=0)


def test_kv_scales_from_amax_refuses_bad_input():
    with pytest.raises(ValueError, match="qmax_value"):
        kv_scales_from_amax(torch.tensor(1.0), 0.0)
    with pytest.raises(ValueError, match="amax must be finite"):
        kv_scales_from_amax(torch.tensor([1.0, float("nan")]), 448.0)
    with pytest.raises(ValueError, match="amax must be finite"):
        kv_scales_from_amax(torch.tensor([-1.0]), 448.0)
