"""Weights: checkpoint reading (safetensors, FP8), the TP sharding table, load checks, the node-local shared weight store and device IPC sharing."""
