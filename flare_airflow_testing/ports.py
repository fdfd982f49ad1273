"""Free TCP ports on loopback for the real components the tests start."""

from __future__ import annotations

import socket


def free_port(preferred: int | None = None) -> int:
    """``preferred`` when it can be bound on 127.0.0.1, otherwise a free ephemeral port."""
    if preferred:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", preferred))
                return preferred
            except OSError:
                pass
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
