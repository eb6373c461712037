"""`--set PATH=VALUE`: edits to a parsed manifest made before it is validated, so that the
edited job is checked exactly as the file would be (`kiln run`, `kiln validate`, `kiln
simulate`).

PATH is written as `kiln validate` names fields: from the manifest's root, keys joined by dots,
list items by `[index]` (`spec.stages[1].rl.groupSize`); a key holding a dot is escaped
(`metadata.labels.app\\.kubernetes\\.io/name`). VALUE is read as YAML (`8` is a number, `true` a
boolean, `null` unsets an optional field, `[a, b]` a list; quote it to keep a string:
`'"8"'`). A missing mapping on the way is created; a list index must exist (there is no
"append": the order of stages and task sets means something).

Not covered: removing a key (set it to `null`), and selecting a list item by its name.
"""
from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import yaml

# One step of a path: a key (dots inside it escaped as `\.`), then any number of `[i]`.
_STEP = re.compile(r"((?:[^.\[\]\\]|\\.)+)((?:\[[^\]]*\])*)")
_INDEX = re.compile(r"\[([^\]]*)\]")

Path = tuple[str | int, ...]


class OverrideError(ValueError):
    """A `--set` that cannot apply: `setting` is what was given, the message says why."""

    def __init__(self, setting: str, reason: str):
        self.setting = setting
        super().__init__(f"--set {setting}: {reason}")


def format_path(path: Path) -> str:
    """`spec.stages[1].rl.groupSize`, as `kiln validate` names fields."""
    out = ""
    for part in path:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            key = part.replace(".", "\\.")
            out += f".{key}" if out else key
    return out


def parse_path(text: str, setting: str) -> Path:
    """The keys and indexes of a PATH; OverrideError naming it when it is not one."""
    parts: list[str | int] = []
    pos = 0
    while pos < len(text):
        if pos and text[pos] == ".":
            pos += 1
        match = _STEP.match(text, pos)
        if match is None:
            raise OverrideError(setting, f"{text!r} is not a field path (expected keys joined by "
                                         "dots and [index] for list items, as in "
                                         "spec.stages[1].rl.groupSize)")
        parts.append(re.sub(r"\\(.)", r"\1", match.group(1)))
        for index in _INDEX.findall(match.group(2)):
            if not index.isdigit():
                raise OverrideError(setting, f"{text!r}: [{index}] is not a list index (expected "
                                             "a number from 0)")
            parts.append(int(index))
        pos = match.end()
    if not parts:
        raise OverrideError(setting, "no field path before '='")
    return tuple(parts)


def parse_setting(setting: str) -> tuple[Path, Any]:
    """(path, value) of one `PATH=VALUE`; OverrideError when it is neither."""
    text, sep, raw = setting.partition("=")
    if not sep:
        raise OverrideError(setting, "expected PATH=VALUE (e.g. spec.stages[1].rl.groupSize=8)")
    try:
        value = yaml.safe_load(raw)
    except yaml.YAMLError as exc:
        reason = getattr(exc, "problem", None) or str(exc)
        raise OverrideError(setting, f"the value is not valid YAML ({reason}); quote it to "
                                     "set a string") from None
    return parse_path(text.strip(), setting), value


def apply_overrides(data: Any, settings: Sequence[str]) -> list[Path]:
    """Apply each `PATH=VALUE` to the parsed manifest `data` in place, in order; returns the
    paths set. OverrideError naming the path where one cannot apply."""
    paths = []
    for setting in settings:
        path, value = parse_setting(setting)
        node = data
        for depth, part in enumerate(path):
            last = depth == len(path) - 1
            where = format_path(path[:depth]) or "the manifest"
            if isinstance(part, int):
                if not isinstance(node, list):
                    raise OverrideError(setting, f"{format_path(path[:depth + 1])}: {where} is "
                                                 f"not a list (found {_kind(node)})")
                if part >= len(node):
                    raise OverrideError(setting, f"{format_path(path[:depth + 1])}: {where} has "
                                                 f"{len(node)} item(s), indexes 0 to "
                                                 f"{len(node) - 1}")
            elif not isinstance(node, dict):
                hint = (f"; write {where}[{part}] for a list item"
                        if isinstance(node, list) and part.isdigit() else "")
                raise OverrideError(setting, f"{format_path(path[:depth + 1])}: {where} is not "
                                             f"a mapping (found {_kind(node)}){hint}")
            if last:
                node[part] = value
            else:
                if isinstance(part, str) and node.get(part) is None:
                    node[part] = [] if isinstance(path[depth + 1], int) else {}
                node = node[part]
        paths.append(path)
    return paths


def _kind(value: Any) -> str:
    return {dict: "a mapping", list: "a list", type(None): "nothing"}.get(
        type(value), f"the {type(value).__name__} {value!r}")
