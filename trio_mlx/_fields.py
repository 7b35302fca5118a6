"""Settings records as text: each field's TRIO_MLX_* variable, and a flag's or variable's value parsed.

The settings records (`server/_settings.Settings`, the `actor/_tuning.ActorTuning` it nests)
are frozen dataclasses whose fields carry their help text in metadata (`doc`). Everything a field is outside Python derives from it
here: its variable is TRIO_MLX_ and its name in capitals, and its text form is parsed by
its annotation. No MLX, nothing of the package: every layer
may import it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

ENV_PREFIX = "TRIO_MLX_"


def doc(text: str, **extra: Any) -> dict[str, Any]:
    """A field's metadata: its help text (flags, docs), and markers such as `secret=True`."""
    return {"doc": text, **extra}


def env_name(field_name: str) -> str:
    return ENV_PREFIX + field_name.upper()


def field_kind(f: dataclasses.Field[Any]) -> str:
    """"str", "int", "float", "bool" or "tuple" (the annotation, as text: `from __future__`)."""
    ann = str(f.type).replace(" | None", "")
    return {"tuple[str, ...]": "tuple"}.get(ann, ann)


def parse_value(f: dataclasses.Field[Any], raw: str) -> Any:
    """One setting from its text form (an environment variable or a flag)."""
    kind = field_kind(f)
    text = raw.strip()
    optional = "None" in str(f.type)
    if optional and text == "":
        return None
    if kind == "bool":
        low = text.lower()
        if low in ("1", "true", "yes", "on"):
            return True
        if low in ("0", "false", "no", "off", ""):
            return False
        raise ValueError(f"expected a boolean (1/0, true/false, yes/no, on/off), got {raw!r}")
    if kind == "int":
        try:
            return int(text)
        except ValueError:
            raise ValueError(f"expected an integer, got {raw!r}") from None
    if kind == "float":
        try:
            return float(text)
        except ValueError:
            raise ValueError(f"expected a number, got {raw!r}") from None
    if kind == "tuple":
        return tuple(part.strip() for part in text.split(",") if part.strip())
    return raw


def read_environ(fields: tuple[dataclasses.Field[Any], ...], environ: Mapping[str, str],
                 skip: Mapping[str, Any] = {}) -> dict[str, Any]:
    """The values of `fields` set in `environ`, parsed, leaving out those named in `skip`
    (never parsed: a flag that wins over a bad variable does not fail on it). A bad value
    names its variable."""
    values: dict[str, Any] = {}
    for f in fields:
        var = env_name(f.name)
        if var in environ and f.name not in skip:
            try:
                values[f.name] = parse_value(f, environ[var])
            except ValueError as exc:
                raise ValueError(f"{var}: {exc}") from None
    return values
