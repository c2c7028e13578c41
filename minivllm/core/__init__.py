"""minivllm.core."""
