"""Tensor parallelism across processes: the communication ops and the parallel layers
(``tensor_parallel_size`` > 1; course chapter 25).

The same Megatron-LM layout as :mod:`minivllm.parallel.emulated_tp` (read its docstring
first), but each rank is a real process holding only its shard, and the partial sums
meet in a real all-reduce (``torch.distributed`` with the gloo backend on CPU). vLLM:
``vllm/distributed/communication_op.py`` (``tensor_model_parallel_all_reduce``,
``tensor_model_parallel_all_gather``), ``vllm/model_executor/layers/linear.py``
(``RowParallelLinear``, ``QKVParallelLinear``, ``MergedColumnParallelLinear``) and
``vllm/model_executor/layers/vocab_parallel_embedding.py``.

Per decoder layer, rank r of tp computes:

* ``qkv_proj``: its query heads and KV head(s) (column-parallel; no communication), so
  its attention runs over its own heads and its KV cache holds only them;
* ``o_proj``: its heads' columns of W_o, then **all-reduce** (row-parallel);
* ``gate_up_proj``: ``[gate_r; up_r]`` (merged column-parallel), SiLU-and-mul locally;
* ``down_proj``: its slice of the hidden units, then **all-reduce** (row-parallel).

The embedding is vocab-parallel: rank r holds rows ``[r V_p / tp, (r + 1) V_p / tp)``
(V_p: the vocabulary padded up to a multiple of tp), looks up the tokens that fall in
its range, writes zeros for the others, and the all-reduce adds one non-zero row to
tp - 1 zero rows, which is exact. The (tied) LM head uses the same rows: each rank
computes its slice of the logits and an **all-gather** concatenates them, which moves
values without changing any. So the only numbers tensor parallelism changes are the
two row-parallel sums per layer: float32 addition is not associative, and the sum over
the input dimension is now cut into tp pieces added in the all-reduce's order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from minivllm.layers.linear import Linear, QuantLinear
from minivllm.parallel.emulated_tp import (check_tensor_parallel_size, shard_merged_column,
                                           shard_qkv)
from minivllm.utils import cdiv


@dataclass(frozen=True)
class TPGroup:
    """This process's place in the tensor-parallel group (vLLM: ``GroupCoordinator``,
    ``get_tp_group()``). Uses torch.distributed's default process group, which the
    executor initialises in every rank."""

    rank: int
    world_size: int

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of ``x`` over the ranks, the same bits on every rank (vLLM:
        ``tensor_model_parallel_all_reduce``). Any shape; returns a new tensor."""
        x = x.clone(memory_format=torch.contiguous_format)  # one copy, contiguous
        dist.all_reduce(x, op=dist.ReduceOp.SUM)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's ``x`` concatenated along ``dim`` in rank order (vLLM:
        ``tensor_model_parallel_all_gather``). All ranks' ``x`` must have one shape."""
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts, dim=dim)


class RowParallelLinear(Linear):
    """A linear layer whose input features are split across the ranks: this rank holds
    ``weight[:, its slice]`` ([out, in / tp]) and multiplies its slice of the input;
    the partial outputs [tokens, out] are all-reduced, then the bias (if any) is added
    once. The local product is the engine's own ``Linear`` (steps, TF32 emulation,
    batch-invariant rows all apply)."""

    def __init__(self, weight: torch.Tensor, bias, group: TPGroup, like: Linear):
        super().__init__(weight.shape[1], weight.shape[0], bias=False,
                         device=weight.device, dtype=weight.dtype)
        self.weight = nn.Parameter(weight.detach().clone(), requires_grad=False)
        self.tf32 = like.tf32
        self.full_bias = None if bias is None else bias.detach().clone()
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.group.all_reduce(super().forward(x))
        return out if self.full_bias is None else out + self.full_bias.to(out.dtype)


class VocabParallelEmbedding(nn.Module):
    """The token embedding split by vocabulary rows (vLLM: ``VocabParallelEmbedding``).

    Args:
        weight: the full table [vocab, hidden].
        group: the TP group.
    ``weight`` of this module: rows ``[start, end)`` of the table padded with zero rows
    to ``padded_vocab = tp * ceil(vocab / tp)``; [padded_vocab / tp, hidden].
    """

    def __init__(self, weight: torch.Tensor, group: TPGroup):
        super().__init__()
        vocab, hidden = weight.shape
        tp, r = group.world_size, group.rank
        self.vocab_size = vocab
        self.per_rank = cdiv(vocab, tp)
        self.start = r * self.per_rank
        local = torch.zeros(self.per_rank, hidden, dtype=weight.dtype, device=weight.device)
        rows = weight[self.start:min(vocab, self.start + self.per_rank)]
        local[:rows.shape[0]] = rows
        self.weight = nn.Parameter(local, requires_grad=False)
        self.group = group

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [T] int64 -> [T, hidden]: each rank's rows for its ids, zeros for the
        others, all-reduced (exact: one non-zero addend per element)."""
        local = input_ids - self.start
        mine = (local >= 0) & (local < self.per_rank)
        out = F.embedding(torch.where(mine, local, 0), self.weight)
        out = out * mine.unsqueeze(-1).to(out.dtype)
        return self.group.all_reduce(out)

    def gather_logits(self, local_logits: torch.Tensor) -> torch.Tensor:
        """[rows, padded_vocab / tp] -> [rows, vocab]: the ranks' slices in rank order,
        the padding columns dropped."""
        return self.group.all_gather(local_logits, dim=-1)[:, :self.vocab_size]


def shard_model(model, group: TPGroup, shard_qkv_fn: Callable = shard_qkv,
                shard_merged_column_fn: Callable = shard_merged_column) -> None:
    """Turn a full :class:`~minivllm.models.llama.LlamaForCausalLM` into this rank's shard,
    in place (each rank loads the full checkpoint and keeps its part; fine for the
    small models this engine runs, where vLLM's loaders read only the rank's slice).

    Args:
        model: float weights (a quantized model's packed tensors shard differently).
        group: this rank's TP group.
        shard_qkv_fn, shard_merged_column_fn: how to cut the fused weights (defaults:
            the correct layouts of :mod:`~minivllm.parallel.emulated_tp`; chapter 25's
            fault passes ``shard_contiguous``, the bug of vllm #3775). Module-level
            functions, since the executor sends them to the worker processes by name.
    Raises:
        ValueError: tp not allowed for the model (vLLM's checks), or quantized layers.
    """
    tp, r = group.world_size, group.rank
    check_tensor_parallel_size(model.cfg, tp)
    for name, m in model.named_modules():
        if isinstance(m, QuantLinear):
            raise ValueError(f"tensor_parallel_size > 1 needs float weights; {name} is "
                             f"quantized ({type(m).__name__}); drop quantization= or use "
                             "tensor_parallel_size=1")
    if not model.tie_word_embeddings:
        raise ValueError("tensor_parallel_size > 1 supports tied embeddings (SmolLM2) only "
                         "here: a separate lm_head is not sharded yet")
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        hq = attn.num_heads // tp
        hk = max(1, attn.num_kv_heads // tp)
        w = shard_qkv_fn(attn.qkv_proj.weight.detach(), r, tp, attn.num_heads,
                         attn.num_kv_heads, attn.head_dim)
        b = attn.qkv_proj.bias
        if b is not None:
            b = shard_qkv_fn(b.detach()[:, None], r, tp, attn.num_heads, attn.num_kv_heads,
                             attn.head_dim)[:, 0]
        attn.qkv_proj = _local_linear(w, b, attn.qkv_proj)
        n = attn.o_proj.weight.shape[1] // tp
        attn.o_proj = RowParallelLinear(attn.o_proj.weight[:, r * n:(r + 1) * n],
                                        attn.o_proj.bias, group, attn.o_proj)
        attn.num_heads, attn.num_kv_heads = hq, hk
        attn.q_size, attn.kv_size = hq * attn.head_dim, hk * attn.head_dim
        inter = mlp.intermediate
        gu, gb = mlp.gate_up_proj.weight.detach(), mlp.gate_up_proj.bias
        mlp.gate_up_proj = _local_linear(
            shard_merged_column_fn(gu, [inter, inter], r, tp),
            None if gb is None else shard_merged_column_fn(gb.detach()[:, None],
                                                           [inter, inter], r, tp)[:, 0],
            mlp.gate_up_proj)
        n = inter // tp
        mlp.down_proj = RowParallelLinear(mlp.down_proj.weight[:, r * n:(r + 1) * n],
                                          mlp.down_proj.bias, group, mlp.down_proj)
        mlp.intermediate = n
    model.embed_tokens = VocabParallelEmbedding(model.embed_tokens.weight.detach(), group)
    model.logits_gather = model.embed_tokens.gather_logits


def _local_linear(weight: torch.Tensor, bias, like: Linear) -> Linear:
    """A column-parallel shard: a plain ``Linear`` with this rank's rows (no
    communication), with ``like``'s matmul precision."""
    lin = Linear(weight.shape[1], weight.shape[0], bias=bias is not None,
                 device=weight.device, dtype=weight.dtype)
    lin.tf32 = like.tf32
    lin.weight = nn.Parameter(weight.detach().clone(), requires_grad=False)
    if bias is not None:
        lin.bias = nn.Parameter(bias.detach().clone(), requires_grad=False)
    return lin
