"""Tenant files (docs/tenants.md) for the servers the tests start."""
from __future__ import annotations

import json


def write_tenants(path, tenants: list[dict]) -> str:
    """Write ``{"tenants": tenants}`` to ``path`` (a ``pathlib.Path``); returns the path as text,
    for ``--tenants-file``."""
    path.write_text(json.dumps({"tenants": tenants}))
    return str(path)
