"""Capacity planning (`pdserve plan`): weights, KV cache, head padding, nodes and cost for a model on a GPU.

model_source / presets -> engine.model_configs.model_config.ModelConfig; params counts its weights; dtypes prices them in
bits; gpus is the catalog; capacity is the arithmetic; result gathers one plan; report shows it."""
from __future__ import annotations
