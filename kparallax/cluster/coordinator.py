"""The job's coordinator: Horovod's Gloo rendezvous server plus a small key-value store on one host.

One process per job serves it (the first host's launcher, or worker 0 under TF_CONFIG), bound to that host's
cluster address. Horovod workers rendezvous there (``HOROVOD_GLOO_RENDEZVOUS_ADDR/PORT``); kparallax uses the same
store for what must be ordered across hosts: the workers' first PS connections (one at a time) and the launchers'
status (running / done / failed), so a failure on one host stops every host.
"""

import json
import os
import socket
import threading
import time
import urllib.error
import urllib.request

from kparallax.cluster import spec

SCOPE = "kparallax"
ENV_COORDINATOR = "KPARALLAX_COORDINATOR"


def slot_plan(hosts_and_counts):
    """Horovod SlotInfo per rank for ``[(hostname, workers), ...]`` in rank order (ranks host by host)."""
    return slot_plan_for_hosts([h for h, n in hosts_and_counts for _ in range(n)])


def slot_plan_for_hosts(hosts):
    """Horovod SlotInfo per rank when rank i runs on ``hosts[i]`` (hosts may repeat in any order, as in TF_CONFIG)."""
    from horovod.runner.common.util.hosts import SlotInfo  # pylint: disable=import-outside-toplevel
    local_ranks = [hosts[:r].count(h) for r, h in enumerate(hosts)]
    slots = []
    for rank, (host, local_rank) in enumerate(zip(hosts, local_ranks)):
        same_local = [r for r, l in enumerate(local_ranks) if l == local_rank]
        slots.append(SlotInfo(hostname=host, rank=rank, local_rank=local_rank, cross_rank=same_local.index(rank),
                              size=len(hosts), local_size=hosts.count(host), cross_size=len(same_local)))
    return slots


def horovod_env(slot, address, port, interface):
    """The ``HOROVOD_*`` variables of one Gloo worker."""
    return {
        "HOROVOD_GLOO_RENDEZVOUS_ADDR": address,
        "HOROVOD_GLOO_RENDEZVOUS_PORT": str(port),
        "HOROVOD_CONTROLLER": "gloo",
        "HOROVOD_CPU_OPERATIONS": "gloo",
        "HOROVOD_GLOO_IFACE": interface,
        "HOROVOD_HOSTNAME": slot.hostname,
        "HOROVOD_RANK": str(slot.rank),
        "HOROVOD_SIZE": str(slot.size),
        "HOROVOD_LOCAL_RANK": str(slot.local_rank),
        "HOROVOD_LOCAL_SIZE": str(slot.local_size),
        "HOROVOD_CROSS_RANK": str(slot.cross_rank),
        "HOROVOD_CROSS_SIZE": str(slot.cross_size),
        ENV_COORDINATOR: f"{address}:{port}",
    }


PREFIX_PATH = "kparallax-prefix"


def _handler():
    """Horovod's rendezvous handler, answering also ``GET /kparallax-prefix/<prefix>``: every key of the store
    that starts with ``<prefix>`` and its value, as one JSON object (one request where a launcher reads every
    host's status; a request per host and launcher made host 0's launcher serve ~130 requests a second at 8
    hosts, growing with the square of the hosts). Counts the connections it answers (``server.requests``: one
    request each, HTTP/1.0)."""
    from horovod.runner.http.http_server import RendezvousHandler  # pylint: disable=import-outside-toplevel

    class Handler(RendezvousHandler):
        def handle(self):
            with self.server.cache_lock:
                self.server.requests += 1
            super().handle()

        def do_GET(self):
            parts = self.path.split("/")
            if len(parts) != 3 or parts[1] != PREFIX_PATH:
                super().do_GET()
                return
            with self.server.cache_lock:
                found = {k: v.decode() for k, v in self.server.cache.get(SCOPE, {}).items()
                         if k.startswith(parts[2])}
            body = json.dumps(found).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    return Handler


class Coordinator:
    """Serves the Gloo rendezvous and the key-value store at ``address:port`` (bound to that address only)."""

    def __init__(self, address, port, slots):
        from horovod.runner.http.http_server import RendezvousHTTPServer  # pylint: disable=import-outside-toplevel
        try:
            self._server = RendezvousHTTPServer((socket.gethostbyname(address), port), _handler(), 0)
        except OSError as e:
            raise OSError(f"Cannot serve the rendezvous at {address}:{port} ({e.strerror}). Is the port in use, or "
                          f"is {address} not an address of this host? Received: rendezvous {address}:{port}.") from None
        self._server.init(slots)
        self._server.requests = 0
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()
        self.address = f"{address}:{port}"

    def reset_rendezvous(self, slots):
        """Forgets Horovod's rendezvous keys of a stopped group (kparallax's own keys stay) for a restart."""
        with self._server.cache_lock:
            kept = dict(self._server.cache.get(SCOPE, {}))
        self._server.init(slots)
        with self._server.cache_lock:
            self._server.cache[SCOPE] = kept

    @property
    def requests(self):
        """Requests answered so far (counted as they start)."""
        return self._server.requests

    def stop(self):
        self._server.shutdown()
        self._server.server_close()


def put(coordinator, key, value, timeout=5.0):
    request = urllib.request.Request(f"http://{coordinator}/{SCOPE}/{key}", data=value.encode(), method="PUT")
    with urllib.request.urlopen(request, timeout=timeout):
        pass


def get(coordinator, key, timeout=5.0):
    """The value of ``key``, or None if it is not set. Raises OSError if the coordinator is unreachable."""
    try:
        with urllib.request.urlopen(f"http://{coordinator}/{SCOPE}/{key}", timeout=timeout) as response:
            return response.read().decode()
    except urllib.error.HTTPError as e:
        if e.code == 404:
            return None
        raise OSError(f"coordinator {coordinator} answered {e.code}") from None


def get_prefixed(coordinator, prefix, timeout=5.0):
    """{key: value} of every key starting with ``prefix``, read in one request. Raises OSError if the coordinator
    is unreachable."""
    try:
        with urllib.request.urlopen(f"http://{coordinator}/{PREFIX_PATH}/{prefix}", timeout=timeout) as response:
            return json.loads(response.read().decode())
    except urllib.error.HTTPError as e:
        raise OSError(f"coordinator {coordinator} answered {e.code}") from None


def wait_reachable(coordinator, timeout):
    host, port = coordinator.rsplit(":", 1)
    deadline = time.monotonic() + timeout
    while True:
        try:
            with socket.create_connection((host, int(port)), timeout=2.0):
                return
        except OSError as e:
            if time.monotonic() > deadline:
                raise ConnectionError(f"The job's coordinator (first host's launcher) at {coordinator} is not "
                                      f"reachable after {timeout:.0f} s ({e}). Start the launcher with --host-index 0 "
                                      f"on the first host of the cluster file. Received: {coordinator}.") from None
            time.sleep(0.3)


def connected_key(rank):
    """The key worker ``rank`` sets once connected to the PS tasks (per start of the group: after a restart the
    previous start's keys must not let a worker skip its turn)."""
    return f"connected_{os.environ.get(spec.ENV_RESTART_COUNT, '0')}_{rank}"


def wait_turn(coordinator, rank, timeout):
    """Blocks until worker ``rank - 1`` has made its first PS connection (first connections go one at a time)."""
    if rank == 0:
        return
    deadline = time.monotonic() + timeout
    while get(coordinator, connected_key(rank - 1)) is None:
        if time.monotonic() > deadline:
            raise TimeoutError(f"Worker {rank - 1} did not connect to the PS tasks within {timeout:.0f} s, so worker "
                               f"{rank} cannot take its turn; check worker {rank - 1}'s log.")
        time.sleep(0.1)


def coordinator_from_env():
    return os.environ.get(ENV_COORDINATOR) or None
