"""Parallelism. :mod:`minivllm.parallel.emulated_tp`: tensor parallelism emulated in one
process (the shards and the all-reduce of ``tensor_parallel_size`` ranks), for chapter 25."""
