"""minivllm.engine."""
