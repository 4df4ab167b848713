"""``GET /v1/organization/usage/completions`` and ``/usage/embeddings``: the usage buckets
(``server/control/store.py``) as OpenAI's ``UsageResponse`` page of ``UsageTimeBucket``s of
``UsageCompletionsResult``s (generation models' requests) or ``UsageEmbeddingsResult``s
(embedding models').

Parameters (OpenAI's): ``start_time`` (required, unix seconds, inclusive), ``end_time``
(exclusive, default now), ``bucket_width`` (``1m``, ``1h``, ``1d``; default ``1d``), filters
``project_ids``, ``api_key_ids``, ``models`` (repeated, or ``name[]``), ``group_by``
(``project_id``, ``api_key_id``, ``model``; completions also ``batch``, and the ``batch`` filter:
every request here is a non-batch one), ``user_ids`` and ``group_by=user_id`` refused (this
server has no users),
``limit`` (buckets a page: 1d up to 31, default 7; 1h up to 168, default 24; 1m up to 1440,
default 60) and ``page`` (the cursor a page's ``next_page`` gives). Buckets start at multiples
of their width in UTC; ``start_time`` inside a bucket starts from that bucket.
"""
from __future__ import annotations

import time

from engine.errors import InvalidRequest
from server.api.fields import shown
from server.control.store import WIDTHS, bucket_start

_LIMITS = {"1d": (7, 31), "1h": (24, 168), "1m": (60, 1440)}
_GROUPS = {"completions": ("project_id", "api_key_id", "model", "batch"),
           "embeddings": ("project_id", "api_key_id", "model")}
_PARAMS = {"start_time", "end_time", "bucket_width", "project_ids", "api_key_ids", "models", "group_by",
           "limit", "page", "user_ids"}
#: Each API's own parameters beyond :data:`_PARAMS`.
_OWN_PARAMS = {"completions": {"batch"}, "embeddings": set()}
#: The parameters that take several values (repeated, ``name[]``, or comma-separated).
_LISTS = {"project_ids", "api_key_ids", "models", "group_by", "user_ids"}


def _one(params: dict, name: str) -> str | None:
    values = params.get(name)
    if values is None:
        return None
    if isinstance(values, list):
        if len(values) != 1:
            raise InvalidRequest(f"{name} must be given once", name)
        values = values[0]
    return values


def _int(params: dict, name: str, lo: int, hi: int) -> int | None:
    value = _one(params, name)
    if value is None:
        return None
    if not (value.isascii() and value.isdigit()):
        raise InvalidRequest(f"{name} must be an integer, got {shown(value)}", name)
    n = int(value)
    if not lo <= n <= hi:
        raise InvalidRequest(f"{name} must be in [{lo}, {hi}], got {n}", name)
    return n


def _list(params: dict, name: str) -> list[str] | None:
    values = []
    for key in (name, name + "[]"):
        v = params.get(key)
        if v is not None:
            values += v if isinstance(v, list) else [v]
    return [x for v in values for x in v.split(",") if x] if values else None


def usage_page(store, params: dict, now: float | None = None, api: str = "completions",
               model_of: dict[str, str] | None = None) -> dict:
    """The page of usage API ``api`` (``completions`` or ``embeddings``) for query ``params``
    (``{name: str | [str]}``, as Falcon parses a query). ``model_of``: each name a model is
    served under -> the id its usage is recorded under, so that ``models`` may name any of them.

    Raises:
        InvalidRequest: a parameter out of range or unknown, naming it.
    """
    now = time.time() if now is None else now
    for name in params:
        if name.removesuffix("[]") not in _PARAMS | _OWN_PARAMS[api]:
            raise InvalidRequest(f"unknown query parameter {shown(name)}", name)
        if name.endswith("[]") and name[:-2] not in _LISTS:
            raise InvalidRequest(f"{name[:-2]} takes one value: give it as {name[:-2]}=", name[:-2])
    if params.get("user_ids") is not None or params.get("user_ids[]") is not None:
        raise InvalidRequest("user_ids: this server has no users; filter by project_ids or api_key_ids", "user_ids")
    width = _one(params, "bucket_width") or "1d"
    if width not in WIDTHS:
        raise InvalidRequest(f"bucket_width must be 1m, 1h or 1d, got {shown(width)}", "bucket_width")
    start = _int(params, "start_time", 0, 10 ** 11)
    if start is None:
        raise InvalidRequest("start_time is required (unix seconds)", "start_time")
    end = _int(params, "end_time", 0, 10 ** 11)
    if end is not None and end < start:
        raise InvalidRequest(f"end_time ({end}) is before start_time ({start})", "end_time")
    end = int(now) + 1 if end is None else end
    default, most = _LIMITS[width]
    limit = _int(params, "limit", 1, most) or default
    first = bucket_start(start, width)
    page = _one(params, "page")
    if page is not None:
        if not (page.isascii() and page.isdigit()):
            raise InvalidRequest(f"page: not a cursor this server gave, {shown(page)}", "page")
        first = int(page)
        if first % WIDTHS[width] or first < bucket_start(start, width):
            raise InvalidRequest(f"page: not a cursor of this query, {shown(page)}", "page")
    group_by = _list(params, "group_by") or []
    for g in group_by:
        if g == "user_id":
            raise InvalidRequest("group_by: this server has no users; group by project_id or api_key_id", "group_by")
        if g not in _GROUPS[api]:
            raise InvalidRequest(f"group_by: {shown(g)} is not one of {', '.join(_GROUPS[api])}", "group_by")
    batch = _one(params, "batch")
    if batch not in (None, "true", "false"):
        raise InvalidRequest(f"batch must be true or false, got {shown(batch)}", "batch")
    models = _list(params, "models")
    filters = {"project_id": _list(params, "project_ids"), "api_key_id": _list(params, "api_key_ids"),
               "model": None if models is None else [(model_of or {}).get(m, m) for m in models]}
    step = WIDTHS[width]
    starts = list(range(first, end, step)[:limit + 1])  # a range's slice: never the whole span
    more = len(starts) > limit
    starts = starts[:limit]
    rows = store.usage(width, starts, api)
    data = []
    for s in starts:
        results: dict[tuple, list[int]] = {}
        for (project, key, model), counts in rows.get(s, {}).items():
            who = {"project_id": project, "api_key_id": key or None, "model": model}
            if batch == "true" or any(f is not None and who[n] not in f for n, f in filters.items()):
                continue
            group = tuple(who.get(g) for g in group_by)
            total = results.setdefault(group, [0, 0, 0, 0])
            for i, n in enumerate(counts):
                total[i] += n
        data.append({"object": "bucket", "start_time": s, "end_time": s + step,
                     "results": [_RESULTS[api](dict(zip(group_by, group)), counts)
                                 for group, counts in results.items()]})
    return {"object": "page", "data": data, "has_more": more, "next_page": str(s + step) if more else None}


def _result(group: dict, counts: list[int]) -> dict:
    input_tokens, output_tokens, cached, requests = counts
    return {"object": "organization.usage.completions.result", "input_tokens": input_tokens,
            "output_tokens": output_tokens, "input_cached_tokens": cached,
            "input_uncached_tokens": input_tokens - cached, "input_audio_tokens": 0, "output_audio_tokens": 0,
            "num_model_requests": requests, "project_id": group.get("project_id"), "user_id": None,
            "api_key_id": group.get("api_key_id"), "model": group.get("model"),
            "batch": False if "batch" in group else None}


def _embeddings_result(group: dict, counts: list[int]) -> dict:
    input_tokens, _, _, requests = counts
    return {"object": "organization.usage.embeddings.result", "input_tokens": input_tokens,
            "num_model_requests": requests, "project_id": group.get("project_id"), "user_id": None,
            "api_key_id": group.get("api_key_id"), "model": group.get("model")}


_RESULTS = {"completions": _result, "embeddings": _embeddings_result}
