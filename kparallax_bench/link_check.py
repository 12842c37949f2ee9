"""How fast the emulated links move one push, with nothing else running: raw TCP and TensorFlow's own transport.

A synchronous PS step moves its rows in bursts (every worker pulls at the start, pushes at the end). This check
measures such bursts alone on an emulated network (``netem.Network``, one namespace per host), to tell the links'
and the transport's own speed apart from what a training step adds around them:

- ``tcp``: one host sends ``mb`` MB to host 0; ``hosts - 1`` hosts each send ``mb / (hosts - 1)`` MB to host 0 at
  once (an incast into host 0's link); every host sends ``mb / (hosts - 1)`` MB to every other host at once (all to
  all: every link busy in both directions, as when every worker pulls rows from every PS task); one TCP connection
  per pair, after ``idle`` seconds of silence;
- ``tf-push`` / ``tf-pull``: a TensorFlow client on host 0 ``scatter_add``s (pulls with ``gather``) ``mb / ps`` MB
  of rows into (from) one variable on each of ``ps`` PS servers (``tf.distribute.Server``, hosts 1..ps), as one
  ``tf.function`` call, after ``idle`` seconds.

Each pattern reports the median of ``rounds`` bursts next to its floor (the bytes over the busiest link at the
rate). Needs root (``ip netns``) and ``tc``.

    python -m kparallax_bench.link_check [--hosts 8] [--rate 1gbit] [--mb 13] [--rounds 5] [--idle 1] [--json F]
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from kparallax_bench import netem

_RECEIVER = """
import socket, sys, threading
server = socket.socket()
server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
server.bind((sys.argv[1], int(sys.argv[2])))
server.listen(64)
print("listening", flush=True)
def serve(conn):
    while True:
        header = conn.recv(8, socket.MSG_WAITALL)
        if len(header) < 8:
            return
        size, got = int.from_bytes(header, "big"), 0
        while got < size:
            got += len(conn.recv(min(1 << 20, size - got)))
        conn.sendall(b"k")
while True:
    threading.Thread(target=serve, args=(server.accept()[0],), daemon=True).start()
"""

_SENDER = """
import socket, sys, threading, time
peers, port = sys.argv[1].split(","), int(sys.argv[2])
size, rounds, idle = int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5])
conns = [socket.create_connection((peer, port)) for peer in peers]
payload = size.to_bytes(8, "big") + b"x" * size
def send(conn):
    conn.sendall(payload)
    conn.recv(1)
for _ in range(rounds):
    time.sleep(idle)
    print("ready", flush=True)
    sys.stdin.readline()
    start = time.perf_counter()
    threads = [threading.Thread(target=send, args=(conn,)) for conn in conns]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    print(time.perf_counter() - start, flush=True)
"""

ROW_BYTES = 512 * 4  # the rows _CLIENT moves: 512 float32

_PS = """
import json, sys
import tensorflow as tf
tf.distribute.Server(tf.train.ClusterSpec(json.loads(sys.argv[1])), job_name="ps", task_index=int(sys.argv[2]),
                     protocol="grpc").join()
"""

_CLIENT = """
import json, sys, time
import tensorflow as tf
cluster, rows, rounds, idle = json.loads(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
tf.config.experimental_connect_to_cluster(tf.train.ClusterSpec(cluster), job_name="worker", task_index=0)
tables = []
for i in range(len(cluster["ps"])):
    with tf.device(f"/job:ps/task:{i}"):
        tables.append(tf.Variable(tf.zeros([2 * rows, 512])))
ids = tf.range(rows, dtype=tf.int64) * 2
values = tf.ones([rows, 512])

@tf.function
def push():
    done = []
    for table in tables:
        with tf.device(table.device):
            done.append(tf.reduce_sum(table.scatter_add(tf.IndexedSlices(values, ids)).sparse_read(ids[:1])))
    return tf.add_n(done)

@tf.function
def pull():
    return tf.add_n([tf.reduce_sum(tf.gather(table, ids)) for table in tables])

result = {}
for name, call in (("tf-push", push), ("tf-pull", pull)):
    call().numpy()  # traced and connected outside the timing
    seconds = []
    for _ in range(rounds):
        time.sleep(idle)
        start = time.perf_counter()
        call().numpy()
        seconds.append(time.perf_counter() - start)
    result[name] = seconds
print(json.dumps(result), flush=True)
"""


def parse(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hosts", type=int, default=8, help="emulated hosts: host 0 and 1..hosts-1 (>= 2)")
    parser.add_argument("--rate", default="1gbit", help="link rate per direction (e.g. 1gbit, or unlimited)")
    parser.add_argument("--mb", type=float, default=13.0, help="MB of one burst, over all senders / PS tasks")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--idle", type=float, default=1.0, help="seconds of silence before each burst")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    if args.hosts < 2:
        parser.error(f"--hosts must be at least 2 (host 0 and one peer). Received: --hosts={args.hosts}.")
    if args.mb <= 0 or args.rounds < 1 or args.idle < 0:
        parser.error(f"--mb must be > 0, --rounds >= 1, --idle >= 0. Received: --mb={args.mb}, "
                     f"--rounds={args.rounds}, --idle={args.idle}.")
    try:
        args.rate_bits = netem.parse_rate(args.rate)
    except ValueError as e:
        parser.error(f"--rate: {e}")
    return args


def tcp_bursts(network, flows, nbytes, rounds, idle, port=9555):
    """Seconds of each burst (the slowest sender's) in which every host ``h`` of ``flows`` ({sender host: [receiver
    hosts]}) sends ``nbytes`` to each of its receivers at once, one TCP connection per pair."""
    hosts = sorted({r for receivers in flows.values() for r in receivers})
    receivers = [subprocess.Popen(network.command(h, [sys.executable, "-c", _RECEIVER, network.address(h), str(port)]),
                                  stdout=subprocess.PIPE, text=True) for h in hosts]
    procs = []
    try:
        for h, receiver in zip(hosts, receivers):
            if receiver.stdout.readline().strip() != "listening":
                raise RuntimeError(f"the TCP receiver on host {h} did not start")
        procs = [subprocess.Popen(network.command(h, [
            sys.executable, "-c", _SENDER, ",".join(network.address(r) for r in to), str(port), str(nbytes),
            str(rounds), str(idle)]), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            for h, to in flows.items()]
        bursts = []
        for _ in range(rounds):
            for proc in procs:
                if proc.stdout.readline().strip() != "ready":
                    raise RuntimeError("a TCP sender stopped before its burst")
            for proc in procs:
                proc.stdin.write("\n")
                proc.stdin.flush()
            bursts.append(max(float(proc.stdout.readline()) for proc in procs))
        return bursts
    finally:
        for proc in procs + receivers:
            proc.kill()
            proc.wait()


def tf_bursts(network, ps, rows, rounds, idle, port=9600, timeout=300):
    """{"tf-push": seconds, "tf-pull": seconds} of a client on host 0 moving ``rows`` rows of ``ROW_BYTES`` to/from
    each of ``ps`` PS servers (hosts 1..ps) per burst."""
    cluster = {"worker": [f"{network.address(0)}:{port}"],
               "ps": [f"{network.address(i)}:{port}" for i in range(1, ps + 1)]}
    servers = [subprocess.Popen(network.command(i + 1, [sys.executable, "-c", _PS, json.dumps(cluster), str(i)]),
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for i in range(ps)]
    try:
        done = subprocess.run(network.command(0, [sys.executable, "-c", _CLIENT, json.dumps(cluster), str(rows),
                                                  str(rounds), str(idle)]),
                              capture_output=True, text=True, timeout=timeout,
                              env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"the TensorFlow client failed:\n{done.stderr[-1500:]}")
        return json.loads(done.stdout.strip().splitlines()[-1])
    finally:
        for server in servers:
            server.kill()
            server.wait()


def run(hosts, rate_bits, mb, rounds, idle):
    """[{"pattern", "bytes", "median_ms", "floor_ms", "ratio", "bursts_ms"}] for the five patterns (see the module
    doc)."""
    network = netem.Network(hosts, rate=rate_bits)
    reason = network.up()
    if reason:
        raise RuntimeError(f"link_check needs an emulated network: {reason}")
    peers = hosts - 1
    share = int(mb * 1e6) // peers  # bytes per sender (TCP) or per PS task (TensorFlow)
    rows = max(share // ROW_BYTES, 1)
    try:
        patterns = [("tcp, 1 flow from host 1", tcp_bursts(network, {1: [0]}, share * peers, rounds, idle),
                     share * peers),
                    (f"tcp, {peers} flows into host 0 at once",
                     tcp_bursts(network, {h: [0] for h in range(1, hosts)}, share, rounds, idle), share * peers),
                    (f"tcp, all to all: each of {hosts} hosts to each other at once",
                     tcp_bursts(network, {h: [r for r in range(hosts) if r != h] for h in range(hosts)}, share,
                                rounds, idle), share * peers)]
        for name, seconds in tf_bursts(network, peers, rows, rounds, idle).items():
            patterns.append((f"{name}, host 0 <-> {peers} PS tasks", seconds, rows * ROW_BYTES * peers))
    finally:
        network.down()
    out = []
    for name, seconds, volume in patterns:
        floor = 8 * volume / rate_bits if rate_bits else None
        median = statistics.median(seconds)
        out.append({"pattern": name, "bytes": volume, "median_ms": 1000 * median,
                    "floor_ms": 1000 * floor if floor else None, "ratio": median / floor if floor else None,
                    "bursts_ms": [round(1000 * s, 1) for s in seconds]})
    return out


def markdown(rows, rate):
    lines = [f"Bursts on emulated {rate} links, nothing else running:", "",
             "| pattern | MB | median ms | floor ms (bytes / rate) | median / floor | bursts (ms) |",
             "|---|---:|---:|---:|---:|---|"]
    for row in rows:
        floor = "-" if row["floor_ms"] is None else f"{row['floor_ms']:.0f}"
        ratio = "-" if row["ratio"] is None else f"{row['ratio']:.2f}"
        lines.append(f"| {row['pattern']} | {row['bytes'] / 1e6:.1f} | {row['median_ms']:.0f} | {floor} | {ratio} | "
                     f"{', '.join(f'{b:.0f}' for b in row['bursts_ms'])} |")
    return "\n".join(lines)


def main(argv=None):
    args = parse(argv)
    try:
        rows = run(args.hosts, args.rate_bits, args.mb, args.rounds, args.idle)
    except RuntimeError as e:
        print(f"link_check: {e}", file=sys.stderr)
        return 2
    print(markdown(rows, args.rate))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"hosts": args.hosts, "rate": args.rate, "mb": args.mb, "rounds": args.rounds,
                       "idle": args.idle, "patterns": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
