"""Which network interface a rank's collectives use across nodes (gloo).

gloo binds each rank to the address its host name resolves to, and falls back to the loopback
interface when that address is not on this machine (a container, a network namespace, a node
whose /etc/hosts names another address). The peers on other nodes then get 127.0.0.1 as this
rank's address and the group never forms ("Gloo connectFullMesh failed ... remote=[127.0.0.1]").
The interface that reaches MASTER_ADDR is the one the other nodes reach too: `interface_towards`
names it, and `init_distributed` hands it to gloo (GLOO_SOCKET_IFNAME, gloo's own setting) unless
the user set one. Linux only (SIOCGIFADDR); elsewhere it finds nothing and gloo's choice stands.

`free_port` (a TCP port free on an address) lives here, below both the executor and the KV
connectors that need one, so that neither imports the other.
"""

from __future__ import annotations

import contextlib
import socket
import struct

SIOCGIFADDR = 0x8915  # <linux/sockios.h>: an interface's (primary) IPv4 address


def interface_towards(addr: str) -> str | None:
    """The name of this machine's interface whose IPv4 address routes to `addr`; None when none
    is found (no route, not IPv4, not Linux). `addr` may be one of this machine's own addresses."""
    try:
        import fcntl
    except ImportError:
        return None
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((addr, 9))  # a UDP connect sends nothing: it only picks the route and source address
            local = s.getsockname()[0]
        except OSError:
            return None
        for _, name in socket.if_nameindex():
            with contextlib.suppress(OSError):
                packed = fcntl.ioctl(s.fileno(), SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
                if socket.inet_ntoa(packed[20:24]) == local:
                    return name
    return None


def free_port(host: str) -> int:
    """A TCP port nothing listens on at `host` now (the OS picks it; another process may take it
    before the caller binds it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
