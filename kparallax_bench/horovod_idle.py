"""CPU that Horovod's background loop burns with and without dynamic process sets (run under kparallax-run).

    python -m kparallax.launch --workers 2 --ps 0 -- python -m kparallax_bench.horovod_idle --process_sets static
    python -m kparallax.launch --workers 2 --ps 0 -- python -m kparallax_bench.horovod_idle --process_sets dynamic

Each worker initializes Horovod (``hvd.init()`` or ``hvd.init(process_sets="dynamic")``), then measures its
process CPU seconds per wall second while idle (no collective pending: only Horovod's cycle runs), and its CPU
milliseconds per allreduce of a 4 MB tensor. Worker 0 prints one JSON line per worker. Why it matters: Horovod
0.28.1 with dynamic process sets runs one more global Gloo allgather on every cycle (``_compat/horovod.py``); on a
machine whose cores the model saturates, that CPU comes out of the model's kernels.
"""

import argparse
import json
import time

import horovod.tensorflow as hvd
import tensorflow as tf


def measure(idle_seconds, allreduces):
    """(idle CPU-s per s, CPU-ms per allreduce) of this process."""
    hvd.allreduce(tf.constant(1.0), name="kp_idle_start").numpy()
    start, cpu = time.monotonic(), time.process_time()
    time.sleep(idle_seconds)
    idle = (time.process_time() - cpu) / (time.monotonic() - start)
    x = tf.ones([1 << 20])
    hvd.allreduce(x, name="kp_idle_busy_start").numpy()
    cpu = time.process_time()
    for _ in range(allreduces):
        hvd.allreduce(x, name="kp_idle_busy").numpy()
    return idle, 1000.0 * (time.process_time() - cpu) / allreduces


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--process_sets", choices=("static", "dynamic"), default="static")
    parser.add_argument("--idle_seconds", type=float, default=10.0)
    parser.add_argument("--allreduces", type=int, default=200)
    args = parser.parse_args(argv)
    if args.idle_seconds <= 0 or args.allreduces < 1:
        parser.error(f"--idle_seconds must be > 0 and --allreduces >= 1. Received: --idle_seconds="
                     f"{args.idle_seconds}, --allreduces={args.allreduces}.")
    if args.process_sets == "dynamic":
        hvd.init(process_sets="dynamic")
    else:
        hvd.init()
    idle, busy = measure(args.idle_seconds, args.allreduces)
    rows = hvd.allgather(tf.constant([[idle, busy]], tf.float64), name="kp_idle_results").numpy()
    if hvd.rank() == 0:
        for rank, (idle, busy) in enumerate(rows):
            print(json.dumps({"rank": rank, "process_sets": args.process_sets, "idle_cpu_s_per_s": round(idle, 4),
                              "cpu_ms_per_allreduce_4mb": round(busy, 2)}), flush=True)


if __name__ == "__main__":
    main()
