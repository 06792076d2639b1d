"""Where the tests keep what outlives a run: the model converted from GGUF, the engine's reference outputs."""

from __future__ import annotations

import os
from pathlib import Path

# One conversion cache for the whole run (and across runs on the same machine).
CACHE_DIR = Path(os.environ.get("CONVEYOR_CACHE_DIR", str(Path.home() / ".cache" / "conveyor")))
