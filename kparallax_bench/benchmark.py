"""Benchmarks kparallax's architectures against plain Horovod Keras, TensorFlow's ParameterServerStrategy and a
single process, side by side.

    .venv/bin/python scripts/benchmark.py --model lm1b_small --workers 2 --steps 50 --repeats 3 --json out.json
    .venv/bin/python scripts/benchmark.py --model lm1b_small --workers 2,4,8 --batch_size 4 --steps 20 \\
        --variants kparallax-hybrid,horovod --emulate-network unlimited --json bytes.json
    .venv/bin/python scripts/benchmark.py --model lm1b_small --workers 4 --emulate-network 1gbit --json slow.json

Variants run one at a time, alternating (A B C ... A B C ...), each a fresh job: kparallax-hybrid,
kparallax-hybrid-async (the same with sync=False: PS updates applied on arrival, as tf-pss does),
kparallax-allreduce (allgather of sparse gradients), kparallax-allreduce-dense, kparallax-ps (under kparallax-run),
horovod and horovod-dense (plain Horovod Keras: hvd.DistributedOptimizer + BroadcastGlobalVariablesCallback, no
kparallax code, started with Horovod's Gloo rendezvous), tf-pss (TensorFlow ParameterServerStrategy with Model.fit:
a chief, TF servers for the workers and PS tasks; asynchronous, as that strategy is), single (one plain process,
reported as single@1). Same model, same synthetic data, same per-worker batch, same math: BatchNormalization
normalizes each worker's batch in every variant (``--batch_norm global``: over all workers, kparallax's default, and
Horovod's ``SyncBatchNormalization`` for the horovod variants); ``--steps_per_execution N`` compiles every variant
with Keras' ``steps_per_execution=N``; ``--local_aggregation on|off`` sets kparallax's option of that name (default
``auto``), ``--placement JSON`` its placement rules. Variants that need them get ``--ps`` PS
tasks (default 1; with more, kparallax tables get as many partitions and tf-pss a MinSizePartitioner as many shards).

Where: by default every task runs on this machine and talks over loopback. ``--emulate-network RATE`` (e.g. 1gbit,
100mbit, or ``unlimited``) puts each worker on its own emulated host - a network namespace on a bridge, its link
limited to RATE in each direction by tc (PS task i shares host i) - so the communication-bound regime of a cluster
shows up on one machine (kparallax_bench/netem.py; root needed). ``--workers_per_host K`` puts K workers on each
emulated host instead (ranks K*i .. K*i+K-1 on host i), as on machines with several GPUs: their traffic inside the host
stays on its loopback, and kparallax's ``local_aggregation="auto"`` aggregates there.

For each variant and worker count: throughput (global items/s: median and min/max over repeats, from the median step
time of each repeat), ms/step, **measured** bytes per step per worker (bytes sent during the timed steps / steps /
workers: loopback counters locally, all hosts' link counters when emulated; worker 0 marks the timed window through
a FIFO and this driver reads the counters at each mark), and the analytic floor (rows pulled and pushed for PS
variants, ring allgather / allreduce volumes for the others). Writes JSON (``"variants"`` keyed
``<variant>@<workers>``), a Markdown table (``--markdown``) and a PNG chart (``--png``).
"""

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time


from kparallax.cluster import coordinator as rendezvous
from kparallax.cluster import net
from kparallax.launch import env as launch_env
from kparallax_bench import cpu
from kparallax_bench import netem
from kparallax_bench import outputs
from kparallax_bench import traffic
from kparallax_models import presets

WORKER = ["-m", "kparallax_bench.worker"]
VARIANTS = ["kparallax-hybrid", "kparallax-hybrid-async", "kparallax-allreduce", "kparallax-allreduce-dense", "kparallax-ps", "horovod",
            "horovod-dense", "tf-pss", "single"]


def parse(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="lm1b_small",
                        help="a preset (lm1b_small | lm1b_tiny | resnet50_small | ...) or a JSON config's path")
    parser.add_argument("--workers", default="2", help="comma-separated worker counts, e.g. 1,2,4,8")
    parser.add_argument("--steps", type=int, default=50, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first (tracing), >= 1")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch_size", type=int, default=None, help="per-worker batch (default: the preset's)")
    parser.add_argument("--ps", type=int, default=1, help="PS tasks for the variants that use them")
    parser.add_argument("--batch_norm", choices=("per_worker", "global"), default="per_worker",
                        help="BatchNormalization statistics: per_worker (default; every variant normalizes each "
                             "worker's batch) or global (over all workers, one process's math: kparallax's default "
                             "for users, and hvd.SyncBatchNormalization for the horovod variants; tf-pss and single "
                             "stay per worker)")
    parser.add_argument("--steps_per_execution", type=int, default=1,
                        help="Keras' compile(steps_per_execution=N) for every variant (default 1): N steps per call "
                             "of the train function, callbacks every N steps; per-step times are each call's time / N")
    parser.add_argument("--local_aggregation", choices=("auto", "on", "off"), default="auto",
                        help="kparallax variants: HybridStrategy(local_aggregation=...) ('auto', the default, "
                             "aggregates only when workers share a host and some task is on another; 'on' forces it)")
    parser.add_argument("--placement", default=None,
                        help="kparallax variants: HybridStrategy(placement=...) as a JSON object of variable-path "
                             "regex -> 'ps' | 'ps:P' | 'replicated', e.g. '{\"lm1b/softmax_.*\": \"replicated\"}' "
                             "(no floor is given for them then)")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--json", default="benchmark.json")
    parser.add_argument("--markdown", default=None, help="write the table here too (default: print only)")
    parser.add_argument("--png", default=None, help="write the chart here (matplotlib)")
    parser.add_argument("--emulate-network", dest="emulate_network", default=None,
                        help="RATE per host link (1gbit, 100mbit, ...) or 'unlimited': one namespace per worker")
    parser.add_argument("--workers_per_host", type=int, default=1,
                        help="with --emulate-network: workers per emulated host (default 1); every worker count "
                             "must be a multiple of it")
    parser.add_argument("--timeout", type=float, default=900.0, help="per run")
    parser.add_argument("--profile", default=None,
                        help="trace every worker's timed steps with TensorFlow's profiler into "
                             "DIR/<variant>@<workers>/worker-<rank>/ (summarize with python -m "
                             "kparallax_bench.op_profile DIR [--phases]); profiled runs are slower, so their "
                             "throughput is not comparable with unprofiled ones")
    args = parser.parse_args(argv)
    if args.placement is not None:
        try:
            rules = json.loads(args.placement)
        except ValueError as e:
            parser.error(f"--placement must be a JSON object ({e}). Received: --placement={args.placement}.")
        if not isinstance(rules, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in rules.items()):
            parser.error("--placement must be a JSON object of strings, e.g. '{\"lm1b/softmax_.*\": \"replicated\"}'. "
                         f"Received: --placement={args.placement}.")
    if args.emulate_network:
        try:
            args.rate = netem.parse_rate(args.emulate_network)
        except ValueError as e:
            parser.error(f"--emulate-network: {e}")
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    for v in args.variants:
        if v not in VARIANTS:
            parser.error(f"unknown variant {v!r}; choose from {VARIANTS}. Received: --variants={','.join(args.variants)}.")
    try:
        args.workers = [int(w) for w in args.workers.split(",")]
    except ValueError:
        parser.error(f"--workers takes integers like 1,2,4. Received: --workers={args.workers}.")
    if any(w < 1 for w in args.workers):
        parser.error(f"every --workers count must be >= 1. Received: --workers={','.join(map(str, args.workers))}.")
    for flag, why in (("steps", ""), ("repeats", ""), ("batch_size", ""),
                      ("warmup", " (the timed window starts at a step's end, and the first step traces)")):
        value = getattr(args, flag)
        if value is not None and value < 1:
            parser.error(f"--{flag} must be >= 1{why}. Received: --{flag}={value}.")
    if args.timeout <= 0:
        parser.error(f"--timeout must be > 0 seconds. Received: --timeout={args.timeout}.")
    try:
        presets.load(presets.model_of(args.model), args.model)
    except ValueError as e:
        parser.error(f"--model: {e}")
    n = args.steps_per_execution
    if n < 1 or args.steps % n or args.warmup % n:
        parser.error(f"--steps_per_execution must be >= 1 and divide --steps and --warmup (so the timed window starts "
                     f"and ends at a call's end). Received: --steps_per_execution={n}, --steps={args.steps}, "
                     f"--warmup={args.warmup}.")
    if args.ps < 1:
        parser.error(f"--ps must be >= 1. Received: --ps={args.ps}.")
    per_host = args.workers_per_host
    if per_host < 1 or (per_host > 1 and not args.emulate_network):
        parser.error(f"--workers_per_host must be >= 1, and above 1 only with --emulate-network (hosts are emulated "
                     f"there). Received: --workers_per_host={per_host}.")
    if any(w % per_host for w in args.workers):
        parser.error(f"every worker count must be a multiple of --workers_per_host. Received: --workers="
                     f"{','.join(map(str, args.workers))}, --workers_per_host={per_host}.")
    if args.emulate_network and args.ps > min(args.workers) // per_host:
        parser.error(f"with --emulate-network, PS task i runs on host i, so --ps may not exceed the smallest host "
                     f"count (workers / --workers_per_host). Received: --ps={args.ps}, --workers="
                     f"{','.join(map(str, args.workers))}, --workers_per_host={per_host}.")
    outputs.check_dirs(parser, args, ("json", "markdown", "png"))
    return args


def _bench(variant, args, out):
    return [sys.executable, *WORKER, "--variant", variant, "--model", args.model, "--steps", str(args.steps),
            "--warmup", str(args.warmup), "--out", out, "--batch_norm", args.batch_norm,
            "--steps_per_execution", str(args.steps_per_execution), "--local_aggregation", args.local_aggregation] + (
                ["--batch_size", str(args.batch_size)] if args.batch_size else []) + (
                ["--placement", args.placement] if args.placement else [])


def _needs_ps(variant):
    return variant in ("kparallax-hybrid", "kparallax-hybrid-async", "kparallax-ps", "tf-pss")


def plan(variant, workers, args, hosts, out, tmp):
    """The processes of one run: ``(host index, argv, env, waited)``; the run is over when every waited one is."""
    bench = _bench(variant, args, out)
    num_ps = args.ps if _needs_ps(variant) else 0
    if variant == "single":
        return [(0, bench, {}, True)]
    if variant.startswith("kparallax-"):
        logs = os.path.join(tmp, f"logs-{variant}-{workers}")
        common = ["--quiet", "--timeout", str(args.timeout)]
        bench = bench + ["--partitions", str(max(num_ps, 1))]
        if not hosts.emulated:
            return [(0, [sys.executable, "-m", "kparallax.launch", "--workers", str(workers), "--ps", str(num_ps),
                         "--log_dir", logs] + common + ["--"] + bench, {}, True)]
        cluster = os.path.join(tmp, f"cluster-{variant}-{workers}.yaml")
        machines, per_host = hosts.count(workers), workers // hosts.count(workers)
        with open(cluster, "w", encoding="utf-8") as f:
            f.write("hosts:\n" + "".join(f"  - host: {hosts.address(i)}\n    workers: {per_host}\n    ps: "
                                         f"{1 if i < num_ps else 0}\n" for i in range(machines)))
        return [(i, [sys.executable, "-m", "kparallax.launch", "--cluster", cluster, "--host-index", str(i),
                     "--log_dir", f"{logs}/host{i}"] + common + ["--"] + bench, {}, True) for i in range(machines)]
    if variant.startswith("horovod"):  # plain Horovod workers; Horovod's own Gloo rendezvous (served by the driver)
        slots = rendezvous.slot_plan_for_hosts([hosts.address(hosts.worker_host(rank)) for rank in range(workers)])
        port = net.free_port()
        hosts.serve(rendezvous.Coordinator(hosts.gateway, port, slots))
        # Gloo waits for a peer as long as kparallax-run lets its own tasks wait (Gloo's default, 30 s, stopped
        # Horovod's first broadcast of lm1b_sparse's tables on 100 Mbit/s links).
        gloo = launch_env.gloo_env(launch_env.STALL_TIMEOUT)
        return [(hosts.worker_host(rank), bench, {**rendezvous.horovod_env(slot, hosts.gateway, port, hosts.interface(
                    hosts.worker_host(rank))), **gloo}, True) for rank, slot in enumerate(slots)]
    # tf-pss: TensorFlow servers for the workers and PS tasks, and a chief (coordinator) process running Model.fit.
    ports = iter(net.free_port() for _ in range(1 + workers + num_ps))
    cluster = {"chief": [f"{hosts.address(0)}:{next(ports)}"],
               "worker": [f"{hosts.address(hosts.worker_host(i))}:{next(ports)}" for i in range(workers)],
               "ps": [f"{hosts.address(hosts.ps_host(i))}:{next(ports)}" for i in range(num_ps)]}

    def config(role, index):
        return {"TF_CONFIG": json.dumps({"cluster": cluster, "task": {"type": role, "index": index}})}
    return ([(hosts.ps_host(i), bench, config("ps", i), False) for i in range(num_ps)]
            + [(hosts.worker_host(i), bench, config("worker", i), False) for i in range(workers)]
            + [(0, bench, config("chief", 0), True)])


class LocalHosts:
    """Every task on this machine, talking over loopback."""
    emulated = False
    gateway = "localhost"

    def __init__(self):
        self._served = []

    @staticmethod
    def address(index):
        return "localhost"

    @staticmethod
    def count(workers):
        """How many hosts ``workers`` workers occupy."""
        return 1

    @staticmethod
    def worker_host(rank):
        return 0

    @staticmethod
    def ps_host(index):
        return 0

    @staticmethod
    def interface(index):
        return "lo"

    @staticmethod
    def command(index, argv):
        return list(argv)

    @staticmethod
    def counters():
        """(bytes sent so far, each host link's (sent, received) bytes or None): here one loopback, no links."""
        return netem.loopback_sent_bytes(), None

    def serve(self, coordinator):
        self._served.append(coordinator)

    def stop_serving(self):
        while self._served:
            self._served.pop().stop()


class EmulatedHosts(LocalHosts):
    """Namespaces ("hosts") on an emulated network, ``workers_per_host`` workers each (ranks in host order); PS task
    i on host i."""
    emulated = True

    def __init__(self, network, workers_per_host=1):
        super().__init__()
        self.network, self.gateway, self.per_host = network, network.gateway, workers_per_host

    def address(self, index):
        return self.network.address(index)

    def count(self, workers):
        return workers // self.per_host

    def worker_host(self, rank):
        return rank // self.per_host

    @staticmethod
    def ps_host(index):
        return index

    def interface(self, index):
        return self.network.interfaces[index]

    def command(self, index, argv):
        return self.network.command(index, argv)

    def counters(self):
        links = self.network.link_bytes()  # one snapshot for both: the total and the busiest link agree
        return self.network.sent_bytes(links), links


class Marks:
    """Worker 0 (or the tf-pss chief) writes ``start``/``stop`` lines to a FIFO around the timed steps; the driver
    reads the hosts' byte counters the moment each line arrives. One FIFO and reader for all runs (runs never
    overlap); ``reset`` before each."""

    def __init__(self, path, hosts):
        os.mkfifo(path)
        self.path, self._hosts, self.seen, self.cpu, self.links = path, hosts, {}, {}, {}
        self._fd = os.open(path, os.O_RDWR)  # never EOF: writers come and go
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        pending = b""
        while True:
            try:
                pending += os.read(self._fd, 4096)
            except OSError:
                return
            *lines, pending = pending.split(b"\n")
            for line in lines:
                self.seen[line.decode()], self.links[line.decode()] = self._hosts.counters()
                self.cpu[line.decode()] = cpu.snapshot(self.path)

    def reset(self):
        self.seen, self.cpu, self.links = {}, {}, {}

    def cpu_seconds(self):
        """CPU-seconds by role between the last start and stop marks (``cpu.diff``), or {}."""
        return cpu.diff(self.cpu.get("start"), self.cpu.get("stop"))

    def measured(self):
        """Bytes sent between the last start and stop marks, or None when the run did not mark both."""
        if "start" not in self.seen or "stop" not in self.seen:
            return None
        return self.seen["stop"] - self.seen["start"]

    def busiest_link(self):
        """The most bytes one host link carried in one direction between the last start and stop marks, or None
        (loopback runs; runs without both marks)."""
        start, stop = self.links.get("start"), self.links.get("stop")
        if not start or not stop:
            return None
        return max(b - a for before, after in zip(start, stop) for a, b in zip(before, after))


def run_once(variant, workers, args, hosts, marks, tmp):
    out = os.path.join(tmp, f"{variant}-{workers}-{time.monotonic_ns()}.json")
    marks.reset()
    started = time.monotonic()
    procs = []
    try:
        for i, (host, argv, env, waited) in enumerate(plan(variant, workers, args, hosts, out, tmp)):
            log = open(f"{out}.{i}.log", "w", encoding="utf-8")  # pylint: disable=consider-using-with
            procs.append((subprocess.Popen(hosts.command(host, argv), stdout=log, stderr=subprocess.STDOUT,
                                           env={**os.environ, **env, "KPBENCH_MARKS": marks.path,
                                                **({"KPBENCH_PROFILE": os.path.abspath(args.profile)}
                                                   if args.profile else {})}), waited, log))
            if env.get("TF_CONFIG") and not waited:  # servers first: the chief connects to all of them
                _wait_listening(json.loads(env["TF_CONFIG"]), hosts, time.monotonic() + 120)
        problem = _wait(procs, time.monotonic() + args.timeout + 120)
        if problem or not os.path.exists(out):
            tails = "".join(_tail(log.name) for _, _, log in procs)
            raise RuntimeError(f"{variant}@{workers} {problem or 'wrote no result'}:\n{tails}")
    finally:
        for proc, _, log in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            log.close()
        hosts.stop_serving()
    with open(out, encoding="utf-8") as f:
        result = json.load(f)
    result["sent_bytes"] = marks.measured()
    if result["sent_bytes"] is None:
        raise RuntimeError(f"{variant}@{workers} did not mark its timed steps")
    result["cpu_seconds"] = marks.cpu_seconds()
    result["peak_rss_bytes"] = cpu.peak_memory(marks.cpu.get("stop"))
    result["busiest_link_bytes"] = marks.busiest_link()
    result["wall_seconds"] = time.monotonic() - started
    return result


def _wait(procs, deadline):
    """Waits for the waited processes; returns what went wrong (the first failure or a timeout), or None."""
    for index, (proc, waited, _) in enumerate(procs):
        if not waited:
            continue
        try:
            code = proc.wait(timeout=max(deadline - time.monotonic(), 1))
        except subprocess.TimeoutExpired:
            return f"timed out waiting for process {index}"
        if code != 0:
            return f"failed: process {index} exited with {code}"
    return None


def _wait_listening(tf_config, hosts, deadline):
    """Until the TF server of ``tf_config``'s task accepts connections (probed from the driver's namespace)."""
    task = tf_config["task"]
    host, port = tf_config["cluster"][task["type"]][task["index"]].rsplit(":", 1)
    address = "127.0.0.1" if host == "localhost" else host
    while time.monotonic() < deadline:
        try:
            socket.create_connection((address, int(port)), timeout=1).close()
            return
        except OSError:
            time.sleep(0.2)
    raise RuntimeError(f"the tf-pss {task['type']} {task['index']} server never listened at {host}:{port}")


def _tail(path, size=1500):
    with open(path, encoding="utf-8", errors="replace") as f:
        return f"--- {os.path.basename(path)}\n" + f.read()[-size:]


def summarize(runs, variant, workers, workers_per_host=1, placement=None):
    """One variant@workers entry of the report. The analytic floor assumes one worker per host and the default
    placement; with several workers per host (what they send each other stays off the links) or kparallax placement
    rules, no floor is given (None)."""
    first = runs[0]
    medians = [statistics.median(r["step_seconds"]) for r in runs]
    per_second = [first["shape"]["items_per_step"] * workers / m for m in medians]
    measured = [r["sent_bytes"] / r["timed_steps"] / workers for r in runs]
    roles = sorted({k for r in runs for k in r.get("cpu_seconds", {})})
    cpu_per_step = {k: statistics.median(r["cpu_seconds"].get(k, 0.0) / r["timed_steps"] for r in runs) for k in roles}
    busiest = [r["busiest_link_bytes"] / r["timed_steps"] for r in runs if r.get("busiest_link_bytes") is not None]
    memory = {k: statistics.median(r["peak_rss_bytes"].get(k, 0) for r in runs)
              for k in sorted({k for r in runs for k in r.get("peak_rss_bytes", {})})}
    floor = workers_per_host == 1 and not (placement and variant.startswith("kparallax-"))
    return {"variant": variant, "workers": workers, "unit": first["shape"]["unit"] + "/s",
            "throughput": statistics.median(per_second), "throughput_min": min(per_second),
            "throughput_max": max(per_second), "ms_per_step": 1000 * statistics.median(medians),
            "bytes_per_step": statistics.median(measured), "floor_bytes_per_step": (
                traffic.floor_bytes(first["shape"], variant, workers) if floor else None),
            "cpu_seconds_per_step": cpu_per_step, "peak_rss_bytes": memory, "repeats": len(runs),
            "shape": first["shape"],
            "busiest_link_bytes_per_step": statistics.median(busiest) if busiest else None}


def markdown(results, model):
    """The results table; emulated runs add the busiest host link's bytes per step (one direction), which bound
    the step from below at the link rate."""
    links = any(e.get("busiest_link_bytes_per_step") is not None for e in results.values())
    lines = [f"| variant | workers | throughput ({next(iter(results.values()))['unit']}) [min-max] | ms/step | "
             "bytes/step/worker (measured) | floor | measured/floor | "
             + ("busiest link MB/step | " if links else "") + "CPU-s/step: workers+chief / PS / kernel / all | "
             "peak RSS MB: largest worker / all PS |",
             "|---|---|---|---|---|---|---|" + ("---|" if links else "") + "---|---|"]
    for entry in results.values():
        floor = entry["floor_bytes_per_step"]
        ratio = entry["bytes_per_step"] / floor if floor else float("nan")
        floor_cell, ratio_cell = ("-", "-") if floor is None else (f"{floor / 1e6:.2f} MB", f"{ratio:.2f}")
        busiest = entry.get("busiest_link_bytes_per_step")
        link_cell = ("-" if busiest is None else f"{busiest / 1e6:.2f}") + " | " if links else ""
        lines.append(f"| {entry['variant']} | {entry['workers']} | {entry['throughput']:.0f} "
                     f"[{entry['throughput_min']:.0f}-{entry['throughput_max']:.0f}] | {entry['ms_per_step']:.1f} | "
                     f"{entry['bytes_per_step'] / 1e6:.2f} MB | {floor_cell} | "
                     f"{ratio_cell} | {link_cell}{_cpu_cell(entry.get('cpu_seconds_per_step', {}))} | "
                     f"{_memory_cell(entry.get('peak_rss_bytes', {}))} |")
    return f"Model {model}\n\n" + "\n".join(lines)


def _cpu_cell(seconds):
    if not seconds:
        return "-"
    return (f"{seconds['worker'] + seconds['chief']:.2f} / {seconds['ps']:.2f} / {seconds['kernel']:.2f} / "
            f"{seconds['total']:.2f}")


def _memory_cell(peak):
    if not peak:
        return "-"
    return f"{max(peak.get('worker', 0), peak.get('chief', 0)) / 1e6:.0f} / {peak.get('ps', 0) / 1e6:.0f}"


def chart(results, path):
    import matplotlib  # pylint: disable=import-outside-toplevel
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    variants = sorted({e["variant"] for e in results.values()})
    for v in variants:
        entries = sorted((e for e in results.values() if e["variant"] == v), key=lambda e: e["workers"])
        xs = [e["workers"] for e in entries]
        left.plot(xs, [e["throughput"] for e in entries], marker="o", label=v)
        right.plot(xs, [e["bytes_per_step"] / 1e6 for e in entries], marker="o", label=v)
    left.set(xlabel="workers", ylabel=next(iter(results.values()))["unit"], title="throughput (median)")
    right.set(xlabel="workers", ylabel="MB per step per worker (measured)", title="bytes on the wire", yscale="log")
    left.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None):
    args = parse(argv)
    network = None
    if args.emulate_network:
        network = netem.Network(max(args.workers) // args.workers_per_host, rate=args.rate)
        reason = network.up()
        if reason:
            print(f"benchmark.py: --emulate-network needs network namespaces: {reason}. Run as root on Linux, or "
                  f"leave out --emulate-network. Received: --emulate-network={args.emulate_network}.", file=sys.stderr)
            return 2
    try:
        results = run_all(args, EmulatedHosts(network, args.workers_per_host) if network else LocalHosts())
    finally:
        if network:
            network.down()
    report = {"model": args.model, "steps": args.steps, "warmup": args.warmup, "repeats": args.repeats,
              "steps_per_execution": args.steps_per_execution, "local_aggregation": args.local_aggregation,
              "batch_size": args.batch_size, "ps": args.ps, "emulate_network": args.emulate_network,
              "workers_per_host": args.workers_per_host, "placement": args.placement,
              "machine": {"cpus": os.cpu_count()}, "variants": results}
    with open(args.json, "w", encoding="utf-8") as f:
        json.dump(report, f, indent=2)
    table = markdown(results, args.model)
    print(table)
    if args.markdown:
        with open(args.markdown, "w", encoding="utf-8") as f:
            f.write(table + "\n")
    if args.png:
        chart(results, args.png)
    return 0


def run_all(args, hosts):
    results, raw = {}, {}
    with tempfile.TemporaryDirectory(prefix="kparallax-bench-") as tmp:
        marks = Marks(os.path.join(tmp, "marks"), hosts)
        groups = [(w, [v for v in args.variants if v != "single" or w == 1]) for w in args.workers]
        if "single" in args.variants and 1 not in args.workers:   # the one-process reference, once
            groups.insert(0, (1, ["single"]))
        for workers, variants in groups:
            for repeat in range(args.repeats):
                for variant in variants:
                    print(f"[{repeat + 1}/{args.repeats}] {variant}@{workers} ...", flush=True)
                    result = run_once(variant, workers, args, hosts, marks, tmp)
                    raw.setdefault(f"{variant}@{workers}", []).append(result)
            for variant in variants:
                results[f"{variant}@{workers}"] = summarize(raw[f"{variant}@{workers}"], variant, workers,
                                                            args.workers_per_host, args.placement)
    return results


if __name__ == "__main__":
    sys.exit(main())
