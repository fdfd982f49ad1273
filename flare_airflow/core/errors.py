"""Typed errors of the core layer. Every message says what, where and what to do."""

from __future__ import annotations


class FlareAirflowError(Exception):
    """Base class of every error raised by flare-airflow."""


class ConfigError(FlareAirflowError, ValueError):
    """A job configuration is invalid (file, field and site are named in the message)."""


class ModelFormatError(FlareAirflowError):
    """A model artifact is not a valid safetensors file or fails its checksum."""


class StoreError(FlareAirflowError):
    """The model store refused an operation (path outside the root, missing artifact, ...)."""


class UpdateRejected(FlareAirflowError):
    """A site update failed validation against the global model; it does not count."""

    def __init__(self, site: str, reason: str) -> None:
        super().__init__(f"update from site {site!r} rejected: {reason}")
        self.site = site
        self.reason = reason


class QuorumNotReached(FlareAirflowError):
    """Fewer than ``min_clients`` valid updates arrived in a round."""


class AggregateNotFinite(QuorumNotReached):
    """The round's aggregate is not finite (or leaves its dtype's range): the round fails, nothing is published."""


class ClientAPIError(FlareAirflowError):
    """The Client API was used outside a flare-airflow site job or in the wrong order."""


class ReportError(FlareAirflowError):
    """A run's report (``metrics.json``) cannot be read or is not one."""


class RoundInputError(FlareAirflowError):
    """A round's stored input (the previous round's server state, the central-DP release record) is
    missing, unusable, replaced or cannot be written; the message names the file, the round and how to resume."""


class RoundWriteError(StoreError):
    """A round's output (its server state, its global model) cannot be written to the model store
    (full or not writable); the message names the file, the round and how to resume."""
