"""What the machine's loopback offers the serve tests."""

from __future__ import annotations

import socket


def has_ipv6_loopback() -> bool:
    """Whether ::1 can be bound here (some containers have no IPv6)."""
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False
