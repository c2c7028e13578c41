"""minivllm.entrypoints."""
