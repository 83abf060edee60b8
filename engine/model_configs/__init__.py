"""Model configurations other than DeepSeek-V3's (engine/config.py): Kimi Linear / Kimi K3 and quantization."""
