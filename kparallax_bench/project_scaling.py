"""Projects benchmark measurements to clusters with an alpha-beta model, beside Parallax's published figures.

    .venv/bin/python scripts/project_scaling.py --bench docs/benchmarks/lm1b_small_net.json \\
        --validate docs/benchmarks/lm1b_small_1gbit.json --model lm1b --machines 8 --per_machine 6 --bandwidth 100gbit

The model, per variant v at N workers (M machines x G workers each, link bandwidth B per direction per machine,
per-message latency alpha):

    t(v, N) = t_compute + kappa_v * link_bytes(v, N, G, P) / B + alpha * rounds(v, N)

- ``link_bytes`` (kparallax_bench/traffic.py) is the analytic volume over the busiest machine link in one direction: flat
  ring collectives (every edge carries the same volume), PS traffic into the PS machines (P of them), allgather
  growing with N; ``rounds`` the sequential messages.
- ``kappa_v`` = measured bytes / analytic floor of that variant in ``--bench`` (largest worker count): protocol
  overhead and anything the implementation moves beyond the floor (e.g. tf-pss's optimizer pulling whole tables).
- Validation (``--validate``): runs with ``--emulate-network RATE`` are predicted from the ``--bench`` run at the
  same worker count (its ms/step as the compute time; that run must be emulated with ``unlimited`` links, so both
  have one worker per host) and compared with what was measured. Trust the projection only as far as this holds.
- Projection: ``t_compute`` of the target model on the target device is not measurable here (no GPU). Given
  ``--compute_ms``, it is used; otherwise it is calibrated so that kparallax-hybrid's projection equals Parallax's
  published hybrid figure, and the model then predicts the others (a falsifiable use: one published number in,
  the others out). The bandwidth at which the model would reproduce the published ratios is printed too.
"""

import argparse
import json
import os
import sys

from kparallax_bench import netem
from kparallax_bench import outputs
from kparallax_bench import traffic


# Parallax (EuroSys 2019), 8 machines x 6 GPUs, 100 Gbit/s: throughput at 48 workers.
PUBLISHED = {
    "lm1b": {"unit": "words/s", "kparallax-hybrid": 277e3, "horovod": 39e3, "kparallax-ps": 101e3},
    "resnet50": {"unit": "images/s", "kparallax-hybrid": 7.54e3, "horovod": 7.51e3},
}
PUBLISHED_NAMES = {"kparallax-hybrid": "Parallax hybrid", "horovod": "Horovod", "kparallax-ps": "TF-PS"}
PAPER_BATCH = {"lm1b": 128, "resnet50": 64}


def parse(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bench", required=True, help="benchmark JSON (emulate_network 'unlimited' preferred)")
    parser.add_argument("--validate", action="append", default=[], help="rate-limited benchmark JSON(s)")
    parser.add_argument("--model", default="lm1b", help="target model: lm1b | resnet50")
    parser.add_argument("--machines", type=int, default=8)
    parser.add_argument("--per_machine", type=int, default=6, help="workers (GPUs) per machine")
    parser.add_argument("--ps_machines", type=int, default=None, help="machines holding PS tasks (default: all)")
    parser.add_argument("--bandwidth", default="100gbit")
    parser.add_argument("--alpha_us", type=float, default=20.0, help="latency per message round, microseconds")
    parser.add_argument("--compute_ms", type=float, default=None, help="per-worker compute ms per step (target)")
    parser.add_argument("--json", default=None, help="write the projection here")
    args = parser.parse_args(argv)
    try:
        args.rate = netem.parse_rate(args.bandwidth)
    except ValueError as e:
        parser.error(f"--bandwidth: {e}")
    if args.rate is None:
        parser.error(f"--bandwidth must be a rate. Received: --bandwidth={args.bandwidth}.")
    if args.model not in PUBLISHED:
        parser.error(f"--model must be one of {sorted(PUBLISHED)}. Received: --model={args.model}.")
    for flag in ("machines", "per_machine"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag} must be >= 1. Received: --{flag}={getattr(args, flag)}.")
    if args.ps_machines is not None and not 1 <= args.ps_machines <= args.machines:
        parser.error(f"--ps_machines must be between 1 and --machines ({args.machines}). "
                     f"Received: --ps_machines={args.ps_machines}.")
    if args.alpha_us < 0 or (args.compute_ms is not None and args.compute_ms <= 0):
        parser.error(f"--alpha_us must be >= 0 and --compute_ms > 0. Received: --alpha_us={args.alpha_us}, "
                     f"--compute_ms={args.compute_ms}.")
    outputs.check_dirs(parser, args, ("json",))
    return args


def load(path):
    try:
        with open(path, encoding="utf-8") as f:
            report = json.load(f)
    except (OSError, ValueError) as e:
        raise SystemExit(f"project_scaling.py: cannot read benchmark JSON {path!r} ({e}). Write one with "
                         "scripts/benchmark.py --json FILE.") from None
    if not report.get("variants") or "shape" not in next(iter(report["variants"].values())):
        raise SystemExit(f"project_scaling.py: {path!r} has no per-variant shapes; re-run scripts/benchmark.py.")
    if report.get("workers_per_host", 1) != 1:
        raise SystemExit(f"project_scaling.py: {path!r} ran several workers per emulated host; the model is fitted "
                         "on one worker per host (run scripts/benchmark.py without --workers_per_host). Received: "
                         f"workers_per_host={report['workers_per_host']}.")
    return report


def kappas(report):
    """measured / floor bytes per variant, at its largest worker count."""
    out = {}
    for entry in sorted(report["variants"].values(), key=lambda e: e["workers"]):
        if entry["floor_bytes_per_step"] > 0:
            out[entry["variant"]] = entry["bytes_per_step"] / entry["floor_bytes_per_step"]
    return out


def step_seconds(shape, variant, n, per_machine, ps_machines, rate_bits, alpha, compute, kappa):
    wire = kappa.get(variant, 1.0) * traffic.link_bytes(shape, variant, n, per_machine, ps_machines)
    return compute + 8 * wire / rate_bits + alpha * traffic.rounds(variant, n)


def validate(bench, report, alpha):
    """Rows of (key, measured ms, predicted ms, error) for each variant@N in a rate-limited report."""
    rate = netem.parse_rate(report.get("emulate_network") or "unlimited")
    if rate is None:
        raise SystemExit("project_scaling.py: a --validate report must come from --emulate-network RATE.")
    kappa, rows = kappas(bench), []
    for key, entry in report["variants"].items():
        base = bench["variants"].get(key)
        if base is None or entry["workers"] < 2:
            continue
        ps = min(report.get("ps", 1), entry["workers"])
        predicted = step_seconds(entry["shape"], entry["variant"], entry["workers"], 1, ps, rate, alpha,
                                 base["ms_per_step"] / 1000, kappa)
        rows.append((key, entry["ms_per_step"], 1000 * predicted, 1000 * predicted / entry["ms_per_step"] - 1))
    return rate, rows


def target_shape(model):
    if model == "lm1b":
        from kparallax_models import lm1b  # pylint: disable=import-outside-toplevel
        config = lm1b.preset("lm1b", batch_size=PAPER_BATCH["lm1b"])
        return traffic.lm1b_shape(config, *traffic.lm1b_windows(config))
    from kparallax_models import resnet  # pylint: disable=import-outside-toplevel
    built = resnet.build(resnet.preset("resnet50"))
    return {"unit": "images", "items_per_step": PAPER_BATCH["resnet50"],
            "dense_bytes": 4 * sum(int(w.shape.num_elements()) for w in built.trainable_weights)}


def project(args, bench):
    shape = target_shape(args.model)
    kappa = kappas(bench)
    n, g = args.machines * args.per_machine, args.per_machine
    ps = args.ps_machines or args.machines
    alpha = args.alpha_us * 1e-6
    published = PUBLISHED[args.model]
    comm = {v: step_seconds(shape, v, n, g, ps, args.rate, alpha, 0.0, kappa) for v in
            ("kparallax-hybrid", "horovod", "kparallax-ps", "tf-pss", "kparallax-allreduce-dense")}
    if args.compute_ms is not None:
        compute, how = args.compute_ms / 1000, f"--compute_ms {args.compute_ms}"
    else:
        compute = n * shape["items_per_step"] / published["kparallax-hybrid"] - comm["kparallax-hybrid"]
        how = "calibrated: projected kparallax-hybrid = Parallax's published hybrid figure"
    rows = {v: n * shape["items_per_step"] / (compute + c) for v, c in comm.items()}
    return {"model": args.model, "workers": n, "machines": args.machines, "per_machine": g,
            "bandwidth": args.bandwidth, "compute_ms": 1000 * compute, "compute_from": how, "kappa": kappa,
            "comm_ms": {v: 1000 * c for v, c in comm.items()}, "throughput": rows, "published": published,
            "bandwidth_for_published_ratios": needed_bandwidth(shape, n, g, ps, alpha, compute, kappa, published)}


def needed_bandwidth(shape, n, g, ps, alpha, compute, kappa, published):
    """Per peer, the link rate (bit/s) at which the model gives the published hybrid/peer ratio (None: never)."""
    out = {}
    for peer in ("horovod", "kparallax-ps"):
        if peer not in published:
            continue
        target = published["kparallax-hybrid"] / published[peer]

        def ratio(rate):
            return (step_seconds(shape, peer, n, g, ps, rate, alpha, compute, kappa)
                    / step_seconds(shape, "kparallax-hybrid", n, g, ps, rate, alpha, compute, kappa))
        lo, hi = 1e6, 1e12
        if ratio(lo) < target:
            out[peer] = None
            continue
        for _ in range(100):   # the ratio falls as the rate rises: bisect in log space
            mid = (lo * hi) ** 0.5
            lo, hi = (mid, hi) if ratio(mid) > target else (lo, mid)
        out[peer] = lo
    return out


def main(argv=None):
    args = parse(argv)
    bench = load(args.bench)
    out = {}
    for path in args.validate:
        rate, rows = validate(bench, load(path), args.alpha_us * 1e-6)
        print(f"Validation against {os.path.basename(path)} ({rate / 1e9:g} Gbit/s links):")
        print("| variant@workers | measured ms/step | predicted ms/step | error |\n|---|---|---|---|")
        for key, measured, predicted, error in rows:
            print(f"| {key} | {measured:.1f} | {predicted:.1f} | {100 * error:+.0f}% |")
        out.setdefault("validation", {})[os.path.basename(path)] = rows
    result = project(args, bench)
    out["projection"] = result
    unit, published = PUBLISHED[args.model]["unit"], result["published"]
    print(f"\nProjection: {args.model}, {result['workers']} workers ({args.machines} x {args.per_machine}), "
          f"{args.bandwidth} links; compute {result['compute_ms']:.0f} ms/step ({result['compute_from']}).")
    print(f"| variant | projected {unit} | communication ms/step | kappa | published (Parallax paper) |")
    print("|---|---|---|---|---|")
    for variant, value in result["throughput"].items():
        paper = published.get(variant)
        name = PUBLISHED_NAMES.get(variant, "")
        kappa = result["kappa"].get(variant)
        print(f"| {variant} | {value:,.0f} | {result['comm_ms'][variant]:.1f} | "
              f"{f'{kappa:.2f}' if kappa else '1 (not measured)'} | "
              f"{f'{name} {paper:,.0f}' if paper else '-'} |")
    hybrid = result["throughput"]["kparallax-hybrid"]
    for peer in ("horovod", "kparallax-ps"):
        if peer in published:
            needed = result["bandwidth_for_published_ratios"][peer]
            print(f"hybrid / {peer}: projected {hybrid / result['throughput'][peer]:.2f}x, published "
                  f"{published['kparallax-hybrid'] / published[peer]:.2f}x; the model reaches the published ratio "
                  + (f"at links of {needed / 1e9:.2f} Gbit/s or slower" if needed else "at no link rate"))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(out, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
