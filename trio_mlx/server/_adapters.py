"""A request's `model` field: the served model, or one of the named LoRA adapters over it.

`--adapter NAME=PATH` serves adapters beside the model (`ActorTuning.adapters`); a
request picks one by naming it as its model, `NAME` or `BASE:NAME` (BASE the served
model's id, as /v1/models lists it), as vLLM's LoRA modules are named. With `--models`
(`Settings.models`) every listed model is served by its name, and a request picks its
engine by it (`pick_model`); `--model-adapter MODEL:NAME=PATH` serves adapters over one of
them, picked as `MODEL:NAME` only (two models may have adapters of one name). A name that is
neither goes through `--model-alias PATTERN=TARGET` (`Settings.model_aliases`: globs, the
first match wins), for clients that ask for a name of their own (Claude Code's
`claude-...` models, a `gpt-...` default). Any other name is a 404 `model_not_found` in
the API's own error shape: a name that merely looks like an adapter's (`BASE:...`) gets
the same answer, with the adapters the server has.
"""

from __future__ import annotations

import fnmatch
from typing import Any

from ._http import HTTPError


def pick_adapter(settings: Any, name: str | None) -> str | None:
    """The adapter a request's model field picks (None: the model alone, also for a
    request that names no model), or HTTPError 404 for a name the server does not serve."""
    if name is None:
        return None
    if (served := settings.serves(name)) is not False:
        return served
    for alias in settings.model_aliases:
        pattern, _, target = alias.partition("=")
        if fnmatch.fnmatchcase(name, pattern):  # the target is served (`Settings` checks it)
            return settings.serves(target) or None
    base, adapters = settings.served_model_name, settings.tuning.adapter_map
    if settings.models:
        listed = ", ".join(repr(m) for m in settings.model_table)
        named = [f"{m}:{a}" for m, over in settings.model_adapter_map.items() for a in over]
        if named:
            listed += " and the adapters " + ", ".join(repr(a) for a in named)
        raise HTTPError(404, f"the model {name!r} does not exist; this server serves {listed}", param="model",
                        code="model_not_found")
    if adapters:
        listed = ", ".join(repr(a) for a in adapters)
        raise HTTPError(404, f"the model {name!r} does not exist; this server serves {base!r} and the adapters "
                        f"{listed} over it (as NAME or {base}:NAME)", param="model", code="model_not_found")
    raise HTTPError(404, f"the model {name!r} does not exist; this server serves {base!r}", param="model",
                    code="model_not_found")


def pick_model(settings: Any, name: str | None) -> str:
    """With `--models`: the model a request's model field names, itself or through an alias
    (the first model for a request that names none); check it with `pick_adapter` first."""
    if name is None:
        return str(settings.served_model_name)
    if settings.serves(name) is False:
        for alias in settings.model_aliases:
            pattern, _, target = alias.partition("=")
            if fnmatch.fnmatchcase(name, pattern):
                name = target
                break
    if name in settings.model_table:
        return name
    return name.rpartition(":")[0] if settings.serves(name) else name  # MODEL:NAME, an adapter's


def answered_as(settings: Any, adapter: str | None, requested: str | None = None) -> str:
    """The model id a response names: the adapter's (as /v1/models lists it), or the model's
    (with `--models`, the one the request's model field picked, `MODEL:NAME` for its adapter)."""
    if settings.models:
        model = pick_model(settings, requested)
        return f"{model}:{adapter}" if adapter is not None else model
    return settings.served_model_name if adapter is None else adapter
