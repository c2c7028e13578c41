"""minivllm.worker."""
