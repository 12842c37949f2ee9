"""Network probes and free ports shared by the launcher and the workers (no TensorFlow, no Horovod)."""

import random
import socket
import time

_EPHEMERAL_RANGE = "/proc/sys/net/ipv4/ip_local_port_range"
_PICKED = set()  # ports this process handed out: each once
# Not the ``random`` module's shared state: a program seeding it (``tf.keras.utils.set_random_seed``) would make every
# worker on a host pick the same ports.
_RANDOM = random.SystemRandom()


def probe(address, timeout):
    """None if ``host:port`` accepts a TCP connection within ``timeout`` seconds, else the OSError."""
    host, port = address.rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port)), timeout=timeout):
            return None
    except OSError as e:
        return e


def wait_ps_reachable(ps_addresses, timeout):
    """Waits until every PS task accepts TCP connections; raises ConnectionError naming the first that does not."""
    deadline = time.monotonic() + timeout
    for i, address in enumerate(ps_addresses):
        while True:
            error = probe(address, timeout=min(2.0, timeout))
            if error is None:
                break
            if time.monotonic() > deadline:
                raise ConnectionError(
                    f"Parameter server ps[{i}] at {address} is not reachable after {timeout:.0f} s ({error}). "
                    "Check that the PS task is running and that the address is right. "
                    f"Received: ps={list(ps_addresses)}.")
            time.sleep(0.2)


def is_local_host(host):
    """Whether ``host`` (a name or address) is this machine: loopback, this host's name, or one of its addresses."""
    host = host.strip("[]")
    if host in ("localhost", "::1") or host.startswith("127."):
        return True
    if host in (socket.gethostname(), socket.getfqdn()):
        return True
    try:
        address = socket.gethostbyname(host)
    except OSError:
        return False
    return address.startswith("127.") or interface_of(address) is not None


def job_on_one_host(addresses):
    """Whether every ``host:port`` in ``addresses`` names the same host (loopback names count as one host)."""
    hosts = set()
    for address in addresses:
        host = address.rsplit(":", 1)[0].strip("[]")
        hosts.add("localhost" if host in ("localhost", "::1") or host.startswith("127.") else host)
    return len(hosts) <= 1


def interface_of(address):
    """The network interface holding ``address`` on this host (``lo`` for loopback), or None."""
    try:
        ip = socket.gethostbyname(address)
    except OSError:
        return None
    if ip.startswith("127."):
        return "lo"
    try:
        import fcntl  # pylint: disable=import-outside-toplevel
        import struct  # pylint: disable=import-outside-toplevel
        for _, name in socket.if_nameindex():
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                try:
                    packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name[:15].encode()))  # SIOCGIFADDR
                except OSError:
                    continue
            if socket.inet_ntoa(packed[20:24]) == ip:
                return name
    except OSError:
        return None
    return None


def _ephemeral_range():
    """The ports the kernel gives outgoing connections (Linux: 32768-60999 by default)."""
    try:
        with open(_EPHEMERAL_RANGE, encoding="ascii") as f:
            low, high = (int(part) for part in f.read().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999


def free_port():
    """A TCP port no socket on this host holds now, outside the kernel's ephemeral range.

    A server's port chosen by binding port 0 (``portpicker``) lies in the ephemeral range, where any outgoing
    connection of any process (a worker reaching a PS task) may take it as its source port before the server binds
    it: a worker once failed to start its TensorFlow server, "Address already in use", in CI. Ports below the range
    are taken only by servers binding them.

    Raises:
      RuntimeError: no free port was found in 200 tries.
    """
    low, high = _ephemeral_range()
    pool = (15000, low - 1) if low - 15000 >= 2000 else (high + 1, 65535)
    for _ in range(200):
        port = _RANDOM.randint(*pool)
        if port in _PICKED:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("", port))
            except OSError:
                continue
        _PICKED.add(port)
        return port
    raise RuntimeError(f"No free TCP port found in {pool[0]}-{pool[1]} after 200 tries. "
                       f"Received: ephemeral port range {low}-{high} ({_EPHEMERAL_RANGE}).")
