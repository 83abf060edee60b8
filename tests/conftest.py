"""Suite-wide settings. TRITON_INTERPRET must be set before triton is first imported (Triton 3.9 reads
it when kernels are decorated), so the interpreter runs the Triton kernels on this CPU-only machine."""
from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items) -> None:
    """Tests marked `compose` (a real container bring-up, ~15 min: scripts/compose.sh test, .ci/run) run only
    when the -m expression names them; the default run and `-m slow` leave them out."""
    if "compose" in (config.option.markexpr or ""):
        return
    deselected = [item for item in items if item.get_closest_marker("compose") is not None]
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = [item for item in items if item.get_closest_marker("compose") is None]
