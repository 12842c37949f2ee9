"""An emulated cluster network on one machine: one network namespace per "host", all joined by a bridge.

Each host ``i`` is a namespace holding ``address(i)`` (10.78.<net>.<i+1>/24) on a veth whose peer is a port of a
bridge in the root namespace (the bridge holds ``gateway`` = 10.78.<net>.254, so processes here can serve the hosts).
With a ``rate`` (e.g. ``"1gbit"``), both directions of every host's link are limited by a token bucket (``tc tbf``
on the host side for what it sends, on the bridge port for what it receives), like one NIC per machine on a switch.
This machine's host name resolves to the host's own address inside each namespace (``/etc/netns/<ns>/hosts``), as
on a real host. ``link_bytes()`` reads each host link's two directions from the bridge ports' counters (the busiest
one bounds a step from below), ``sent_bytes(links)`` sums what all hosts put on the wire in such a snapshot; traffic
between processes of the same host stays on its loopback and is not counted, as on a real cluster.

Needs root (``ip netns``) and ``tc``; ``up()`` returns the reason when it cannot build the network.
"""

import os
import re
import shutil
import socket
import subprocess

RATE = re.compile(r"^(\d+(?:\.\d+)?)(kbit|mbit|gbit)$")


def parse_rate(text):
    """``"1gbit"`` -> bits per second; None for ``"none"``/``"unlimited"``. Raises ValueError otherwise."""
    if text in ("none", "unlimited"):
        return None
    match = RATE.match(text.lower())
    if not match:
        raise ValueError(f"a link rate looks like 100mbit, 1gbit or 10gbit (or 'unlimited'). Received: {text!r}.")
    return float(match.group(1)) * {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9}[match.group(2)]


def _run(*argv):
    return subprocess.run(list(argv), capture_output=True, text=True, check=False)


class Network:
    """``hosts`` namespaces on a bridge; ``rate`` in bits/s per direction per host link, or None (unlimited)."""

    def __init__(self, hosts, rate=None, net=None):
        self.hosts, self.rate = hosts, rate
        self.net = net if net is not None else os.getpid() % 200 + 20
        tag = f"kpn{self.net}"
        self.bridge = f"{tag}br"
        self.names = [f"{tag}h{i}" for i in range(hosts)]
        self.ports = [f"{tag}p{i}" for i in range(hosts)]       # bridge side (root namespace)
        self.interfaces = [f"{tag}v{i}" for i in range(hosts)]  # host side (inside namespace i)
        self.gateway = f"10.78.{self.net}.254"

    def address(self, index):
        return f"10.78.{self.net}.{index + 1}"

    def up(self):
        """Builds the network; returns None, or the reason it cannot be built (everything is removed again)."""
        if shutil.which("ip") is None or (self.rate and shutil.which("tc") is None):
            return "the 'ip' and 'tc' commands are needed (iproute2)"
        self.down()  # leftovers of an earlier run killed before it could clean up
        first = _run("ip", "netns", "add", self.names[0])
        if first.returncode != 0:
            return f"network namespaces are not permitted here ({first.stderr.strip()})"
        steps = [("ip", "link", "add", self.bridge, "type", "bridge"),
                 ("ip", "addr", "add", f"{self.gateway}/24", "dev", self.bridge),
                 ("ip", "link", "set", self.bridge, "up")]
        for i, (name, port, inner) in enumerate(zip(self.names, self.ports, self.interfaces)):
            steps += ([("ip", "netns", "add", name)] if i else []) + [
                ("ip", "link", "add", port, "type", "veth", "peer", "name", inner),
                ("ip", "link", "set", inner, "netns", name),
                ("ip", "link", "set", port, "master", self.bridge),
                ("ip", "link", "set", port, "up"),
                ("ip", "-n", name, "addr", "add", f"{self.address(i)}/24", "dev", inner),
                ("ip", "-n", name, "link", "set", inner, "up"),
                ("ip", "-n", name, "link", "set", "lo", "up")]
            if self.rate:
                shape = ["tbf", "rate", f"{int(self.rate)}bit", "burst", "256kb", "latency", "50ms"]
                steps += [("tc", "-n", name, "qdisc", "add", "dev", inner, "root", *shape),
                          ("tc", "qdisc", "add", "dev", port, "root", *shape)]
        for step in steps:
            result = _run(*step)
            if result.returncode != 0:
                self.down()
                return f"could not build the emulated network: {' '.join(step)}: {result.stderr.strip()}"
        for i, name in enumerate(self.names):
            os.makedirs(f"/etc/netns/{name}", exist_ok=True)
            with open(f"/etc/netns/{name}/hosts", "w", encoding="utf-8") as f:
                f.write(f"127.0.0.1 localhost\n{self.address(i)} {socket.gethostname()}\n")
        return None

    def down(self):
        for name in self.names:
            _run("ip", "netns", "del", name)
            shutil.rmtree(f"/etc/netns/{name}", ignore_errors=True)
        for port in self.ports:
            _run("ip", "link", "del", port)
        _run("ip", "link", "del", self.bridge)

    def command(self, index, argv):
        """``argv`` run on host ``index``."""
        return ["ip", "netns", "exec", self.names[index]] + list(argv)

    @staticmethod
    def sent_bytes(links):
        """Bytes all hosts have sent on their links, from a ``link_bytes()`` snapshot."""
        return sum(sent for sent, _ in links)

    def link_bytes(self):
        """(sent, received) bytes so far of each host's link, in host order (the bridge port's rx and tx)."""
        counts = []
        for port in self.ports:
            pair = []
            for counter in ("rx_bytes", "tx_bytes"):
                with open(f"/sys/class/net/{port}/statistics/{counter}", encoding="utf-8") as f:
                    pair.append(int(f.read()))
            counts.append(tuple(pair))
        return counts


def loopback_sent_bytes():
    """Bytes sent over this namespace's loopback so far (every task of a local run talks over it)."""
    with open("/proc/net/dev", encoding="utf-8") as f:
        for line in f:
            name, _, data = line.partition(":")
            if name.strip() == "lo":
                return int(data.split()[8])
    raise OSError("no loopback interface in /proc/net/dev")
