"""Chapter 17's fp8 activation-scale delivery fault (faults.input_scale_dropped on the
"fp8.linear" step) and the static-scale rule w8a8.fp8_static_input_scale, on the tiny
random Llama.

The named metric is the mean KL (nats) of the fp8 engine's logits against the float
engine's on the same tokens. The tiny model's activations sit well inside e4m3's normal
range, where a scale of 1.0 loses nothing (a float format has the same relative step at
every magnitude); the embedded SmolLM2 has a massive activation (layer 11's down_proj
input reaches ~2.8k > 448). The tests give the tiny model one too, by an exact
reparametrization: layer 0's up_proj times 2^12, its down_proj times 2^-12 (powers of
two: the float model computes bit for bit the same function, and the calibrated static
scales move with it). Then the fault must raise the KL far above the static engine's;
the engine must be bit-identical to itself once the fault is gone; an engine with
dynamic scales is refused (nothing to drop). What the faulty step computes is written
out independently (``e4m3(clamp(x, ±448))`` times the weight)."""

from __future__ import annotations

import pytest
import torch

from minivllm import LLM
from minivllm.layers.linear import QuantLinear
from minivllm.precision import faults, metrics
from minivllm.quantization import weight_quant as wq
from minivllm.quantization.calibration import calibration_forward, observe_inputs
from minivllm.quantization.quantize import target_layers
from minivllm.quantization.w8a8 import fp8_linear_ref, fp8_static_input_scale

pytestmark = pytest.mark.usefixtures("one_thread")

IDS = [[5 + (7 * i) % 90 for i in range(24)], [3 + (11 * i) % 97 for i in range(17)]]
STATIC = {"activation_scheme": "static", "calibration": "corpus", "calibration_tokens": 256}


C = 2.0 ** 12


def _llm(model_dir, **quant):
    return LLM(str(model_dir), dtype="float32", max_model_len=64,
               num_gpu_blocks_override=16, seed=0, **quant)


@pytest.fixture(scope="module")
def outlier_model_dir(tiny_model_dir, tmp_path_factory):
    """The tiny model with layer 0's MLP reparametrized (up_proj * C, down_proj / C)."""
    import shutil

    from safetensors.torch import load_file, save_file

    out = tmp_path_factory.mktemp("tiny-llama-outlier")
    for f in tiny_model_dir.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, out / f.name)
    for f in tiny_model_dir.glob("*.safetensors"):
        t = load_file(f)
        t["model.layers.0.mlp.up_proj.weight"] = t["model.layers.0.mlp.up_proj.weight"] * C
        t["model.layers.0.mlp.down_proj.weight"] = t["model.layers.0.mlp.down_proj.weight"] / C
        save_file(t, out / f.name, metadata={"format": "pt"})
    return out


@pytest.fixture(scope="module")
def engines(outlier_model_dir):
    ref = _llm(outlier_model_dir)
    static = _llm(outlier_model_dir, quantization="fp8", quantization_config=STATIC)
    want = ref.score(IDS, output="logits")
    return ref, static, want


def test_the_reparametrization_is_exact(engines, tiny_model_dir):
    """The float model is the same function; its down_proj input now passes 448."""
    ref, _, want = engines
    for a, b in zip(_llm(tiny_model_dir).score(IDS, output="logits"), want):
        assert torch.equal(a, b)
    seen = []
    down = ref.llm_engine.model_runner.model.layers[0].mlp.down_proj
    h = down.register_forward_pre_hook(lambda m, a: seen.append(float(a[0].abs().max())))
    ref.score(IDS[0])
    h.remove()
    assert max(seen) > 448.0, seen


def _fp8_layers(llm):
    return {n: m for n, m in llm.llm_engine.model_runner.model.named_modules()
            if isinstance(m, QuantLinear)}


def test_reference_step_is_the_engines_own_path(engines):
    _, static, _ = engines
    own = static.score(IDS, output="logits")
    with static.swap_step("fp8.linear", fp8_linear_ref):
        swapped = static.score(IDS, output="logits")
    for a, b in zip(own, swapped):
        assert torch.equal(a, b)


def test_named_metric_finds_the_dropped_scale(engines):
    _, static, want = engines
    down = _fp8_layers(static)["layers.0.mlp.down_proj"]
    assert float(down.input_scale) > 1.0  # amax > 448: with 1.0 the largest inputs saturate
    clean = static.score(IDS, output="logits")
    kl_static = metrics.mean_kl(torch.cat(want), torch.cat(clean))
    with faults.input_scale_dropped(static):
        kl_dropped = metrics.mean_kl(torch.cat(want), torch.cat(static.score(IDS, output="logits")))
    print(f"mean KL vs float32: static fp8 {kl_static:.3e}, input scale dropped {kl_dropped:.3e}")
    assert kl_static < 1e-2
    assert kl_dropped > 10 * kl_static and kl_dropped > 1e-2
    # the engine without the fault: bit for bit what it was
    for a, b in zip(clean, static.score(IDS, output="logits")):
        assert torch.equal(a, b)


def test_dropped_step_quantizes_with_scale_one():
    """Written out: x rounded to e4m3 directly (saturating at 448), times the weight."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(8, 16, generator=g)
    q_w, w_scale = wq.quantize_fp8_weight(w, "channel")
    x = torch.randn(5, 16, generator=g) * 0.05
    x[0, 3] = 2824.0  # the embedded model's layer-11 outlier: saturates at 448
    bias = torch.randn(8, generator=g)
    got = faults.fp8_linear_input_scale_dropped(x, q_w, w_scale, torch.tensor(0.01), bias)
    xq = x.clamp(-448.0, 448.0).to(torch.float8_e4m3fn).float()
    assert float(xq[0, 3]) == 448.0
    want = (xq @ q_w.float().T) * w_scale.reshape(-1) + bias
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)  # float32, summation order
    # a dynamic layer (no scale to drop) is computed as usual, bit for bit
    assert torch.equal(faults.fp8_linear_input_scale_dropped(x, q_w, w_scale, None, bias),
                       fp8_linear_ref(x, q_w, w_scale, None, bias))


def test_dynamic_through_the_step_is_the_dynamic_engine(engines, outlier_model_dir):
    """x_scale=None through the step of a static engine is the dynamic engine: the
    per-tensor weights do not depend on calibration."""
    _, static, _ = engines
    dynamic = _llm(outlier_model_dir, quantization="fp8")
    with static.swap_step("fp8.linear", lambda x, q, ws, xs, b: fp8_linear_ref(x, q, ws, None, b)):
        via_step = static.score(IDS, output="logits")
    for a, b in zip(dynamic.score(IDS, output="logits"), via_step):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="no input_scale to drop"):
        with faults.input_scale_dropped(dynamic):
            pass


def test_only_named_layers_drop_their_scale(engines):
    _, static, _ = engines
    layers = _fp8_layers(static)
    with faults.input_scale_dropped(static, layers=1):
        assert all(("forward" in vars(m)) == n.startswith("layers.1.") for n, m in layers.items())
    assert not any("forward" in vars(m) for m in layers.values())


def test_bad_arguments_are_refused(engines):
    ref, static, _ = engines
    with pytest.raises(ValueError, match="no fp8 linear layer"):
        with faults.input_scale_dropped(ref):
            pass
    with pytest.raises(ValueError, match="needs an engine built with quantization='fp8'"):
        with ref.swap_step("fp8.linear", fp8_linear_ref):
            pass
    with pytest.raises(ValueError, match="layers must be indices"):
        with faults.input_scale_dropped(static, layers=7):
            pass
    with pytest.raises(TypeError, match="planted into an LLM"):
        with faults.input_scale_dropped(static.llm_engine):
            pass


def test_static_scale_rule_is_the_engines(engines, tiny_model_dir):
    """fp8_static_input_scale(amax) is the input_scale the engine stores, amax observed
    by the same calibration pass (the engine's own tokens: STATIC's corpus set)."""
    from minivllm.quantization.calibration import calibration_sequences

    ref, static, _ = engines
    model = ref.llm_engine.model_runner.model
    seqs = calibration_sequences(ref.get_tokenizer(), "corpus", 256, 64)
    with observe_inputs(target_layers(model)) as obs:
        calibration_forward(model, seqs)
    layers = _fp8_layers(static)
    for name, o in obs.items():
        assert torch.equal(fp8_static_input_scale(o.amax), layers[name].input_scale), name


def test_static_scale_rule():
    got = fp8_static_input_scale(torch.tensor([1.0, 896.0, 3.0]), headroom=2.0)
    assert got.dtype == torch.float32 and got.shape == ()
    assert float(got) == 4.0  # 896 * 2 / 448
    assert float(fp8_static_input_scale(0.0)) == 1.0  # only zeros seen: never 0
    assert float(fp8_static_input_scale(448.0)) == 1.0
    x = torch.tensor([2824.0, -3.0])  # the calibrated maximum lands on 448, not past it
    s = fp8_static_input_scale(x.abs())
    q, _ = wq.quantize_fp8_activation(x, s)
    assert float(q.float()[0]) == 448.0
    for bad in (torch.tensor([1.0, float("nan")]), torch.tensor([-1.0]), torch.tensor([]),
                float("inf")):
        with pytest.raises(ValueError, match="amax must be finite"):
            fp8_static_input_scale(bad)
    for bad in (0.5, float("inf"), True, "2"):
        with pytest.raises(ValueError, match="headroom"):
            fp8_static_input_scale(1.0, headroom=bad)
