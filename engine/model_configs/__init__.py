"""Model configurations other than DeepSeek-V3's (engine/model_configs/model_config.py): Kimi Linear / Kimi K3 and quantization."""
