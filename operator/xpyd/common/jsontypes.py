"""The JSON alias: a decoded JSON object (Kubernetes objects, HTTP bodies, reports)."""

from typing import Any

JSON = dict[str, Any]
