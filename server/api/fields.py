"""The JSON-value checks every front end's parser is made of, and the policy of which top-level
fields a route takes (:class:`FieldPolicy`).

Each check takes the path of the value in the request as the client sent it (``param``, or a
``where`` prefix such as ``stream_options.``), so a refusal (:class:`engine.errors.InvalidRequest`)
names the client's own field. Numeric bounds that the engine's types also hold come from them
as data (``engine.request.SamplingParams.bounds``, ``DEADLINE_MS_BOUNDS``, ``LOGIT_BIAS_BOUNDS``).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

import ujson

from engine.errors import InvalidRequest
from engine.request import Priority


def shown(value, limit: int = 40) -> str:
    """A request value for an error message: JSON (a plain int as written), cut to ``limit``
    characters."""
    plain_int = isinstance(value, int) and not isinstance(value, bool)
    text = str(value) if plain_int else json.dumps(value, ensure_ascii=False)
    return text if len(text) <= limit else text[:limit] + "..."


def same(a, b) -> bool:
    """Equal as JSON values (``False`` is not ``0``)."""
    return type(a) is type(b) and a == b


def check_number(param: str, value, lo=None, hi=None, lo_open: bool = False, integer: bool = False):
    """``value`` as an int (``integer``) or a float, if it is a finite JSON number within
    ``[lo, hi]`` (``(lo, hi]`` when ``lo_open``; None: unbounded). Bounds are compared before any
    conversion, so a 400-digit integer never overflows a float.

    Raises:
        InvalidRequest: naming ``param``.
    """
    kind = "an integer" if integer else "a number"
    if isinstance(value, bool) or not isinstance(value, (int, float)) or \
            (isinstance(value, float) and not math.isfinite(value)) or \
            (integer and isinstance(value, float) and not value.is_integer()):
        raise InvalidRequest(f"{param} must be {kind}, got {shown(value)}", param)
    if (lo is not None and (value < lo or (lo_open and value == lo))) or (hi is not None and value > hi):
        if hi is None:
            bound = f"more than {lo}" if lo_open else f"at least {lo}"
        elif lo is None:
            bound = f"at most {hi}"
        else:
            bound = "in " + (f"({lo}, {hi}]" if lo_open else f"[{lo}, {hi}]")
        raise InvalidRequest(f"{param} must be {bound}, got {shown(value)}", param)
    return int(value) if integer else float(value)


def number(body: dict, name: str, *, where: str = "", default=None, **bounds):
    """Field ``name`` of ``body`` checked by :func:`check_number` with ``bounds`` (``lo``,
    ``hi``, ``lo_open``, ``integer``); ``default`` when absent or null. ``where``: the path of
    ``body`` in the request (``stream_options.``)."""
    value = body.get(name)
    return default if value is None else check_number(f"{where}{name}", value, **bounds)


def boolean(body: dict, name: str, default: bool = False, where: str = "") -> bool:
    """``body[name]`` (absent or null: ``default``); ``where`` as :func:`number`'s."""
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise InvalidRequest(f"{where}{name} must be a boolean, got {ujson.dumps(value)}", f"{where}{name}")
    return value


def string(body: dict, name: str, where: str = "") -> str | None:
    """``body[name]``, a string or absent (None)."""
    value = body.get(name)
    if value is not None and not isinstance(value, str):
        raise InvalidRequest(f"{where}{name} must be a string", f"{where}{name}")
    return value


def priority(value, param: str = "priority") -> Priority:
    """``"high" | "normal" | "low"`` (None: normal) -> :class:`engine.request.Priority`.

    Raises:
        InvalidRequest: anything else, naming ``param``.
    """
    if value is None:
        return Priority.NORMAL
    if isinstance(value, str) and value.upper() in Priority.__members__:
        return Priority[value.upper()]
    names = ", ".join(p.name.lower() for p in Priority)
    raise InvalidRequest(f"{param} must be one of {names}, got {shown(value)}", param)


#: OpenAI's ``service_tier`` values: any is accepted, none changes how this server runs a request.
SERVICE_TIERS = ("auto", "default", "flex", "scale", "priority")


@dataclass(frozen=True)
class FieldPolicy:
    """Which top-level fields a route takes, and how it takes those it does not implement.

    Attributes:
        fields: every field the route takes; any other is refused ("Unrecognized request
            argument supplied"), never silently ignored.
        default_only: field -> (values served, why another value is refused): a field at one of
            these values (or null) changes nothing; any other asks for a feature this server
            does not implement.
        informational: field -> its JSON type (``str``, ``dict``): accepted, without effect
            here, but still typed as OpenAI's, so a client's mistake is seen. ``service_tier``
            is one of :data:`SERVICE_TIERS` and ``metadata`` OpenAI's string map when taken.
    """

    fields: frozenset[str]
    default_only: dict = field(default_factory=dict)
    informational: dict = field(default_factory=dict)

    def check(self, body: dict) -> None:
        """Raise for the first field ``body`` may not hold as it does.

        Raises:
            InvalidRequest: naming the field.
        """
        unknown = sorted(set(body) - self.fields)
        if unknown:
            raise InvalidRequest(f"Unrecognized request argument supplied: {unknown[0]}", unknown[0])
        for name, (served, why) in self.default_only.items():
            value = body.get(name)
            if value is not None and not any(same(value, v) for v in served):
                raise InvalidRequest(why, name)
        for name, kind in self.informational.items():
            value = body.get(name)
            if value is not None and not isinstance(value, kind):
                raise InvalidRequest(f"{name} must be a {kind.__name__.replace('str', 'string')}", name)
        if body.get("service_tier") not in (None, *SERVICE_TIERS):
            raise InvalidRequest(f"service_tier must be one of {', '.join(SERVICE_TIERS)}", "service_tier")
        metadata = body.get("metadata")
        if metadata is not None and not (isinstance(metadata, dict) and len(metadata) <= 16 and all(
                isinstance(k, str) and len(k) <= 64 and isinstance(v, str) and len(v) <= 512
                for k, v in metadata.items())):
            raise InvalidRequest("metadata must be an object of at most 16 string pairs (keys <= 64, values <= 512 "
                                 "characters)", "metadata")
