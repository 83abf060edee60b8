"""A tiny Kimi K3 model directory for service tests: the random K3 checkpoint of tests/engine (24 KDA / MLA
heads: 12 per rank at TP=2, 6 KDA + 2 MLA layers), a random DSpark draft beside it and the test
tokenizer.json. Written under the caller's tmp directory, never the embedded default model."""
from __future__ import annotations

from pathlib import Path

from tests.engine.dspark_fixtures import make_k3_with_dspark
from tests.gateway.text_tokenizer import make_tokenizer


def make_k3_service_model(root: str | Path) -> Path:
    """root/k3_dspark-0: config.json + safetensors, draft/ (DSpark, block 7), tokenizer.json."""
    out = make_k3_with_dspark(Path(root))
    if not (out / "tokenizer.json").exists():
        make_tokenizer(out)
    return out
