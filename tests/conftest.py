"""Suite-wide settings. TRITON_INTERPRET must be set before triton is first imported (Triton 3.9 reads
it when kernels are decorated), so the interpreter runs the Triton kernels on this CPU-only machine."""
from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
