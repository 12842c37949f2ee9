"""Cluster files: which hosts run how many workers and PS tasks, on which ports and network interface.

Two forms are accepted.

YAML::

    rendezvous_port: 29400          # optional; Horovod rendezvous + launcher coordination, on the first host
    hosts:
      - host: 10.0.0.1              # address (or name) the other hosts reach this one at
        workers: 2                  # worker slots (Horovod ranks, assigned host by host in file order)
        ps: 1                       # PS tasks on this host (optional, default 0)
        ps_port: 2222               # first PS port (optional; the next PS task uses the next port)
        worker_port: 2300           # first worker port (optional; workers' own TensorFlow servers)
        interface: eth0             # optional network interface for Horovod's Gloo (default: the one holding `host`)
      - host: 10.0.0.2
        workers: 2

Parallax's resource-info form, one host per line (``host: slot,slot,...``): as many workers as listed slots and one
PS task per host, as Parallax ran it::

    10.0.0.1: 0,1
    10.0.0.2: 0,1

Every error names the file, the host and the field, with the value received.
"""

import dataclasses
import ipaddress
import json
import re
from typing import List, Optional, Tuple

DEFAULT_PS_PORT = 2222
DEFAULT_WORKER_PORT = 2300
DEFAULT_RENDEZVOUS_PORT = 29400
_HOST_KEYS = {"host", "workers", "ps", "ps_port", "worker_port", "interface"}
_TOP_KEYS = {"hosts", "rendezvous_port"}
_HOSTNAME = re.compile(r"[A-Za-z0-9]([A-Za-z0-9.-]{0,252})?")


@dataclasses.dataclass(frozen=True)
class HostSpec:
    host: str
    workers: int
    ps: int = 0
    ps_port: int = DEFAULT_PS_PORT
    worker_port: int = DEFAULT_WORKER_PORT
    interface: Optional[str] = None


@dataclasses.dataclass(frozen=True)
class ClusterPlan:
    """The whole job: hosts in order; ranks and PS indices are assigned host by host."""
    hosts: Tuple[HostSpec, ...]
    rendezvous_port: int = DEFAULT_RENDEZVOUS_PORT

    @property
    def num_workers(self):
        return sum(h.workers for h in self.hosts)

    @property
    def num_ps(self):
        return sum(h.ps for h in self.hosts)

    @property
    def ps_addresses(self) -> List[str]:
        return [f"{h.host}:{h.ps_port + i}" for h in self.hosts for i in range(h.ps)]

    @property
    def worker_addresses(self) -> List[str]:
        return [f"{h.host}:{h.worker_port + i}" for h in self.hosts for i in range(h.workers)]

    @property
    def coordinator(self) -> str:
        return f"{self.hosts[0].host}:{self.rendezvous_port}"

    def ps_indices(self, host_index) -> List[int]:
        start = sum(h.ps for h in self.hosts[:host_index])
        return list(range(start, start + self.hosts[host_index].ps))

    def worker_ranks(self, host_index) -> List[int]:
        start = sum(h.workers for h in self.hosts[:host_index])
        return list(range(start, start + self.hosts[host_index].workers))

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text):
        data = json.loads(text)
        return cls(hosts=tuple(HostSpec(**h) for h in data["hosts"]), rendezvous_port=data["rendezvous_port"])


def load(path: str) -> ClusterPlan:
    """Reads and validates a cluster file (YAML or Parallax resource-info form)."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise ValueError(f"Cannot read cluster file {path!r} ({e.strerror}). Received: --cluster={path}.") from None
    return parse(text, source=path)


def parse(text: str, source: str = "<cluster>") -> ClusterPlan:
    if _looks_like_parallax(text):
        return _parse_parallax(text, source)
    import yaml  # pylint: disable=import-outside-toplevel
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ValueError(f"Cluster file {source} is not valid YAML ({e}).") from None
    if not isinstance(data, dict) or "hosts" not in data:
        raise ValueError(f"Cluster file {source} must be a mapping with a 'hosts' list (or the Parallax form "
                         f"'host: slot,slot'). Received: {str(data)[:200]!r}.")
    unknown = set(data) - _TOP_KEYS
    if unknown:
        raise ValueError(f"Cluster file {source}: unknown key(s) {sorted(unknown)}; known: {sorted(_TOP_KEYS)}. "
                         f"Received: {sorted(data)}.")
    hosts = data["hosts"]
    if not isinstance(hosts, list) or not hosts:
        raise ValueError(f"Cluster file {source}: 'hosts' must be a non-empty list. Received: hosts={hosts!r}.")
    specs = tuple(_host_spec(entry, i, source) for i, entry in enumerate(hosts))
    port = data.get("rendezvous_port", DEFAULT_RENDEZVOUS_PORT)
    _check_port(port, f"Cluster file {source}: rendezvous_port", "rendezvous_port")
    return _validated(ClusterPlan(specs, port), source)


def _looks_like_parallax(text):
    lines = [l.split("#", 1)[0].strip() for l in text.splitlines()]
    lines = [l for l in lines if l]
    return bool(lines) and all(re.fullmatch(r"[^:\s]+\s*:\s*[0-9]+(\s*,\s*[0-9]+)*", l) for l in lines)


def _parse_parallax(text, source):
    specs = []
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        host, slots = (part.strip() for part in line.split(":", 1))
        count = len([s for s in slots.split(",") if s.strip()])
        specs.append(HostSpec(host=host, workers=count, ps=1))
        _check_host(host, f"Cluster file {source} line {number}")
    return _validated(ClusterPlan(tuple(specs)), source)


def _host_spec(entry, i, source):
    where = f"Cluster file {source}: hosts[{i}]"
    if not isinstance(entry, dict):
        raise ValueError(f"{where} must be a mapping like {{host: 10.0.0.1, workers: 2, ps: 1}}. Received: {entry!r}.")
    unknown = set(entry) - _HOST_KEYS
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {sorted(unknown)}; known: {sorted(_HOST_KEYS)}. "
                         f"Received: {sorted(entry)}.")
    if "host" not in entry:
        raise ValueError(f"{where} needs 'host'. Received: {entry!r}.")
    host = str(entry["host"])
    _check_host(host, where)
    where = f"Cluster file {source}: host {host}"
    values = {}
    for key, default in (("workers", 0), ("ps", 0)):
        value = entry.get(key, default)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"{where}: {key} must be an integer >= 0. Received: {key}={value!r}.")
        values[key] = value
    if values["workers"] == 0 and values["ps"] == 0:
        raise ValueError(f"{where} has zero slots: give it workers >= 1 or ps >= 1, or remove it. "
                         f"Received: workers=0, ps=0.")
    for key, default in (("ps_port", DEFAULT_PS_PORT), ("worker_port", DEFAULT_WORKER_PORT)):
        value = entry.get(key, default)
        _check_port(value, where + f": {key}", key)
        values[key] = value
    interface = entry.get("interface")
    if interface is not None and not (isinstance(interface, str) and re.fullmatch(r"[A-Za-z0-9_.:@-]{1,15}", interface)):
        raise ValueError(f"{where}: interface must be a network interface name like 'eth0'. "
                         f"Received: interface={interface!r}.")
    return HostSpec(host=host, interface=interface, **values)


def _check_host(host, where):
    try:
        ipaddress.ip_address(host)
        return
    except ValueError:
        pass
    if not _HOSTNAME.fullmatch(host):
        raise ValueError(f"{where}: host must be an IP address or host name. Received: host={host!r}.")


def _check_port(value, where, key):
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= 65535:
        raise ValueError(f"{where} must be a port number in 1..65535. Received: {key}={value!r}.")


def _validated(plan, source):
    seen = set()
    for spec in plan.hosts:
        if spec.host in seen:
            raise ValueError(f"Cluster file {source}: host {spec.host} is listed twice; give each host one entry "
                             f"with its total slots. Received: hosts={[h.host for h in plan.hosts]}.")
        seen.add(spec.host)
        for key, base, count in (("ps_port", spec.ps_port, spec.ps), ("worker_port", spec.worker_port, spec.workers)):
            if base + count - 1 > 65535:
                raise ValueError(f"Cluster file {source}: host {spec.host}: {key}={base} leaves no room for {count} "
                                 f"task(s) (ports run past 65535). Received: {key}={base}.")
        ports = [spec.ps_port + i for i in range(spec.ps)] + [spec.worker_port + i for i in range(spec.workers)]
        if spec is plan.hosts[0]:
            ports.append(plan.rendezvous_port)
        if len(set(ports)) != len(ports):
            raise ValueError(f"Cluster file {source}: host {spec.host}: PS, worker and rendezvous ports overlap. "
                             f"Received: ps_port={spec.ps_port} (x{spec.ps}), worker_port={spec.worker_port} "
                             f"(x{spec.workers}), rendezvous_port={plan.rendezvous_port}.")
    if plan.num_workers == 0:
        raise ValueError(f"Cluster file {source} has no worker slot. Received: workers=0 on every host.")
    return plan


def from_hosts_arg(hosts_arg: str, ps_per_host: int) -> ClusterPlan:
    """horovodrun's ``-H host1:2,host2:2`` (slots per host) with ``ps_per_host`` PS tasks on each host."""
    specs = []
    for item in [h.strip() for h in hosts_arg.split(",") if h.strip()]:
        host, _, slots = item.partition(":")
        if not slots.isdigit() or int(slots) < 1:
            raise ValueError(f"-H expects host:slots entries like 'host1:2,host2:2'. Received: -H {hosts_arg!r}.")
        _check_host(host, "-H")
        specs.append(HostSpec(host=host, workers=int(slots), ps=ps_per_host))
    if not specs:
        raise ValueError(f"-H names no host. Received: -H {hosts_arg!r}.")
    return _validated(ClusterPlan(tuple(specs)), "-H")
