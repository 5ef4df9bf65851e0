"""The JSON files a user hands the offline tools (rename maps, sharding specs, stage maps, parameter orders):
each read as one JSON object, with errors that name the file and what it was given as."""

from __future__ import annotations

import json
from typing import Any


def read_json_object(path: str, what: str, expected: str) -> dict[str, Any]:
    """The JSON object in ``path``, the user's ``what`` (e.g. ``"sharding spec"``); ValueError naming the file when
    it cannot be read as JSON or holds no object (``expected`` says what it should hold)."""
    try:
        with open(path) as f:
            doc = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"{what} {path} could not be read as JSON: {e}") from e
    if not isinstance(doc, dict):
        raise ValueError(f"{what} {path} must be {expected}")
    return doc
