"""The paged latent KV cache (page tables, the page allocator, pools) and the per-sequence recurrent state slots of linear-attention models, plus the prefix cache over both."""
