"""Where the engine finds things on disk (no torch: the CLI imports this for its defaults)."""
from __future__ import annotations

from pathlib import Path

MODELS_DIR = Path(__file__).resolve().parent.parent / "models"
# The embedded tiny models: K3-shaped (KDA + gated MLA, DSpark draft) and DeepSeek-V3-shaped (DFlash draft).
K3_MODEL_DIR = MODELS_DIR / "pdserve-k3-tiny"
DSV3_MODEL_DIR = MODELS_DIR / "pdserve-tiny"
# What every command and LLM() uses when no model directory is given; the DeepSeek-V3 one is served with
# --model models/pdserve-tiny.
DEFAULT_MODEL_DIR = K3_MODEL_DIR
