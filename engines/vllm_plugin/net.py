"""Which hosts count as this machine: the one rule for servers (dev mode) and the plugin."""

from __future__ import annotations

import ipaddress


def is_loopback(host: str) -> bool:
    """True for localhost and loopback IP addresses (127.0.0.0/8, ::1); False for names."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
