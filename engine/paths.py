"""Where the engine finds things on disk (no torch: the CLI imports this for its defaults)."""
from __future__ import annotations

from pathlib import Path

# The embedded tiny model every command and LLM() uses when no model directory is given.
DEFAULT_MODEL_DIR = Path(__file__).resolve().parent.parent / "models" / "pdserve-tiny"
