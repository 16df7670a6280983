"""Test shim (PYTHONPATH, tests/reliability only): no DNS queries leave this process.

Fuzzed inventories name random hosts; ddp-launch resolves the master's address. Here any name that is
not an IP literal or localhost fails to resolve at once, as an unknown name would, without a query.
"""

import ipaddress
import socket

_getaddrinfo = socket.getaddrinfo


def _local_only(host, *args, **kwargs):
    name = host.decode() if isinstance(host, bytes) else host
    if name is not None and name != "localhost":
        try:
            ipaddress.ip_address(name)
        except ValueError:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known (test: no DNS)") from None
    return _getaddrinfo(host, *args, **kwargs)


socket.getaddrinfo = _local_only
