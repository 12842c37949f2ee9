"""Benchmarks kparallax's architectures against plain Horovod Keras and a single process, side by side.

    .venv/bin/python scripts/benchmark.py --model lm1b_small --workers 2 --steps 50 --repeats 3 --json out.json
    .venv/bin/python scripts/benchmark.py --model lm1b_small --workers 2,4,8 --batch_size 4 --steps 20 \\
        --variants kparallax-hybrid,horovod --json bytes.json

Variants run one at a time, alternating (A B C ... A B C ...), each a fresh job on this machine: kparallax-hybrid,
kparallax-allreduce (allgather of sparse gradients), kparallax-allreduce-dense, kparallax-ps (kparallax-run, 1 PS
task where needed), horovod and horovod-dense (plain Horovod Keras under horovodrun, no kparallax code), single
(one plain process; workers=1 only). Same model, same synthetic data, same per-worker batch.

For each variant and worker count: throughput (global items/s: median and min/max over repeats, from the median step
time of each repeat), ms/step, **measured** bytes per step per worker (the loopback interface's transmitted bytes
during the timed steps / steps / workers: every task of a run talks over loopback here, and variants never run at
the same time), and the analytic floor (rows pulled and pushed for PS variants, ring allgather / allreduce volumes
for the others). Writes JSON (``"variants"`` keyed ``<variant>@<workers>``), a Markdown table (``--markdown``) and a
PNG chart (``--png``).

Not implemented yet (the run says so if asked): TensorFlow's ParameterServerStrategy variant (``tf-pss``) and
``--emulate-network`` (network namespaces with tc rate limits).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
WORKER = os.path.join(ROOT, "scripts", "bench_worker.py")
VARIANTS = ["kparallax-hybrid", "kparallax-allreduce", "kparallax-allreduce-dense", "kparallax-ps", "horovod",
            "horovod-dense", "single"]
NOT_YET = {"tf-pss": "TensorFlow ParameterServerStrategy is not implemented in this benchmark yet"}


def parse(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="lm1b_small", help="lm1b_small | lm1b_tiny | resnet50_small | ...")
    parser.add_argument("--workers", default="2", help="comma-separated worker counts, e.g. 1,2,4,8")
    parser.add_argument("--steps", type=int, default=50, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first (tracing)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch_size", type=int, default=None, help="per-worker batch (default: the preset's)")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--json", default="benchmark.json")
    parser.add_argument("--markdown", default=None, help="write the table here too (default: print only)")
    parser.add_argument("--png", default=None, help="write the chart here (matplotlib)")
    parser.add_argument("--emulate-network", dest="emulate_network", default=None)
    parser.add_argument("--timeout", type=float, default=900.0, help="per run")
    args = parser.parse_args(argv)
    if args.emulate_network:
        parser.error("--emulate-network is not implemented yet (it needs network namespaces with tc rate limits). "
                     f"Received: --emulate-network={args.emulate_network}.")
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    for v in args.variants:
        if v in NOT_YET:
            parser.error(f"{NOT_YET[v]}. Received: --variants including {v}.")
        if v not in VARIANTS:
            parser.error(f"unknown variant {v!r}; choose from {VARIANTS}. Received: --variants={','.join(args.variants)}.")
    try:
        args.workers = [int(w) for w in args.workers.split(",")]
    except ValueError:
        parser.error(f"--workers takes integers like 1,2,4. Received: --workers={args.workers}.")
    if any(w < 1 for w in args.workers) or args.steps < 1 or args.repeats < 1:
        parser.error("--workers, --steps and --repeats must be >= 1.")
    return args


def command(variant, workers, args, out):
    bench = [sys.executable, WORKER, "--variant", variant, "--model", args.model, "--steps", str(args.steps),
             "--warmup", str(args.warmup), "--out", out] + (["--batch_size", str(args.batch_size)] if args.batch_size
                                                            else [])
    if variant == "single":
        return bench
    if variant.startswith("horovod"):
        return [os.path.join(os.path.dirname(sys.executable), "horovodrun"), "--gloo", "-np", str(workers), "-H",
                f"localhost:{workers}"] + bench
    needs_ps = variant in ("kparallax-hybrid", "kparallax-ps")
    return [sys.executable, "-m", "kparallax.launch", "--workers", str(workers), "--ps", "1" if needs_ps else "0",
            "--quiet", "--timeout", str(args.timeout), "--log_dir", os.path.dirname(out) + f"/logs-{variant}"] + [
                "--"] + bench


def floor_bytes(result, variant):
    """Analytic minimum bytes one worker sends + receives per step (ring collectives, PS pulls and pushes)."""
    n = result["workers"]
    dense = result["dense_bytes"]
    ring_dense = 2 * (n - 1) / n * dense if n > 1 else 0
    if result["unit"] != "words":  # a dense model: every variant moves the dense gradient once
        return ring_dense if variant != "kparallax-ps" else 2 * dense
    rows = (result["unique_input_rows"] * result["row_bytes"] + result["unique_softmax_rows"]
            * result["softmax_row_bytes"])
    ids = 8 * (result["unique_input_rows"] + result["unique_softmax_rows"])
    if variant == "single":
        return 0
    if variant == "kparallax-hybrid":
        return 2 * rows + ids + ring_dense          # pull touched rows, push their gradients + ids
    if variant == "kparallax-ps":
        return 2 * rows + ids + 2 * dense           # dense variables pulled and pushed whole
    if variant in ("kparallax-allreduce", "horovod"):
        gathered = (n - 1) * (rows * result["items_per_step"] / max(result["unique_input_rows"], 1) / 2 + ids)
        return gathered + ring_dense if n > 1 else 0  # allgather: every worker receives everyone's slices
    return 2 * (n - 1) / n * (dense + result["table_bytes"]) if n > 1 else 0  # sparse_as_dense


def run_once(variant, workers, args, tmp):
    out = os.path.join(tmp, f"{variant}-{workers}-{time.monotonic_ns()}.json")
    started = time.monotonic()
    done = subprocess.run(command(variant, workers, args, out), capture_output=True, text=True,
                          timeout=args.timeout + 120, check=False)
    if done.returncode != 0 or not os.path.exists(out):
        raise RuntimeError(f"{variant}@{workers} failed (exit {done.returncode}):\n{(done.stdout + done.stderr)[-3000:]}")
    with open(out, encoding="utf-8") as f:
        result = json.load(f)
    result["wall_seconds"] = time.monotonic() - started
    return result


def summarize(runs, variant, workers):
    first = runs[0]
    medians = [statistics.median(r["step_seconds"]) for r in runs]
    per_second = [first["items_per_step"] * workers / m for m in medians]
    measured = [r["lo_bytes"] / r["timed_steps"] / workers for r in runs]
    return {"variant": variant, "workers": workers, "unit": first["unit"] + "/s",
            "throughput": statistics.median(per_second), "throughput_min": min(per_second),
            "throughput_max": max(per_second), "ms_per_step": 1000 * statistics.median(medians),
            "bytes_per_step": statistics.median(measured), "floor_bytes_per_step": floor_bytes(first, variant),
            "repeats": len(runs)}


def markdown(results, model):
    lines = [f"| variant | workers | throughput ({next(iter(results.values()))['unit']}) [min-max] | ms/step | "
             "bytes/step/worker (measured) | floor | measured/floor |", "|---|---|---|---|---|---|---|"]
    for entry in results.values():
        ratio = entry["bytes_per_step"] / entry["floor_bytes_per_step"] if entry["floor_bytes_per_step"] else float("nan")
        lines.append(f"| {entry['variant']} | {entry['workers']} | {entry['throughput']:.0f} "
                     f"[{entry['throughput_min']:.0f}-{entry['throughput_max']:.0f}] | {entry['ms_per_step']:.1f} | "
                     f"{entry['bytes_per_step'] / 1e6:.2f} MB | {entry['floor_bytes_per_step'] / 1e6:.2f} MB | "
                     f"{ratio:.2f} |")
    return f"Model {model}\n\n" + "\n".join(lines)


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
    results, raw = {}, {}
    with tempfile.TemporaryDirectory(prefix="kparallax-bench-") as tmp:
        for workers in args.workers:
            plan = [v for v in args.variants if v != "single" or workers == 1]
            for repeat in range(args.repeats):
                for variant in plan:
                    print(f"[{repeat + 1}/{args.repeats}] {variant}@{workers} ...", flush=True)
                    raw.setdefault(f"{variant}@{workers}", []).append(run_once(variant, workers, args, tmp))
            for variant in plan:
                results[f"{variant}@{workers}"] = summarize(raw[f"{variant}@{workers}"], variant, workers)
    report = {"model": args.model, "steps": args.steps, "warmup": args.warmup, "repeats": args.repeats,
              "batch_size": args.batch_size, "machine": {"cpus": os.cpu_count()}, "variants": results}
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


if __name__ == "__main__":
    sys.exit(main())
