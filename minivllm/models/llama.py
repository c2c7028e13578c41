"""The Llama architecture, written here (SmolLM2, Llama 2/3 and Llama-like checkpoints).

vLLM: ``vllm/model_executor/models/llama.py``. As in vLLM, q/k/v projections are fused
into one ``qkv_proj`` and gate/up into ``gate_up_proj`` (``load_weights`` stacks the HF
tensors), and the model works on a *flat* batch of tokens from many sequences; the
paged-attention metadata says which tokens belong together.

Shapes: ``input_ids``/``positions`` [num_tokens]; hidden states [num_tokens, hidden];
logits [num_rows, vocab] float32.
"""

from __future__ import annotations

from typing import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from minivllm.attention.backends import get_attention_backend
from minivllm.attention.metadata import AttentionMetadata
from minivllm.layers.linear import Linear, _cached_weight, float_linear
from minivllm.layers.rms_norm import RMSNorm
from minivllm.layers.rotary_embedding import get_rope
from minivllm.quantization.kv_cache import LayerKVCache
from minivllm.utils import forward_hooks_registered, hook_dicts


def lm_head_ref(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The "lm_head" step's reference (:mod:`minivllm.steps`): logits in float32.

    Args:
        hidden: [rows, hidden_size] final-norm hidden states, model dtype.
        weight: [vocab, hidden_size] LM head (the tied embedding for SmolLM2), model dtype.
    Returns:
        [rows, vocab] float32: the product is computed in the model dtype and then cast,
        as vLLM's ``LogitsProcessor`` does; an "fp32 LM head" would cast first.
    """
    return float_linear(hidden, weight, None, False, owner=weight).float()


def embedding_ref(input_ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The "embedding" step's reference (:mod:`minivllm.steps`): the rows of the token
    embedding table, what ``embed_tokens`` (``nn.Embedding``) computes.

    Args:
        input_ids: [num_tokens] int64 token ids.
        weight: [vocab, hidden_size] embedding table, model dtype.
    Returns:
        [num_tokens, hidden_size] in the model dtype: the first residual stream.
    """
    return F.embedding(input_ids, weight)


def lm_head_fp32(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The fp32 LM head (``EngineArgs.lm_head_dtype="float32"``) as an "lm_head" step:
    both inputs are cast to float32 *before* the product, so the logits carry no
    rounding from a 16-bit matmul output (vllm #18352's mitigation). Same signature and
    result as the engine's configured path, which keeps the fp32 weight copy between
    calls instead of casting it every time."""
    return F.linear(hidden.float(), weight.float())


class LlamaAttention(nn.Module):
    """Grouped-query attention over the paged KV cache.

    ``kv_cache`` (a :class:`LayerKVCache`: K/V storage [num_slots, num_kv_heads,
    head_dim] and its scales) is bound by the model runner after allocation.
    """

    def __init__(self, cfg: dict, layer_idx: int, max_position: int, backend: str = "TORCH"):
        super().__init__()
        self.layer_idx = layer_idx
        self.hidden_size = cfg["hidden_size"]
        self.num_heads = cfg["num_attention_heads"]
        self.num_kv_heads = cfg.get("num_key_value_heads", self.num_heads)
        self.head_dim = cfg.get("head_dim") or self.hidden_size // self.num_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scaling = self.head_dim ** -0.5
        bias = bool(cfg.get("attention_bias", False))
        self.qkv_proj = Linear(self.hidden_size, self.q_size + 2 * self.kv_size, bias=bias)
        self.o_proj = Linear(self.q_size, self.hidden_size, bias=bias)
        self.rotary_emb = get_rope(self.head_dim, max_position, cfg["rope_theta"],
                                   cfg.get("rope_scaling"))
        self.backend = get_attention_backend(backend)
        self.kv_cache: LayerKVCache | None = None

    def forward(self, positions: torch.Tensor, x: torch.Tensor, meta: AttentionMetadata):
        n = x.shape[0]
        qkv = self.qkv_proj(x)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(n, self.num_heads, self.head_dim)
        k = k.view(n, self.num_kv_heads, self.head_dim)
        v = v.view(n, self.num_kv_heads, self.head_dim)
        q, k = self.rotary_emb(positions, q, k)
        self.backend.store(self.kv_cache, meta.slot_mapping, k, v)
        o = self.backend.forward(q, self.kv_cache, meta, self.scaling)
        return self.o_proj(o.reshape(n, self.q_size))


class LlamaMLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)) (Shazeer 2020, arXiv:2002.05202)."""

    def __init__(self, hidden: int, intermediate: int, bias: bool = False):
        super().__init__()
        self.intermediate = intermediate
        self.gate_up_proj = Linear(hidden, 2 * intermediate, bias=bias)
        self.down_proj = Linear(intermediate, hidden, bias=bias)
        self.act_and_mul = None  # e.g. minivllm_kernels.activation.silu_and_mul: one kernel, same numbers

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.act_and_mul is not None:
            return self.down_proj(self.act_and_mul(gate_up))
        gate, up = gate_up.split(self.intermediate, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: dict, layer_idx: int, max_position: int, backend: str):
        super().__init__()
        eps = cfg.get("rms_norm_eps", 1e-6)
        self.input_layernorm = RMSNorm(cfg["hidden_size"], eps)
        self.self_attn = LlamaAttention(cfg, layer_idx, max_position, backend)
        self.post_attention_layernorm = RMSNorm(cfg["hidden_size"], eps)
        self.mlp = LlamaMLP(cfg["hidden_size"], cfg["intermediate_size"],
                            bool(cfg.get("mlp_bias", False)))

    def forward(self, positions, x, meta, next_norm: "RMSNorm | None" = None):
        """x: the residual stream [num_tokens, hidden]; returns the stream after this
        layer. ``next_norm`` (the next layer's input norm, or the final norm): when its
        "fused_add_rms_norm" step is swapped, the MLP's residual add is that step's
        ``residual`` output (the next layer then normalises the returned stream itself,
        so a hook on this layer still sees the residual stream; see
        :mod:`minivllm.steps`)."""
        if self.post_attention_layernorm.fused_add_impl is None:
            a = self.self_attn(positions, self.input_layernorm(x), meta)
            normed, h = self.post_attention_layernorm.add_and_norm(a, x)  # h = x + a
            m = self.mlp(normed)
            if next_norm is None or next_norm.add_impl is None:
                return h + m
            return next_norm.add_impl(m, h, next_norm.weight, next_norm.eps)[1]
        # kernels in use: the residual add and the norm in one kernel, same numbers
        a = self.self_attn(positions, self.input_layernorm(x), meta)
        normed, h = self.post_attention_layernorm.add_and_norm(a, x)
        return h + self.mlp(normed)

    def forward_deferred(self, positions, x, residual, meta):
        """The same layer with the residual add after the MLP left to the next norm's
        fused add+RMSNorm kernel (vLLM's ``residual`` argument): x is the previous layer's
        MLP output, or the embeddings when ``residual`` is None (first layer). Returns
        ``(mlp_output, residual)``; their sum is what :meth:`forward` returns, and the
        next fused norm computes it with the same rounding, so the numbers are the same
        and one kernel per layer is saved. Used by the model only when no hook watches a
        decoder layer's output (see :meth:`LlamaForCausalLM.forward`)."""
        if residual is None:
            residual, normed = x, self.input_layernorm(x)
        else:
            normed, residual = self.input_layernorm.add_and_norm(x, residual)
        a = self.self_attn(positions, normed, meta)
        normed, residual = self.post_attention_layernorm.add_and_norm(a, residual)
        return self.mlp(normed), residual


class LlamaForCausalLM(nn.Module):
    """Llama decoder stack plus (tied or separate) LM head.

    Args:
        cfg: the HF config.json as a dict (``rope_theta`` resolved, see loader).
        max_position: rotary table size (>= max_model_len).
        backend: attention backend name.
    Raises:
        NotImplementedError: unsupported activation or rope scaling.
    """

    def __init__(self, cfg: dict, max_position: int, backend: str = "TORCH"):
        super().__init__()
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise NotImplementedError(f"hidden_act {act!r} is not supported (supported: silu)")
        self.cfg = cfg
        self.vocab_size = cfg["vocab_size"]
        # _weight: no random init (the loader fills it; on the meta device normal_ would
        # import torch._dynamo, about 2 s, once per process)
        self.embed_tokens = nn.Embedding(
            cfg["vocab_size"], cfg["hidden_size"],
            _weight=torch.empty(cfg["vocab_size"], cfg["hidden_size"]))
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(cfg, i, max_position, backend)
            for i in range(cfg["num_hidden_layers"]))
        self.norm = RMSNorm(cfg["hidden_size"], cfg.get("rms_norm_eps", 1e-6))
        self.tie_word_embeddings = bool(cfg.get("tie_word_embeddings", False))
        self.tf32 = False  # emulate TF32 in the LM head (float32_matmul_precision="high")
        if not self.tie_word_embeddings:
            self.lm_head = Linear(cfg["hidden_size"], cfg["vocab_size"], bias=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """Returns final-norm hidden states [num_tokens, hidden] in the model dtype."""
        h = self.embed_tokens(input_ids)
        if self._defer_residual_adds():
            residual = None
            for layer in self.layers:
                h, residual = layer.forward_deferred(positions, h, residual, meta)
            return self.norm.add_and_norm(h, residual)[0]
        n = len(self.layers)
        for i, layer in enumerate(self.layers):
            nxt = self.layers[i + 1].input_layernorm if i + 1 < n else self.norm
            h = layer(positions, h, meta, next_norm=nxt)
        return self.norm(h)

    def _defer_residual_adds(self) -> bool:
        """Pass the residual to the next fused norm instead of adding it after each
        layer (:meth:`LlamaDecoderLayer.forward_deferred`): only with the kernels in use
        (:meth:`use_triton_kernels`; the PyTorch path stays the plain reference) and no
        forward hook on a decoder layer, since a hook there expects the layer's output to
        be the residual stream (the precision toolkit's ``layers.{i}``). Hooks on the
        sublayers (attention, MLP, norms) still run either way."""
        if self.norm.fused_add_impl is None:
            return False
        # global hooks (register_module_forward_hook) see the layers too
        return not forward_hooks_registered(hook_dicts(self.layers))

    def use_triton_kernels(self) -> None:
        """RMSNorm (fused with the residual add), rotary and SiLU-and-mul from
        :mod:`minivllm_kernels` (the engine does this with the TRITON backend on CUDA). At batch 1
        a decode step is a chain of small kernels; these replace ~25 of the ~40 per
        layer. The numbers match the PyTorch path (rotary bit for bit; RMSNorm up to
        summation order; SiLU within an ulp, see :mod:`minivllm_kernels.activation`)."""
        from minivllm_kernels.activation import silu_and_mul
        from minivllm_kernels.rms_norm import fused_add_rms_norm, rms_norm
        from minivllm_kernels.rotary import rotary_embedding

        from minivllm.layers.rotary_embedding import RotaryEmbedding

        for m in self.modules():
            if isinstance(m, RMSNorm):
                m.use_kernels(rms_norm, fused_add_rms_norm)
            elif isinstance(m, RotaryEmbedding):
                m.kernel = rotary_embedding
            elif isinstance(m, LlamaMLP):
                m.act_and_mul = silu_and_mul

    lm_head_impl = None  # the "lm_head" step when swapped (minivllm.steps)
    lm_head_dtype = None  # None: the model dtype; torch.float32: set_lm_head_dtype
    # tensor parallel (minivllm.parallel.tensor_parallel.shard_model): each rank's logits
    # slice [rows, vocab / tp] -> all ranks' [rows, vocab]; None with tp = 1
    logits_gather = None

    def set_lm_head_dtype(self, dtype) -> None:
        """Run the LM head in ``dtype`` (None: the model dtype; ``torch.float32``: the
        fp32 LM head of ``EngineArgs.lm_head_dtype``). The fp32 copy of the weight is
        made here, once, and kept (remade only if the weight tensor is replaced or
        edited in place); None drops it. A float32 model needs no copy: its head already
        runs in float32."""
        if dtype not in (None, torch.float32):
            raise ValueError(f"lm_head dtype must be None or torch.float32, got {dtype!r}")
        self.lm_head_dtype = dtype
        if hasattr(self, "_lm_head_fp32"):
            del self._lm_head_fp32
        if dtype is not None:
            self._fp32_head_weight()

    def _head_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.tie_word_embeddings else self.lm_head.weight

    def _fp32_head_weight(self) -> torch.Tensor:
        return _cached_weight(self, "_lm_head_fp32", self._head_weight(),
                              lambda w: w.detach().float())

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [rows, hidden] -> logits [rows, vocab] in float32 (the LM head runs in
        the model dtype, as in vLLM, unless ``lm_head_dtype`` is float32; the sampler
        works in float32). A swapped "lm_head" step gets ``(hidden, weight)`` with the
        weight in the model dtype (see :func:`lm_head_ref`), whatever lm_head_dtype is."""
        weight = self._head_weight()
        if self.lm_head_impl is not None:
            logits = self.lm_head_impl(hidden, weight)
        elif self.lm_head_dtype is not None and weight.dtype != torch.float32:
            # fp32 LM head (lm_head_fp32, with the kept copy): plain F.linear on the
            # copy (owner=None: no second, oneDNN-packed copy of 113 MB)
            logits = float_linear(hidden.float(), self._fp32_head_weight(), None, self.tf32)
        else:
            logits = float_linear(hidden, weight, None, self.tf32, owner=weight).float()
        # tensor parallel: this rank holds a slice of the vocabulary; gather the others'
        return logits if self.logits_gather is None else self.logits_gather(logits)

    # --- weights ----------------------------------------------------------------------
    _stacked = {  # HF name piece -> (fused param piece, shard index)
        ".q_proj.": (".qkv_proj.", 0), ".k_proj.": (".qkv_proj.", 1),
        ".v_proj.": (".qkv_proj.", 2), ".gate_proj.": (".gate_up_proj.", 0),
        ".up_proj.": (".gate_up_proj.", 1),
    }

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors (``model.layers.0.self_attn.q_proj.weight``...) in.

        Raises:
            ValueError: an unexpected name, a shape mismatch, or a missing tensor.
        """
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for hf_name, tensor in weights:
            name = hf_name.removeprefix("model.")
            if "rotary_emb.inv_freq" in name:
                continue
            if name == "lm_head.weight" and self.tie_word_embeddings:
                continue
            target, shard = name, None
            for piece, (fused, idx) in self._stacked.items():
                if piece in name:
                    target, shard = name.replace(piece, fused), (piece, idx)
                    break
            if target not in params:
                raise ValueError(f"Unexpected weight {hf_name!r} for this Llama model")
            param = params[target]
            with torch.no_grad():
                if shard is None:
                    _check_shape(hf_name, param.shape, tensor.shape)
                    param.copy_(tensor)
                else:
                    rows = self._shard_rows(shard[0], param.shape[0])
                    lo, hi = rows[shard[1]]
                    _check_shape(hf_name, (hi - lo, *param.shape[1:]), tensor.shape)
                    param[lo:hi].copy_(tensor)
                    target = f"{target}#{shard[1]}"
            loaded.add(target)
        expected = set()
        for name, p in params.items():
            if ".qkv_proj." in name:
                expected.update(f"{name}#{i}" for i in range(3))
            elif ".gate_up_proj." in name:
                expected.update(f"{name}#{i}" for i in range(2))
            else:
                expected.add(name)
        missing = sorted(expected - loaded)
        if missing:
            raise ValueError(f"Checkpoint is missing {len(missing)} tensors, e.g. {missing[:3]}")

    def _shard_rows(self, piece: str, total: int) -> list[tuple[int, int]]:
        if piece in (".gate_proj.", ".up_proj."):
            half = total // 2
            return [(0, half), (half, total)]
        attn = self.layers[0].self_attn
        q, kv = attn.q_size, attn.kv_size
        return [(0, q), (q, q + kv), (q + kv, q + 2 * kv)]


def _check_shape(name, expected, got) -> None:
    if tuple(expected) != tuple(got):
        raise ValueError(f"Weight {name!r} has shape {tuple(got)}, expected {tuple(expected)}")
