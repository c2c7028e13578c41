"""Tensor parallelism emulated in one process: the same shards and the same reduction as
``tensor_parallel_size`` ranks, computed one rank after the other (course chapter 25).

Megatron-LM's layout (Shoeybi et al. 2019, arXiv:1909.08053), as vLLM implements it in
``vllm/model_executor/layers/linear.py``:

* ``qkv_proj`` is a ``QKVParallelLinear``: rank r holds the query heads
  ``[r * H / tp, (r + 1) * H / tp)`` and the KV heads of its group (when there are fewer
  KV heads than ranks, each KV head is replicated on ``tp / H_kv`` ranks), so every rank
  attends over its own heads; no communication.
* ``o_proj`` and ``down_proj`` are ``RowParallelLinear``: rank r multiplies its slice of
  the input features (its heads' outputs, its slice of the MLP's hidden units) by the
  matching columns of the weight; the partial sums are **all-reduced**. This is where
  tensor parallelism changes numbers: the sum over the input dimension is cut into tp
  pieces, each rounded to the model dtype, then added in the all-reduce's order.
* ``gate_up_proj`` is a ``MergedColumnParallelLinear``: rank r holds ``[gate_r; up_r]``,
  the r-th slice of each of the two fused matrices, so that its local SiluAndMul pairs
  each gate unit with its own up unit. Cutting the fused ``[gate; up]`` matrix into tp
  contiguous pieces instead is the OLMo-class bug (vllm #3775, fixed in PR #3869): ranks
  then multiply gate units with the wrong up units.
* The embedding and LM head are vocab-parallel (each rank holds vocab / tp rows); their
  outputs are gathered, which moves values without changing any, so they stay whole here.

What the emulation computes, per decoder layer: each rank's q/k/v rows (reassembled in
head order, so the attention backend and KV cache are the unsharded ones), each rank's
partial ``o_proj`` and MLP outputs in the model dtype, then ``all_reduce(partials)``.
The default all-reduce adds the partials in rank order, one at a time, in the model dtype;
NCCL's ring and tree algorithms add in other orders (and may accumulate differently),
which is one reason real multi-GPU outputs can differ run to run (vllm #2742). The shard
functions and the all-reduce are arguments, so a lab can plug its own in.

Validation follows vLLM's (``ModelConfig.verify_with_parallel_config``): the number of
attention heads must be divisible by tp (SmolLM2-135M has 9: tp is 1 or 3), and the
intermediate size too. Not emulated: the vocab-parallel padding of the embedding.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn


def check_tensor_parallel_size(cfg: dict, tp: int) -> None:
    """vLLM's checks of ``tensor_parallel_size`` against a model config.

    Raises:
        ValueError: tp not a positive integer, attention heads or intermediate size not
            divisible by tp, or KV heads that neither divide nor are divided by tp.
    """
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ValueError(f"tensor_parallel_size must be an integer >= 1, got {tp!r}")
    heads = cfg["num_attention_heads"]
    kv = cfg.get("num_key_value_heads", heads)
    if heads % tp:
        allowed = [d for d in range(1, heads + 1) if heads % d == 0]
        raise ValueError(f"Total number of attention heads ({heads}) must be divisible by "
                         f"tensor parallel size ({tp}); allowed here: {allowed}")
    if (kv >= tp and kv % tp) or (kv < tp and tp % kv):
        raise ValueError(f"Total number of KV heads ({kv}) must divide or be divisible by "
                         f"tensor parallel size ({tp})")
    if cfg["intermediate_size"] % tp:
        raise ValueError(f"intermediate_size ({cfg['intermediate_size']}) must be divisible "
                         f"by tensor parallel size ({tp})")


def shard_qkv(w: torch.Tensor, rank: int, tp: int, num_heads: int, num_kv_heads: int,
              head_dim: int) -> torch.Tensor:
    """Rank ``rank``'s rows of a fused QKV weight [(H + 2 H_kv) * D, in]: its H / tp query
    heads, then its KV head(s) for K and for V (each KV head replicated on tp / H_kv
    ranks when H_kv < tp). Returns [(H / tp + 2 max(1, H_kv / tp)) * D, in]."""
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    q, k, v = w.split([q_size, kv_size, kv_size], dim=0)
    hq = num_heads // tp
    q_r = q[rank * hq * head_dim:(rank + 1) * hq * head_dim]
    if num_kv_heads >= tp:
        hk = num_kv_heads // tp
        lo = rank * hk * head_dim
        k_r, v_r = k[lo:lo + hk * head_dim], v[lo:lo + hk * head_dim]
    else:  # replicated: rank r uses KV head r // (tp / H_kv)
        j = rank // (tp // num_kv_heads)
        k_r, v_r = k[j * head_dim:(j + 1) * head_dim], v[j * head_dim:(j + 1) * head_dim]
    return torch.cat([q_r, k_r, v_r], dim=0)


def shard_merged_column(w: torch.Tensor, sizes: Sequence[int], rank: int,
                        tp: int) -> torch.Tensor:
    """Rank ``rank``'s rows of a fused column-parallel weight made of matrices of
    ``sizes`` rows stacked (gate_up: ``[I, I]``): the rank-th slice of each, stacked in
    the same order ([gate_r; up_r])."""
    parts = w.split(list(sizes), dim=0)
    return torch.cat([p[rank * (p.shape[0] // tp):(rank + 1) * (p.shape[0] // tp)]
                      for p in parts], dim=0)


def shard_contiguous(w: torch.Tensor, sizes: Sequence[int], rank: int, tp: int) -> torch.Tensor:
    """The bug of vllm #3775: the fused weight cut into tp contiguous pieces, ignoring
    that it is made of ``sizes`` matrices. Same signature as :func:`shard_merged_column`."""
    n = w.shape[0] // tp
    return w[rank * n:(rank + 1) * n]


def all_reduce_rank_order(partials: Sequence[torch.Tensor]) -> torch.Tensor:
    """Sum of the ranks' partial results, added one at a time in rank order, in their
    dtype: ``((p0 + p1) + p2) + ...``. The same inputs always give the same bits."""
    out = partials[0].clone()
    for p in partials[1:]:
        out = out + p
    return out


class _QKV(nn.Module):
    """QKV as tp column-parallel shards, reassembled in head order."""

    def __init__(self, attn, tp: int, shard_fn: Callable):
        super().__init__()
        self.inner, self.tp, self.attn = attn.qkv_proj, tp, [attn]  # list: not a submodule
        self.shards = [shard_fn(self.inner.weight.detach(), r, tp, attn.num_heads,
                                attn.num_kv_heads, attn.head_dim) for r in range(tp)]

    def forward(self, x):
        a = self.attn[0]
        d, tp = a.head_dim, self.tp
        hq = a.num_heads // tp
        hk = max(1, a.num_kv_heads // tp)
        outs = [F.linear(x, w.to(x.dtype)) for w in self.shards]
        q = torch.cat([o[:, :hq * d] for o in outs], dim=-1)
        if a.num_kv_heads >= tp:
            k = torch.cat([o[:, hq * d:(hq + hk) * d] for o in outs], dim=-1)
            v = torch.cat([o[:, (hq + hk) * d:] for o in outs], dim=-1)
        else:  # replicated KV heads: take each head from the first rank that holds it
            step = tp // a.num_kv_heads
            k = torch.cat([outs[r][:, hq * d:(hq + 1) * d] for r in range(0, tp, step)], -1)
            v = torch.cat([outs[r][:, (hq + 1) * d:] for r in range(0, tp, step)], -1)
        return torch.cat([q, k, v], dim=-1)


class _RowParallelO(nn.Module):
    """o_proj as tp row-parallel shards (each rank: its heads' columns) + all-reduce."""

    def __init__(self, attn, tp: int, all_reduce: Callable):
        super().__init__()
        w = attn.o_proj.weight.detach()
        n = w.shape[1] // tp
        self.shards = [w[:, r * n:(r + 1) * n] for r in range(tp)]
        self.n, self.all_reduce = n, all_reduce

    def forward(self, x):
        return self.all_reduce([F.linear(x[:, r * self.n:(r + 1) * self.n], w.to(x.dtype))
                                for r, w in enumerate(self.shards)])


class _MLP(nn.Module):
    """SwiGLU per rank (gate_up shard -> SiluAndMul -> down partial) + all-reduce."""

    def __init__(self, mlp, tp: int, shard_fn: Callable, all_reduce: Callable):
        super().__init__()
        inter = mlp.intermediate
        gu = mlp.gate_up_proj.weight.detach()
        down = mlp.down_proj.weight.detach()
        n = inter // tp
        self.gate_up = [shard_fn(gu, [inter, inter], r, tp) for r in range(tp)]
        self.down = [down[:, r * n:(r + 1) * n] for r in range(tp)]
        self.n, self.all_reduce = n, all_reduce

    def forward(self, x):
        partials = []
        for gu, dw in zip(self.gate_up, self.down):
            gate, up = F.linear(x, gu.to(x.dtype)).split(self.n, dim=-1)
            partials.append(F.linear(F.silu(gate) * up, dw.to(x.dtype)))
        return self.all_reduce(partials)


class EmulatedTensorParallel:
    """Swap a model's linear layers for tp emulated ranks; :meth:`restore` undoes it.

    Args:
        model: a :class:`minivllm.models.llama.LlamaForCausalLM` with float weights
            (not quantized: a quantized checkpoint shards its packed tensors differently).
        tp: the tensor-parallel size (checked as vLLM does).
        shard_qkv_fn, shard_merged_column_fn, all_reduce_fn: the functions to use
            (defaults: this module's); a lab passes its own.
    Raises:
        ValueError: tp not allowed for the model, or quantized layers.
    """

    def __init__(self, model, tp: int, shard_qkv_fn: Callable = shard_qkv,
                 shard_merged_column_fn: Callable = shard_merged_column,
                 all_reduce_fn: Callable = all_reduce_rank_order):
        check_tensor_parallel_size(model.cfg, tp)
        from minivllm.layers.linear import Linear

        for layer in model.layers:
            for lin in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                        layer.mlp.gate_up_proj, layer.mlp.down_proj):
                if not isinstance(lin, Linear):
                    raise ValueError("EmulatedTensorParallel needs float linear layers; this "
                                     f"model has {type(lin).__name__} (quantized)")
        self.model, self.tp, self._saved = model, tp, []
        for layer in model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            self._saved.append((attn.qkv_proj, attn.o_proj, layer.mlp))
            attn.qkv_proj = _QKV(attn, tp, shard_qkv_fn)
            attn.o_proj = _RowParallelO(attn, tp, all_reduce_fn)
            layer.mlp = _MLP(mlp, tp, shard_merged_column_fn, all_reduce_fn)

    def restore(self) -> None:
        """Put the original layers back."""
        for layer, (qkv, o, mlp) in zip(self.model.layers, self._saved):
            layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp = qkv, o, mlp
        self._saved = []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.restore()


def emulate_tensor_parallel(llm, tp: int, **fns) -> EmulatedTensorParallel:
    """Emulate ``tensor_parallel_size=tp`` on an :class:`~minivllm.LLM`'s model, in
    place; use as a context manager or call ``.restore()``. Prefix caching is reset
    (cached K/V came from the unsharded model). ``fns``: see :class:`EmulatedTensorParallel`."""
    llm.reset_prefix_cache()
    return EmulatedTensorParallel(llm.llm_engine.model_runner.model, tp, **fns)
