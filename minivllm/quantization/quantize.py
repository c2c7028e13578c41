"""Quantize a loaded float model in place: calibrate, then swap each decoder linear layer
for a :class:`~minivllm.layers.linear.QuantLinear`.

Calibration:

* awq and gptq go layer by layer, as the GPTQ reference (``llama_sequential``) and AutoAWQ
  do: the calibration sequences' hidden states enter decoder layer l, its four linear
  layers' inputs are observed, the layer is quantized, and the *quantized* layer's output
  becomes layer l+1's input. Each layer is thus fitted to the inputs it will see when the
  layers below it are quantized too. (A one-pass variant that observes the float model
  only was measured here first; its GPTQ was worse than round-to-nearest end to end:
  the error it pushes into directions the float activations leave empty is exactly
  where the quantized model's activations then go.)
* fp8 with static activation scales needs only amax, from one pass of the float model.
"""

from __future__ import annotations

import logging
from typing import Optional

import torch
from tqdm.auto import tqdm

from minivllm.layers.linear import Linear, QuantLinear, make_method
from minivllm.quantization import QuantConfig
from minivllm.quantization.calibration import calibration_forward, layer_forward, observe_inputs

logger = logging.getLogger("minivllm")
TARGETS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")
AWQ_SAMPLE_ROWS = 512  # input rows kept per layer for AWQ's scale and clip searches


def target_layers(model) -> dict[str, Linear]:
    """``{"layers.0.self_attn.qkv_proj": module, ...}`` for every decoder linear."""
    out = {}
    for i, layer in enumerate(model.layers):
        for t in TARGETS:
            parent, _, attr = t.partition(".")
            out[f"layers.{i}.{t}"] = getattr(getattr(layer, parent), attr)
    return out


def _replace(model, name: str, new) -> None:
    parent_name, _, attr = name.rpartition(".")
    setattr(model.get_submodule(parent_name), attr, new)


@torch.inference_mode()
def quantize_model(model, cfg: QuantConfig, calibration_ids: Optional[list[list[int]]] = None,
                   device="cpu", progress: bool = True) -> None:
    """Quantize every decoder linear layer of ``model`` (float32 weights) in place.

    Args:
        model: our LlamaForCausalLM, weights loaded, rotary tables set.
        cfg: the method and options.
        calibration_ids: token sequences for calibrated methods (ignored otherwise).
    Raises:
        ValueError: a calibrated method without calibration sequences.
    """
    method = make_method(cfg)
    if cfg.needs_calibration and not calibration_ids:
        raise ValueError(f"quantization={cfg.method!r} needs calibration sequences")
    targets = target_layers(model)
    bar = tqdm(total=len(targets), desc=f"quantizing ({cfg.label()})", unit="layer",
               disable=not progress)
    if cfg.method in ("awq", "gptq"):
        hidden = [model.embed_tokens(torch.tensor(ids, device=device)) for ids in calibration_ids]
        for i, layer in enumerate(model.layers):
            names = {n: m for n, m in targets.items() if n.startswith(f"layers.{i}.")}
            with observe_inputs(names, keep_hessian=cfg.method == "gptq",
                                max_rows=AWQ_SAMPLE_ROWS if cfg.method == "awq" else 0) as stats:
                for h in hidden:
                    layer_forward(layer, h)
            _quantize_layers(model, names, method, stats, bar)
            hidden = [layer_forward(layer, h) for h in hidden]  # the quantized layer's output
    else:
        stats: dict = {}
        if cfg.needs_calibration:  # fp8 static activation scales: amax of the float model
            with observe_inputs(targets) as stats:
                calibration_forward(model, calibration_ids, device)
        _quantize_layers(model, targets, method, stats, bar)
    bar.close()


def _quantize_layers(model, layers: dict, method, stats: dict, bar) -> None:
    from minivllm.quantization import weight_quant as wq

    cfg = method.cfg
    for name, lin in layers.items():
        weight = lin.weight.detach().float().cpu()
        st = stats.get(name)
        if cfg.method == "awq":
            st.awq_scale, _ = wq.awq_search_scale([weight], st.sample, cfg.group_size,
                                                  cfg.symmetric, n_grid=cfg.n_grid)
        tensors = {k: v.to(lin.weight.device) for k, v in method.quantize(weight, st).items()}
        method.check_tensors(tensors, lin.out_features, lin.in_features)
        bias = None if lin.bias is None else lin.bias.detach().clone()
        _replace(model, name, QuantLinear(method, tensors, lin.in_features, lin.out_features,
                                          bias, tf32=lin.tf32))
        if st is not None:  # free the Hessian / samples as we go
            stats[name] = None
        bar.update(1)


def set_float32_matmul_precision(model, precision: str, device: str) -> None:
    """``"highest"``: plain float32. ``"high"``: TF32 for float32 matmuls.

    On CUDA this sets torch's real TF32 switch (``torch.backends.cuda.matmul.allow_tf32``
    via ``torch.set_float32_matmul_precision``), which is process-wide: every float32
    matmul in the process, not only this engine's. On CPU it flags the model's linear
    layers and LM head to round their inputs to TF32 (emulation; attention's own
    matmuls are not rounded).
    """
    high = precision == "high"
    dtype = model.embed_tokens.weight.dtype
    if high and dtype != torch.float32:
        logger.warning("float32_matmul_precision='high' (TF32) changes only float32 matmuls; "
                       "this model runs in %s, so it has no effect (dtype='auto' serves "
                       "float32 checkpoints in bfloat16: pass dtype='float32')", dtype)
    if str(device).startswith("cuda"):
        torch.set_float32_matmul_precision(precision)
        high = False  # the hardware does it
    model.tf32 = high
    for module in model.modules():
        if isinstance(module, (Linear, QuantLinear)):
            module.tf32 = high


def model_weight_bytes(model) -> dict[str, int]:
    """Bytes of the weights as stored: ``{"linear": ..., "other": ..., "total": ...}``.

    "linear" counts the decoder linear layers (quantized tensors and scales when
    quantized); "other" the embeddings, norms and an untied LM head.
    """
    linear = other = 0
    seen = set()
    for module in model.modules():
        if isinstance(module, QuantLinear):
            linear += module.weight_bytes()
            seen.update(id(t) for t in module.stored_tensors().values())
    for name, p in list(model.named_parameters()) + list(model.named_buffers()):
        if id(p) in seen:
            continue
        nbytes = p.numel() * p.element_size()
        if any(name.endswith(f"{t}.weight") for t in TARGETS):
            linear += nbytes
        elif "rotary" not in name and "cos_sin" not in name:
            other += nbytes
    return {"linear": linear, "other": other, "total": linear + other}
