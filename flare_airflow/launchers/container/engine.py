"""The container engine's command-line contract, shared by the launcher and its handle: how long
one call may take, the exit codes that are the engine's own, and the error an engine call raises."""

from __future__ import annotations

ENGINE_TIMEOUT = 120.0  # s: one engine call (a pull of a large image is bounded by the launch timeout)

# What ``run`` exits with when the engine, not the trainer, failed (docker and podman agree).
ENGINE_EXIT_CODES = (125, 126, 127)


class ContainerEngineError(RuntimeError):
    """An engine call failed (not found, timed out, refused): the engine's own words."""
