"""Where every benchmark writes its JSON: ``<out>/<name>-<yyyymmdd-hhmmss>.json``."""

from __future__ import annotations

import json
import time
from pathlib import Path


def write_result(out_dir: str | Path, name: str, result: dict) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(result, indent=2))
    print(f"wrote {path}")
    return path
