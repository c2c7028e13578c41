"""CUDA graphs for decode steps (vLLM: ``vllm/v1/worker/gpu_model_runner.py``,
``capture_model``; ``vllm/compilation/cuda_graph.py``).

A decode step of a small model launches hundreds of small kernels; on a GPU the CPU
time to launch them can exceed the GPU time to run them. A CUDA graph records the
launches of one forward pass once and replays them with a single call. A graph replays
*exactly* what was recorded: the same kernels, grids and buffer addresses. So:

* inputs live in static buffers (token ids, positions, slot mapping, block tables,
  sequence lengths) that each step overwrites before replaying;
* one graph per batch size in ``capture_sizes`` (1, 2, 4, 8, 16, 24, ... as vLLM); a
  batch of 5 runs in the size-8 graph, padded with 3 dummy rows: slot -1 (the store
  kernel skips it) and sequence length 0 (attention returns 0 for it);
* the decode kernel's grid is recorded for ``max_model_len`` keys: programs past a
  sequence's end return at once, and because the split size is fixed, the result equals
  an eager run's (see :mod:`kernels.paged_attention`).

The LM head and the sampler run outside the graph, on the real rows only. Steps with
prefill tokens, or more sequences than the largest graph, run eagerly.

Padding changes the matmuls' row count M. cuBLAS may pick a different kernel for M=8
than for M=5, so graph and eager logits can differ in the last bits (in bfloat16 that
can flip a near-tie argmax): this is chapter 24's incident, measured, not a bug.
"""

from __future__ import annotations

import bisect
import logging

import torch

from minivllm.attention.metadata import AttentionMetadata, PagedMetadata

logger = logging.getLogger("minivllm")


def capture_sizes(max_batch_size: int) -> list[int]:
    """1, 2, 4, then multiples of 8 up to max_batch_size (which is always included)."""
    sizes = [s for s in [1, 2, 4] + list(range(8, max_batch_size + 1, 8)) if s <= max_batch_size]
    if sizes[-1] != max_batch_size:
        sizes.append(max_batch_size)
    return sizes


class CUDAGraphRunner:
    """Captures the model's decode forward for each capture size and replays it.

    Args:
        model: our LlamaForCausalLM on CUDA, TRITON attention backend, caches bound.
        max_batch_size: largest captured batch.
        max_model_len: longest sequence (sets the block-table width and the decode
            kernel's number of split programs).
        block_size: tokens per cache block.
        device: the CUDA device.
    """

    def __init__(self, model, max_batch_size: int, max_model_len: int, block_size: int,
                 device: torch.device):
        self.model = model
        self.sizes = capture_sizes(max_batch_size)
        self.max_batch_size = self.sizes[-1]
        self.max_model_len = max_model_len
        self.block_size = block_size
        n, dev = self.max_batch_size, device
        max_blocks = -(-max_model_len // block_size)
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(n, dtype=torch.int64, device=dev)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, device=dev)
        self.block_tables = torch.zeros(n, max_blocks, dtype=torch.int32, device=dev)
        self.seq_lens = torch.zeros(n, dtype=torch.int32, device=dev)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = torch.cuda.graph_pool_handle()
        self._capture_all()

    def _meta(self, bs: int) -> AttentionMetadata:
        paged = PagedMetadata(block_size=self.block_size, decode_rows=None,
                              decode_block_tables=self.block_tables[:bs],
                              decode_seq_lens=self.seq_lens[:bs],
                              decode_max_seq_len=self.max_model_len)
        return AttentionMetadata(slot_mapping=self.slot_mapping[:bs], paged=paged)

    @torch.inference_mode()
    def _capture_all(self) -> None:
        # Largest first, so smaller graphs reuse the memory pool the largest allocated.
        for bs in reversed(self.sizes):
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):  # warm-up: compiles kernels
                self.model(self.input_ids[:bs], self.positions[:bs], self._meta(bs))
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            # Fresh views: the rotary embedding reuses its cos/sin when it sees the *same*
            # positions tensor again, which would leave that lookup out of the graph.
            with torch.cuda.graph(graph, pool=self.pool):
                out = self.model(self.input_ids[:bs], self.positions[:bs], self._meta(bs))
            self.graphs[bs] = (graph, out)
        torch.cuda.synchronize()
        logger.info("captured CUDA graphs for decode batch sizes %s", self.sizes)

    def can_run(self, meta: AttentionMetadata, num_tokens: int) -> bool:
        """True for a pure-decode step that fits the largest graph."""
        p = meta.paged
        return (p is not None and p.num_prefills == 0 and p.decode_rows is None
                and 0 < num_tokens <= self.max_batch_size)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor,
            meta: AttentionMetadata) -> torch.Tensor:
        """Copy the step's inputs into the static buffers, pad, replay; returns the final
        hidden states of the real rows [B, hidden]."""
        b = input_ids.shape[0]
        bs = self.sizes[bisect.bisect_left(self.sizes, b)]
        p = meta.paged
        self.input_ids[:b].copy_(input_ids)
        self.positions[:b].copy_(positions)
        self.slot_mapping[:b].copy_(meta.slot_mapping)
        self.seq_lens[:b].copy_(p.decode_seq_lens)
        width = p.decode_block_tables.shape[1]
        self.block_tables[:b, :width].copy_(p.decode_block_tables)
        if bs > b:  # padding rows: write nothing, attend to nothing
            self.slot_mapping[b:bs].fill_(-1)
            self.seq_lens[b:bs].zero_()
        graph, out = self.graphs[bs]
        graph.replay()
        return out[:b]
