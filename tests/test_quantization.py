"""Weight quantization in the engine (tiny random Llama): storage, bytes, the forward pass
against the dequantized weight, GPTQ against RTN on the engine's own calibration data,
bfloat16 engines, and the saved-checkpoint format."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from minivllm import LLM
from minivllm.layers.linear import QuantLinear
from minivllm.quantization import weight_quant as wq
from minivllm.quantization.calibration import calibration_forward, observe_inputs
from minivllm.quantization.quantize import target_layers

CALIB = {"calibration": "corpus", "calibration_tokens": 512}
CASES = {
    "int8-tensor": ("int8", {"granularity": "tensor"}),
    "int8-channel": ("int8", {}),
    "int4-sym-g32": ("int4", {"group_size": 32}),
    "int4-asym-g64": ("int4", {"group_size": 64, "symmetric": False}),
    "awq": ("awq", {"group_size": 32, **CALIB}),
    "gptq": ("gptq", {"group_size": 32, "act_order": True, **CALIB}),
    "fp8-dynamic": ("fp8", {"granularity": "channel"}),
    "fp8-static": ("fp8", {"activation_scheme": "static", **CALIB}),
}
IDS = [list(range(3, 60)), list(range(100, 130))]


def build(model_dir, name, **kw):
    method, opts = CASES[name]
    kw.setdefault("dtype", "float32")
    return LLM(str(model_dir), max_model_len=128, quantization=method,
               quantization_config=opts, **kw)


@pytest.fixture(scope="module")
def float_llm(tiny_model_dir):
    return LLM(str(tiny_model_dir), dtype="float32", max_model_len=128)


@pytest.fixture(scope="module")
def ref_rows(float_llm):
    return float_llm.score(IDS)


def expected_bytes(method: str, opts: dict, out: int, inp: int) -> int:
    """Stored bytes of one layer, from the format's definition (checkpoint.py)."""
    if method == "int8":
        return out * inp + 4 * (1 if opts.get("granularity") == "tensor" else out)
    if method == "fp8":
        scale = 4 * (out if opts.get("granularity") == "channel" else 1)
        return out * inp + scale + (4 if opts.get("activation_scheme") == "static" else 0)
    groups = -(-inp // opts["group_size"])
    awq = 4 * inp if method == "awq" else 0
    return out * inp // 2 + out * groups * (4 + 1) + awq


@pytest.mark.parametrize("name", list(CASES))
def test_quantized_engine_layers_bytes_and_forward(tiny_model_dir, one_thread, ref_rows, name):
    method, opts = CASES[name]
    llm = build(tiny_model_dir, name)
    model = llm.llm_engine.model_runner.model
    layers = target_layers(model)
    assert all(isinstance(m, QuantLinear) for m in layers.values())
    total = 0
    for m in layers.values():
        q = m.qweight
        want_dtype = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}.get(method, torch.uint8)
        assert q.dtype == want_dtype
        assert q.shape[1] == (m.in_features // 2 if want_dtype == torch.uint8 else m.in_features)
        total += expected_bytes(method, opts, m.out_features, m.in_features)
    wb = llm.weight_bytes()
    assert wb["linear"] == total, (wb, total)
    # the layer computes exactly F.linear on its dequantized weight (weight-only methods)
    lin = layers["layers.1.mlp.down_proj"]
    x = torch.randn(4, lin.in_features, generator=torch.Generator().manual_seed(0))
    if method != "fp8":
        w = lin.method.dequantize(lin.stored_tensors())
        xs = x / lin.awq_scale if lin.awq_scale is not None else x
        torch.testing.assert_close(lin(x), F.linear(xs, w), rtol=0, atol=0)
    else:
        y = wq.fp8_linear(x, lin.qweight, lin.weight_scale, lin.input_scale)
        torch.testing.assert_close(lin(x), y, rtol=0, atol=0)
    rows = llm.score(IDS)
    for ref, got in zip(ref_rows, rows):
        kl = float((ref.exp() * (ref - got)).sum(-1).mean())
        assert torch.isfinite(got).all() and 0 < kl < 1.0, f"{name}: KL vs float32 = {kl:.3e}"


def test_gptq_beats_rtn_on_the_engines_calibration_batch(tiny_model_dir, one_thread, float_llm):
    """Layer 0 sees float inputs in GPTQ's layer-by-layer pass, so its calibration error
    can be measured on the float model's activations of the same calibration sequences."""
    gptq = build(tiny_model_dir, "gptq")
    calib = gptq.llm_engine.calibration_sequences("corpus", 512)
    float_layers = target_layers(float_llm.llm_engine.model_runner.model)
    names = [n for n in float_layers if n.startswith("layers.0.")]
    with observe_inputs({n: float_layers[n] for n in names}, max_rows=10_000) as obs:
        calibration_forward(float_llm.llm_engine.model_runner.model, calib)
    q_layers = target_layers(gptq.llm_engine.model_runner.model)
    for n in names:
        x, w = obs[n].sample, float_layers[n].weight.detach()
        assert x.shape[0] == sum(map(len, calib))
        w_gptq = q_layers[n].method.dequantize(q_layers[n].stored_tensors())
        w_rtn = wq.dequantize_int4(*wq.quantize_int4(w, 32, True), 32)
        err = lambda wh: float((x @ w.T - x @ wh.T).norm())  # noqa: E731
        assert err(w_gptq) < 0.9 * err(w_rtn), f"{n}: GPTQ {err(w_gptq):.4f} vs RTN {err(w_rtn):.4f}"


def test_bfloat16_engine_keeps_quantized_storage(tiny_model_dir, one_thread):
    llm = build(tiny_model_dir, "fp8-static", dtype="bfloat16")
    lin = target_layers(llm.llm_engine.model_runner.model)["layers.0.self_attn.qkv_proj"]
    assert lin.qweight.dtype == torch.float8_e4m3fn
    assert lin.weight_scale.dtype == lin.input_scale.dtype == torch.float32
    llm4 = build(tiny_model_dir, "int4-sym-g32", dtype="bfloat16")
    lin4 = target_layers(llm4.llm_engine.model_runner.model)["layers.0.mlp.gate_up_proj"]
    assert lin4.scales.dtype == torch.float32 and lin4.zeros.dtype == torch.uint8
    assert lin4.dequantized_weight(torch.bfloat16).dtype == torch.bfloat16
    assert llm4.llm_engine.model_runner.model.norm.weight.dtype == torch.bfloat16
    # quantized from the float32 checkpoint: the same codes as a float32 engine
    f32 = target_layers(build(tiny_model_dir, "int4-sym-g32").llm_engine.model_runner.model)
    assert torch.equal(lin4.qweight, f32["layers.0.mlp.gate_up_proj"].qweight)


@pytest.mark.parametrize("name", ["gptq", "awq", "fp8-static", "int8-tensor"])
def test_save_and_load_round_trip(tiny_model_dir, tmp_path, one_thread, name):
    llm = build(tiny_model_dir, name)
    out = llm.save_quantized(tmp_path / "q")
    cfg = json.loads((out / "config.json").read_text())
    qc = cfg["quantization_config"]
    assert qc["quant_method"] == "minivllm" and qc["format_version"] == 1
    assert qc["method"] == CASES[name][0] and (out / "tokenizer.json").is_file()
    from safetensors import safe_open

    with safe_open(str(out / "model.safetensors"), framework="pt") as st:
        keys = set(st.keys())
    assert "model.layers.0.self_attn.qkv_proj.qweight" in keys
    assert not any(k.endswith("qkv_proj.weight") or ".q_proj." in k for k in keys)
    loaded = LLM(str(out), dtype="float32", max_model_len=128)  # no quantization= needed
    assert loaded.llm_engine.quant_config == llm.llm_engine.quant_config
    for a, b in zip(llm.score(IDS), loaded.score(IDS)):
        assert torch.equal(a, b)
    assert loaded.weight_bytes() == llm.weight_bytes()
    with pytest.raises(ValueError, match="cannot re-quantize"):
        LLM(str(out), dtype="float32", max_model_len=128, quantization="int4")
    with pytest.raises(ValueError, match="already holds files"):
        llm.save_quantized(out)


def test_unquantized_save_and_foreign_checkpoints_are_refused(tiny_model_dir, tmp_path, float_llm):
    with pytest.raises(ValueError, match="needs an engine built with quantization"):
        float_llm.save_quantized(tmp_path / "x")
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    for f in tiny_model_dir.iterdir():
        (foreign / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((foreign / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    (foreign / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="quant_method='gptq'"):
        LLM(str(foreign), dtype="float32", max_model_len=64)


def _tamper(folder, edit):
    from safetensors.torch import load_file, save_file

    t = load_file(str(folder / "model.safetensors"))
    edit(t)
    save_file(t, str(folder / "model.safetensors"))


@pytest.mark.parametrize("name,edit,pattern", [
    ("awq", lambda t: t.pop("model.layers.0.mlp.down_proj.awq_scale"),
     r"layers.0.mlp.down_proj: expected tensors \['awq_scale', 'qweight', 'scales', 'zeros'\]"),
    ("fp8-static", lambda t: t.pop("model.layers.1.self_attn.o_proj.input_scale"),
     r"expected tensors \['input_scale', 'qweight', 'weight_scale'\]"),
    ("int8-tensor", lambda t: t.update({"model.layers.0.mlp.down_proj.awq_scale": torch.ones(128)}),
     r"expected tensors \['qweight', 'weight_scale'\]"),
    ("gptq", lambda t: t["model.layers.0.mlp.down_proj.zeros"].fill_(16), r"zeros must be int4"),
    ("gptq", lambda t: t["model.layers.0.mlp.down_proj.scales"].mul_(-1),
     r"scales must be finite and positive"),
    ("int8-channel", lambda t: t.update({"model.layers.0.mlp.down_proj.qweight":
                                         torch.zeros(64, 64, dtype=torch.int8)}),
     r"qweight must be torch.int8 of shape"),
])
def test_tampered_checkpoints_are_refused(tiny_model_dir, tmp_path, one_thread, name, edit, pattern):
    out = build(tiny_model_dir, name).save_quantized(tmp_path / "q")
    _tamper(out, edit)
    with pytest.raises(ValueError, match=pattern):
        LLM(str(out), dtype="float32", max_model_len=128)


def test_save_paths_and_saved_dtype(tiny_model_dir, tmp_path, one_thread):
    llm = build(tiny_model_dir, "int8-channel", dtype="bfloat16")
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="is a file"):
        llm.save_quantized(tmp_path / "file")
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "model.safetensors").write_text("x")
    with pytest.raises(ValueError, match="already holds files"):
        llm.save_quantized(tmp_path / "busy")
    with pytest.raises(ValueError, match="needs a folder path"):
        llm.save_quantized("")
    out = llm.save_quantized(tmp_path / "bf16")
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    back = LLM(str(out), max_model_len=128)  # auto: the saved bfloat16
    assert back.llm_engine.model_config.dtype == torch.bfloat16
    for a, b in zip(llm.score(IDS), back.score(IDS)):
        assert torch.equal(a, b)
