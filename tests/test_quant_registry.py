"""vLLM-style quantization config (tiny random Llama): the ``ignore`` list (llm-compressor's
convention: module names, "re:" patterns, checkpoint shard names of fused layers) and
methods registered by name (``register_quantization_method``, vLLM's
``register_quantization_config`` idea).

Expected values come from the float engine and from the definitions (which layer each
entry names), never from the code under test. Equality checks are bitwise (float32)."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

import minivllm.quantization as Q
from minivllm import LLM
from minivllm.layers.linear import Linear, LinearMethod, QuantLinear
from minivllm.quantization.quantize import target_layers

IDS = [list(range(3, 60)), list(range(100, 130))]


def make(model_dir, method=None, opts=None):
    return LLM(str(model_dir), dtype="float32", max_model_len=128, quantization=method,
               quantization_config=opts)


def layers(llm) -> dict:
    return target_layers(llm.llm_engine.model_runner.model)


@pytest.fixture(scope="module")
def float_llm(tiny_model_dir):
    return make(tiny_model_dir)


@pytest.fixture()
def registry():
    """The registry as it was before the test, restored after it."""
    saved = dict(Q._REGISTERED)
    yield Q._REGISTERED
    Q._REGISTERED.clear()
    Q._REGISTERED.update(saved)


# --- ignore ---------------------------------------------------------------------------

# ignore entry -> the fused layers (tiny model: layers 0 and 1) it must leave float
IGNORE_CASES = {
    "exact name": (["layers.0.mlp.down_proj"], {"layers.0.mlp.down_proj"}),
    "HF spelling": (["model.layers.1.self_attn.o_proj"], {"layers.1.self_attn.o_proj"}),
    "regex": (["re:layers\\.1\\.mlp\\..*"], {"layers.1.mlp.gate_up_proj", "layers.1.mlp.down_proj"}),
    "regex on the HF spelling, anchored at the start only": (
        ["re:model\\.layers\\.0\\.self_attn"], {"layers.0.self_attn.qkv_proj",
                                                "layers.0.self_attn.o_proj"}),
    "all shards of qkv": (["model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj",
                           "model.layers.0.self_attn.v_proj"], {"layers.0.self_attn.qkv_proj"}),
    "shards of gate_up by a regex": (["re:.*\\.(gate|up)_proj$"],
                                     {"layers.0.mlp.gate_up_proj", "layers.1.mlp.gate_up_proj"}),
    "lm_head and embeddings (llm-compressor's usual entries) change nothing": (
        ["lm_head", "model.embed_tokens"], set()),
}


@pytest.mark.parametrize("case", list(IGNORE_CASES))
def test_ignored_layers_stay_float_and_bit_equal(tiny_model_dir, float_llm, one_thread, case):
    ignore, want = IGNORE_CASES[case]
    llm = make(tiny_model_dir, "int8", {"granularity": "tensor", "ignore": ignore})
    ref, got = layers(float_llm), layers(llm)
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(1))
    for name, module in got.items():
        if name in want:
            assert type(module) is Linear, f"{name} should stay float, is {type(module).__name__}"
            assert torch.equal(module.weight, ref[name].weight), name
            if module.in_features == 64:
                assert torch.equal(module(x), ref[name](x)), name
        else:
            assert isinstance(module, QuantLinear), f"{name} should be quantized"
    assert llm.llm_engine.quant_config.ignore == tuple(ignore)


def test_ignoring_every_layer_gives_the_float_engine_bit_for_bit(tiny_model_dir, float_llm,
                                                                 one_thread):
    llm = make(tiny_model_dir, "int4", {"group_size": 32, "ignore": ["re:.*"]})
    assert not any(isinstance(m, QuantLinear) for m in layers(llm).values())
    for a, b in zip(float_llm.score(IDS), llm.score(IDS)):
        assert torch.equal(a, b)
    # and the quantized layers really change the output (the check discriminates)
    part = make(tiny_model_dir, "int4", {"group_size": 32, "ignore": ["re:layers\\.0\\."]})
    diff = max(float((a - b).abs().max()) for a, b in zip(float_llm.score(IDS), part.score(IDS)))
    print(f"int4 g32 on layer 1 only: max |dlogprob| {diff:.3g}")
    assert diff > 1e-4


@pytest.mark.parametrize("ignore, match", [
    ("layers.0.mlp.down_proj", "must be a list"),
    ([""], "non-empty strings"),
    ([3], "non-empty strings"),
    (["re:layers\\.(0"], "not a valid regular expression"),
])
def test_bad_ignore_values_are_refused_before_loading(tiny_model_dir, ignore, match):
    with pytest.raises(ValueError, match=match):
        make(tiny_model_dir, "int8", {"ignore": ignore})


def test_ignore_entries_must_name_modules_and_whole_fused_layers(tiny_model_dir):
    with pytest.raises(ValueError, match=r"\['layers.0.mlp.dwon_proj'\] match no module"):
        make(tiny_model_dir, "int8", {"ignore": ["layers.0.mlp.down_proj",
                                                 "layers.0.mlp.dwon_proj"]})
    with pytest.raises(ValueError, match="match no module"):
        make(tiny_model_dir, "int8", {"ignore": ["re:.*layers\\.7\\."]})   # 2 layers only
    with pytest.raises(ValueError, match="not all shards of the fused layer "
                                         "layers.0.self_attn.qkv_proj"):
        make(tiny_model_dir, "int8", {"ignore": ["model.layers.0.self_attn.q_proj"]})


def test_save_and_load_keep_the_ignored_layers_float(tiny_model_dir, tmp_path, one_thread):
    opts = {"granularity": "channel", "ignore": ["re:.*down_proj"]}
    llm = make(tiny_model_dir, "int8", opts)
    out = llm.save_quantized(tmp_path / "q")
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["options"]["ignore"] == ["re:.*down_proj"]
    loaded = LLM(str(out), dtype="float32", max_model_len=128)
    assert loaded.llm_engine.quant_config == llm.llm_engine.quant_config
    assert type(layers(loaded)["layers.1.mlp.down_proj"]) is Linear
    assert isinstance(layers(loaded)["layers.1.mlp.gate_up_proj"], QuantLinear)
    for a, b in zip(llm.score(IDS), loaded.score(IDS)):
        assert torch.equal(a, b)


# --- registration ------------------------------------------------------------------------

class Int6Rows(LinearMethod):
    """A test method: symmetric 6-bit codes (|q| <= 31) in int8 storage, one scale per
    output row (per tensor with granularity="tensor"); ``cfg.option("qmax")`` overrides 31."""

    def qmax(self):
        return self.cfg.option("qmax")

    def quantize(self, weight, stats=None):
        amax = weight.abs().amax() if self.cfg.granularity == "tensor" \
            else weight.abs().amax(dim=1, keepdim=True)
        scale = torch.where(amax > 0, amax / self.qmax(), torch.ones_like(amax))
        q = torch.round(weight / scale).clamp(-self.qmax(), self.qmax()).to(torch.int8)
        return {"qweight": q, "weight_scale": scale.float()}

    def dequantize(self, t):
        return t["qweight"].float() * t["weight_scale"]

    def expected(self, out_features, in_features):
        scale = () if self.cfg.granularity == "tensor" else (out_features, 1)
        return {"qweight": (torch.int8, (out_features, in_features)),
                "weight_scale": (torch.float32, scale)}


def test_a_registered_method_runs_in_the_engine(tiny_model_dir, float_llm, registry, one_thread):
    Q.register_quantization_method("int6_rows", Int6Rows,
                                   options={"granularity": "channel", "qmax": 31})
    assert "int6_rows" in Q.quantization_methods()
    llm = make(tiny_model_dir, "int6_rows", {"ignore": ["layers.0.mlp.down_proj"]})
    got, ref = layers(llm), layers(float_llm)
    assert type(got["layers.0.mlp.down_proj"]) is Linear
    lin = got["layers.1.mlp.down_proj"]
    assert isinstance(lin, QuantLinear) and isinstance(lin.method, Int6Rows)
    w = ref["layers.1.mlp.down_proj"].weight
    scale = w.abs().amax(dim=1, keepdim=True) / 31            # the definition, computed here
    assert torch.equal(lin.weight_scale, scale)
    assert int(lin.qweight.abs().max()) == 31
    x = torch.randn(3, lin.in_features, generator=torch.Generator().manual_seed(2))
    assert torch.equal(lin(x), F.linear(x, lin.qweight.float() * scale))
    cfg = llm.llm_engine.quant_config
    assert cfg.option("qmax") == 31 and cfg.granularity == "channel"
    assert cfg.options() == {"granularity": "channel", "qmax": 31,
                             "ignore": ["layers.0.mlp.down_proj"]}
    # options reach the method; a registered option named like a field is validated as one
    coarse = make(tiny_model_dir, "int6_rows", {"granularity": "tensor", "qmax": 7})
    assert layers(coarse)["layers.1.mlp.down_proj"].weight_scale.shape == ()
    assert int(layers(coarse)["layers.1.mlp.down_proj"].qweight.abs().max()) == 7
    with pytest.raises(ValueError, match="granularity.*'tensor' or 'channel'"):
        make(tiny_model_dir, "int6_rows", {"granularity": "row"})
    with pytest.raises(ValueError, match=r"Unknown quantization_config option\(s\) \['bits'\]"):
        make(tiny_model_dir, "int6_rows", {"bits": 6})


def test_save_and_load_a_registered_method(tiny_model_dir, tmp_path, registry, one_thread):
    Q.register_quantization_method("int6_rows", Int6Rows,
                                   options={"granularity": "channel", "qmax": 31})
    llm = make(tiny_model_dir, "int6_rows")
    out = llm.save_quantized(tmp_path / "q")
    loaded = LLM(str(out), dtype="float32", max_model_len=128)
    for a, b in zip(llm.score(IDS), loaded.score(IDS)):
        assert torch.equal(a, b)
    del registry["int6_rows"]       # a fresh process that never registered it
    with pytest.raises(ValueError, match="Unknown quantization 'int6_rows'"):
        LLM(str(out), dtype="float32", max_model_len=128)


def test_unknown_method_lists_the_registered_ones(tiny_model_dir, registry):
    with pytest.raises(ValueError, match="none registered"):
        make(tiny_model_dir, "int6_rows")
    Q.register_quantization_method("int6_rows", Int6Rows, options={"granularity": "channel",
                                                                    "qmax": 31})

    @Q.register_quantization_method("int6_rows_b", options={"granularity": "tensor", "qmax": 31})
    class Other(Int6Rows):
        pass

    with pytest.raises(ValueError) as e:
        make(tiny_model_dir, "int5")
    msg = str(e.value)
    print(msg)
    assert "Unknown quantization 'int5'" in msg
    for name in ("int8", "int4", "awq", "gptq", "fp8", "int6_rows", "int6_rows_b"):
        assert name in msg


def test_registration_refuses_what_it_cannot_serve(registry):
    with pytest.raises(ValueError, match="'int8' is a built-in"):
        Q.register_quantization_method("int8", Int6Rows)
    with pytest.raises(TypeError, match="subclass of minivllm.layers.linear.LinearMethod"):
        Q.register_quantization_method("plain", object)
    with pytest.raises(ValueError, match="non-empty string"):
        Q.register_quantization_method("", Int6Rows)
    with pytest.raises(ValueError, match="other than 'ignore'"):
        Q.register_quantization_method("x", Int6Rows, options={"ignore": []})
    with pytest.raises(ValueError, match="group_size"):
        Q.register_quantization_method("x", Int6Rows, options={"group_size": 100})
    Q.register_quantization_method("int6_rows", Int6Rows, options={"qmax": 31})
    with pytest.raises(ValueError, match="already registered.*replace=True"):
        Q.register_quantization_method("int6_rows", Int6Rows)
    Q.register_quantization_method("int6_rows", Int6Rows, options={"qmax": 15}, replace=True)
    assert Q.parse_quantization("int6_rows", None).option("qmax") == 15


# --- registered methods that calibrate --------------------------------------------------

class _SeenAWQ(LinearMethod):
    """AWQ's scale search on the calibration rows it is given, then RTN of W * s; the
    layer computes x @ (deq / s)^T. Records what each call received."""

    seen: list = []

    def quantize(self, weight, stats=None):
        from minivllm.quantization import weight_quant as wq

        type(self).seen.append(None if stats is None else tuple(stats.sample.shape))
        s, _ = wq.awq_search_scale([weight], stats.sample, 32, False, n_grid=4)
        q, scale, zero = wq.quantize_int4(weight * s, 32, False)
        return {"qweight": q, "scales": scale, "zeros": zero, "awq_scale": s}

    def dequantize(self, t):
        from minivllm.quantization import weight_quant as wq

        return wq.dequantize_int4(t["qweight"], t["scales"], t["zeros"], 32) / t["awq_scale"]

    def expected(self, out_features, in_features):
        g = -(-in_features // 32)
        return {"qweight": (torch.uint8, (out_features, in_features)),
                "scales": (torch.float32, (out_features, g)),
                "zeros": (torch.uint8, (out_features, g)),
                "awq_scale": (torch.float32, (in_features,))}


def test_a_calibrated_registered_method_gets_input_rows_layer_by_layer(tiny_model_dir, registry,
                                                                       float_llm, one_thread):
    from minivllm.precision import metrics

    calib = {"calibration": "corpus", "calibration_tokens": 64}
    opts = {"group_size": 32, "symmetric": False}  # check_tensors reads these
    Q.register_quantization_method("seen_awq", _SeenAWQ, options=opts, calibrated=True)
    _SeenAWQ.seen = []
    llm = make(tiny_model_dir, "seen_awq", calib)
    n_layers = len(layers(llm))
    hidden = layers(float_llm)["layers.0.mlp.down_proj"].in_features
    # every quantized layer got the 64 calibration rows of its own input
    assert len(_SeenAWQ.seen) == n_layers and (64, hidden) in _SeenAWQ.seen
    assert all(s[0] == 64 for s in _SeenAWQ.seen)
    assert llm.llm_engine.quant_config.options()["calibration_tokens"] == 64
    kl = torch.cat([metrics.kl_divergence(a, b)
                    for a, b in zip(float_llm.score(IDS), llm.score(IDS))]).mean()
    assert torch.isfinite(kl) and kl > 0
    # without calibrated=True the method gets None, and calibration options are refused
    Q.register_quantization_method("seen_awq", _SeenAWQ, options=opts, replace=True)
    with pytest.raises(ValueError, match="Unknown quantization_config option"):
        make(tiny_model_dir, "seen_awq", calib)
    with pytest.raises(ValueError, match="calibrated must be True or False"):
        Q.register_quantization_method("other", _SeenAWQ, calibrated="yes")
