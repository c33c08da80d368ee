"""Checkpoint loaders (GGUF, HF safetensors, MLX) and exporters."""
