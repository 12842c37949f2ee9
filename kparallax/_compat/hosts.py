"""The host-name requirement of Horovod's Gloo process sets.

Workaround for: Horovod 0.28.1 with Gloo. Its process sets (the global one included) build their Gloo contexts on
the address this host's *name* resolves to, ignoring ``HOROVOD_GLOO_IFACE``. Symptom without the check: on a
multi-host cluster where the name resolves to 127.0.x.x, the workers hang in Horovod's initialization instead of
failing.
"""

import socket


def hostname_problem(cluster_address, multi_host):
    """A message if this host's name cannot serve Horovod's process sets across hosts, else None."""
    if not multi_host:
        return None
    name = socket.gethostname()
    try:
        address = socket.gethostbyname(name)
    except OSError:
        address = None
    if address is None or address.startswith("127."):
        return (f"this host's name {name!r} resolves to {address or 'nothing'}; Horovod's Gloo process sets connect "
                f"through that address, so on a multi-host cluster it must resolve to this host's cluster address "
                f"{cluster_address} (fix /etc/hosts or DNS). Received: {name} -> {address}.")
    return None
