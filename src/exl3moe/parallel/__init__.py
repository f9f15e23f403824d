"""Tensor and expert parallelism: split rules for EXL3 weights (split.py)."""
