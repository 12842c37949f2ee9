"""Two "hosts" on one machine: network namespaces joined by a veth pair (root needed; skipped otherwise)."""

import os
import shutil
import socket
import subprocess

ADDRESSES = ("10.77.0.1", "10.77.0.2")


def _ip(*args):
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=False)


class NetnsPair:
    """Namespaces ``names[i]`` holding ``ADDRESSES[i]``; this machine's host name resolves to that address inside
    each (``/etc/netns/<name>/hosts``), as it would on a real host."""

    def __init__(self, tag):
        self.names = (f"kp{tag}a", f"kp{tag}b")

    def up(self):
        if shutil.which("ip") is None:
            return "the 'ip' command is not installed"
        a, b = self.names
        result = _ip("netns", "add", a)
        if result.returncode != 0:
            return f"network namespaces are not permitted here ({result.stderr.strip()})"
        steps = [("netns", "add", b), ("link", "add", f"{a}v", "type", "veth", "peer", "name", f"{b}v"),
                 ("link", "set", f"{a}v", "netns", a), ("link", "set", f"{b}v", "netns", b)]
        for name, address in zip(self.names, ADDRESSES):
            steps += [("-n", name, "addr", "add", f"{address}/24", "dev", f"{name}v"),
                      ("-n", name, "link", "set", f"{name}v", "up"), ("-n", name, "link", "set", "lo", "up")]
        for step in steps:
            result = _ip(*step)
            if result.returncode != 0:
                self.down()
                return f"could not set up the namespaces: ip {' '.join(step)}: {result.stderr.strip()}"
        for name, address in zip(self.names, ADDRESSES):
            os.makedirs(f"/etc/netns/{name}", exist_ok=True)
            with open(f"/etc/netns/{name}/hosts", "w", encoding="utf-8") as f:
                f.write(f"127.0.0.1 localhost\n{address} {socket.gethostname()}\n")
        return None

    def down(self):
        for name in self.names:
            _ip("netns", "del", name)
            shutil.rmtree(f"/etc/netns/{name}", ignore_errors=True)

    def command(self, index, argv):
        return ["ip", "netns", "exec", self.names[index]] + list(argv)
