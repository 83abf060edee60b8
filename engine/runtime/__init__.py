"""The engine's runtime: the step loop (llm_engine), continuous batching (scheduler, sequence), step plans and their results, the model runner and its CUDA graphs, tensor-parallel ranks."""
