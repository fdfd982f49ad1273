"""The importer's one error type."""

from __future__ import annotations

from flare_airflow.core.errors import ConfigError


class NvflareJobError(ConfigError):
    """An NVFlare job folder cannot be imported (every problem is named with its file and line)."""
