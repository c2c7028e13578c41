"""SmoothQuant-style smoothing folded into a float checkpoint, exactly (powers of two).

SmoothQuant (Xiao et al. 2022, arXiv:2211.10438, Sec. 4; reference code
github.com/mit-han-lab/smoothquant ``smooth.py``: ``smooth_ln_fcs_llama_like``) migrates
activation outliers into the weights: for the linear layers that read an RMSNorm's output
(q/k/v after ``input_layernorm``, gate/up after ``post_attention_layernorm``) it divides
input channel ``j`` of the activations by ``s_j`` (the norm's weight ``j``) and multiplies
column ``j`` of those weights by ``s_j``, with

    s_j = clamp(max|X_j| ** alpha / max|W_j| ** (1 - alpha), min=1e-5)

(``max|W_j|``: column ``j``'s amax over all the layers that read the norm). AWQ folds its
per-input-channel scales the same way (AutoAWQ ``scale_ln_fcs``). Here each ``s_j`` is
rounded to the nearest power of two, so that ``w / s`` and ``W[:, j] * s`` are exact in
float32 and the folded float model computes bit for bit what the original does (the
products ``(x_j / s)(W_ij s) = x_j W_ij`` exactly, barring under/overflow). The numbers a
quantizer then sees in the weights are different: column ``j`` is ``s_j`` times larger.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from minivllm.utils import save_safetensors

# the layers that read a norm's output, and that norm (checkpoint names, layer i)
SITES = {"self_attn.qkv_proj": ("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj",
                                                    "self_attn.v_proj")),
         "mlp.gate_up_proj": ("post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj"))}
MIN_SCALE = 1e-5  # SmoothQuant's clamp


def power_of_two(s: torch.Tensor) -> torch.Tensor:
    """``2 ** round(log2(s))`` (float32), s positive: the nearest power of two in log
    scale (ties to even exponent, torch.round)."""
    if not bool((s > 0).all() & torch.isfinite(s).all()):
        raise ValueError("smoothing scales must be positive and finite")
    return torch.exp2(torch.round(torch.log2(s.to(torch.float32))))


def smoothing_scales(x_amax: torch.Tensor, w_amax: torch.Tensor, alpha: float) -> torch.Tensor:
    """SmoothQuant's per-input-channel scale, rounded to a power of two.

    Args:
        x_amax: float ``[in]``, max |x_j| of the layer inputs over calibration tokens.
        w_amax: float ``[in]``, max |W_ij| over the rows of every layer reading that input.
        alpha: migration strength in [0, 1] (SmoothQuant uses 0.5 for most models, up
            to 0.75-0.85 for some; 0 leaves the weights as they are, 1 moves all of the
            activation range into them).

    Returns:
        float32 ``[in]``, ``power_of_two(clamp(x_amax ** alpha / w_amax ** (1 - alpha),
        min=1e-5))``, with ``x_amax`` and ``w_amax`` clamped to 1e-5 first (SmoothQuant's
        ``clamp(min=1e-5)``).

    Raises:
        ValueError: shapes differ or are not 1-D; alpha outside [0, 1].
    """
    if x_amax.ndim != 1 or x_amax.shape != w_amax.shape:
        raise ValueError(f"x_amax and w_amax must be 1-D of one length, got "
                         f"{tuple(x_amax.shape)} and {tuple(w_amax.shape)}")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0 <= alpha <= 1:
        raise ValueError(f"alpha must be a number in [0, 1], got {alpha!r}")
    x = x_amax.float().clamp(min=MIN_SCALE)
    w = w_amax.float().clamp(min=MIN_SCALE)
    return power_of_two((x.pow(alpha) / w.pow(1 - alpha)).clamp(min=MIN_SCALE))


@torch.inference_mode()
def input_amax(llm, token_ids: list[list[int]]) -> dict[str, torch.Tensor]:
    """Per-input-channel max |x| ``[in]`` at every qkv_proj and gate_up_proj of a float
    engine, over the given token sequences (one causal prefill each).

    Returns:
        ``{"layers.0.self_attn.qkv_proj": tensor[in], ...}`` (float32).
    """
    from minivllm.quantization.calibration import calibration_forward, observe_inputs
    from minivllm.quantization.quantize import target_layers

    model = llm.llm_engine.model_runner.model
    mods = {n: m for n, m in target_layers(model).items() if n.split(".", 2)[2] in SITES}
    # a fresh dict literal so it type-checks as observe_inputs' dict[str, nn.Module]
    with observe_inputs({n: m for n, m in mods.items()}, keep_channel_amax=True) as observers:
        calibration_forward(model, token_ids)
    return {n: torch.zeros(mods[n].in_features) if o.channel_amax is None else o.channel_amax
            for n, o in observers.items()}


def fold_into_checkpoint(src: str | Path, dst: str | Path,
                         scales: dict[str, torch.Tensor]) -> Path:
    """Write a copy of the float checkpoint folder ``src`` to ``dst`` with ``scales``
    folded in: for ``"layers.i.self_attn.qkv_proj"`` (``"layers.i.mlp.gate_up_proj"``),
    ``input_layernorm`` (``post_attention_layernorm``) weight of layer i divided by ``s``
    and the columns of q/k/v (gate/up) multiplied by it.

    Args:
        src: a float checkpoint folder (``model.safetensors`` with HF names, config and
            tokenizer files), e.g. ``resolve_model_path("smollm2-135m-instruct")``.
        dst: a new or empty folder.
        scales: layer name -> float ``[in]`` powers of two (from :func:`smoothing_scales`).

    Returns:
        ``dst`` as a Path; ``LLM(str(dst))`` loads it.

    Raises:
        ValueError: a name that is not a qkv_proj/gate_up_proj of the checkpoint, a scale
            that is not a positive power of two of the right length, ``dst`` not empty.
    """
    from safetensors.torch import load_file

    src, dst = Path(src), Path(dst)
    if dst.exists() and any(dst.iterdir()):
        raise ValueError(f"{dst} is not empty")
    state = load_file(str(src / "model.safetensors"))
    for name, s in scales.items():
        parts = name.split(".", 2)
        if len(parts) != 3 or parts[0] != "layers" or parts[2] not in SITES:
            raise ValueError(f"{name!r} is not a layers.N.self_attn.qkv_proj or "
                             "layers.N.mlp.gate_up_proj")
        norm, shards = SITES[parts[2]]
        norm_key = f"model.layers.{parts[1]}.{norm}.weight"
        if norm_key not in state:
            raise ValueError(f"{name!r}: the checkpoint has no {norm_key}")
        s32 = s.detach().to(torch.float32)
        if s32.shape != state[norm_key].shape or not torch.equal(power_of_two(s32), s32):
            raise ValueError(f"{name!r}: scales must be positive powers of two of shape "
                             f"{tuple(state[norm_key].shape)}")
        state[norm_key] = state[norm_key] / s32
        for shard in shards:
            key = f"model.layers.{parts[1]}.{shard}.weight"
            state[key] = state[key] * s32
    dst.mkdir(parents=True, exist_ok=True)
    save_safetensors(state, dst / "model.safetensors", metadata={"format": "pt"})
    for f in src.iterdir():
        if f.is_file() and f.name != "model.safetensors":
            shutil.copy2(f, dst / f.name)
    return dst
