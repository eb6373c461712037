"""Small files that another process polls for (port files, ready files, announcements): written
whole or not at all, so that a reader never sees half of one."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def write_json_whole(path: Path, value: Any) -> None:
    """Replace `path` with `value` as JSON, through a sibling file renamed over it."""
    part = path.with_name(path.name + ".part")
    part.write_text(json.dumps(value))
    part.replace(path)
