"""Where the time of a step goes: TensorFlow profiler traces of benchmark runs, summarized per step.

``python scripts/benchmark.py ... --profile DIR`` traces every worker's timed steps of each variant into
``DIR/<variant>@<workers>/worker-<rank>/``; this module reads the XPlane files (``*.xplane.pb``) written there.

* Ops (worker 0): per timed step, the *self* time of every traced event on the host threads (an event's duration
  minus the events nested in it on the same thread) of the ops on TensorFlow's op threads, grouped into categories
  (matmuls, the rest of the model's compute, embedding gathers and scatters, optimizer updates, the PS path's sends
  and receives, executor and function overhead), and the Python thread's split of each step: the step function's
  wall time and what runs outside it (callbacks, eager collectives). Horovod's and gRPC's own threads are not traced
  by TensorFlow (see the CPU profile by role of the benchmark, or ``perf``). Op threads run in parallel: their sum
  can exceed a step.
* Phases (``--phases``, every worker; the workers share this machine's clock): for the k-th timed step of every
  worker, when its step function started, when its backprop ended (the last op named ``gradient_tape/...``, as
  Keras' ``train_step`` names the gradient ops) and when its step function returned, in ms after the first worker
  started that step; medians over the steps. In a synchronous step nobody finishes before the slowest worker's
  gradients have been exchanged and applied, so the *tail* (the last backprop's end to the last step's end) is what
  the exchange and the update add after the compute. Marks in between: when the step read its batch (before it, the
  step function is being dispatched, to the PS tasks too), when the PS answered the worker's pushes (kparallax's
  synchronous PS path), and any ``--mark NAME=REGEX`` (the first op whose name matches, e.g. the model's first
  compute op: the time from the batch to it is the forward's wait for its embedding rows).

    python -m kparallax_bench.op_profile DIR [--steps N] [--top 12] [--phases [--mark NAME=REGEX ...]]
        [--json out.json]
"""

import argparse
import collections
import glob
import json
import os
import re
import statistics
import sys

CATEGORIES = (  # (category, regular expression on the op type), first match wins; op threads only
    ("PS path: sends/receives, remote calls", r"^_Send|^_Recv|^_HostSend|^_HostRecv|Remote|RecvTensor|"
                                              r"RunComponentFunction"),
    ("embedding gathers/scatters, unique", r"Gather|Scatter|UnsortedSegment|^Unique|SparseSegment|"
                                           r"DynamicPartition|DynamicStitch"),
    ("optimizer updates, variable writes", r"ResourceApply|ResourceSparseApply|^Assign"),
    ("executor and function overhead", r"Executor|Function|PartitionedCall|^While$|^If$|^_Arg$|^_Retval$|"
                                       r"ReadVariableOp|^Identity$|^NoOp$|^Const$|ParallelFor"),
    ("model compute: matmul", r"MatMul"),
    ("model compute: the rest (activations, loss, ...)", r".*"),
)


def _xspaces(directory):
    paths = sorted(glob.glob(os.path.join(directory, "**", "*.xplane.pb"), recursive=True))
    if not paths:
        raise FileNotFoundError(f"No *.xplane.pb under {directory}: run the benchmark with --profile DIR first. "
                                f"Received: {directory}.")
    from tensorflow.tsl.profiler.protobuf import xplane_pb2  # pylint: disable=import-outside-toplevel
    for path in paths:
        space = xplane_pb2.XSpace()
        with open(path, "rb") as f:
            space.ParseFromString(f.read())
        yield path, space


def _run_dirs(directory):
    """(label, the directory of worker 0's trace) for every ``DIR/<label>/`` (``worker-0/`` inside it, or the label
    directory itself for traces of one process)."""
    for label in sorted(os.listdir(directory)):
        run_dir = os.path.join(directory, label)
        if os.path.isdir(run_dir):
            worker0 = os.path.join(run_dir, "worker-0")
            yield label, worker0 if os.path.isdir(worker0) else run_dir


def _op_type(name):
    """``scope/op_name:OpType`` (a kernel's trace name) -> ``OpType``; other names unchanged."""
    name = name.split("#", 1)[0]  # TraceMe metadata ("train#step_num=3#")
    return name.rsplit(":", 1)[1] if ":" in name and "::" not in name else name


def _host_lines(space):
    """(line, {metadata id: event name}, on the Python thread) for every thread line of the host planes."""
    for plane in space.planes:
        if plane.name.startswith("/host:"):
            names = {k: m.name for k, m in plane.event_metadata.items()}
            for line in plane.lines:
                yield line, names, line.name.startswith("python")


def self_times(space):
    """Per step ingredients of one trace: ({op type: self picoseconds} on TensorFlow's op threads, {"train": ps,
    "train_function": ps} on the Python thread, number of "train" events = steps)."""
    ops, python, steps = collections.Counter(), collections.Counter(), 0
    for line, names, on_python in _host_lines(space):
        events = sorted(((e.offset_ps, e.duration_ps, names.get(e.metadata_id, "?")) for e in line.events),
                        key=lambda e: (e[0], -e[1]))
        stack = []  # (end, key) of the enclosing events on this thread
        for start, duration, name in events:
            key = _op_type(name)
            if on_python:
                if key in ("train", "train_function"):
                    python[key] += duration
                    steps += key == "train"  # Keras' fit traces each step as "train"
                continue
            while stack and stack[-1][0] <= start:
                stack.pop()
            if stack and start + duration <= stack[-1][0]:
                ops[stack[-1][1]] -= duration  # nested: not the parent's own time
            elif stack:
                continue  # overlaps its neighbour without nesting (async op events): counted by neither
            ops[key] += duration
            stack.append((start + duration, key))
    return ops, python, steps


def categorize(totals):
    by_category = collections.Counter()
    for name, ps in totals.items():
        for category, pattern in CATEGORIES:
            if re.search(pattern, name):
                by_category[category] += ps
                break
    return by_category


def summarize(directory, steps=None, top=12):
    """{run label: per-step milliseconds} for every ``DIR/<label>/`` holding traces: ``ops`` by category (self time
    on TensorFlow's op threads, which run in parallel: their sum can exceed the step), ``step_function`` (wall
    time of Keras' train function), ``outside_step_function`` (the rest of each step on the Python thread:
    callbacks, eager collectives), ``top_ops``."""
    result = {}
    for label, run_dir in _run_dirs(directory):
        ops, python, counted = collections.Counter(), collections.Counter(), 0
        for _, space in _xspaces(run_dir):
            o, p, c = self_times(space)
            ops.update(o)
            python.update(p)
            counted += c
        n = steps or counted
        if not n:
            raise ValueError(f"{run_dir}: no train steps found in the trace; pass --steps. Received: {run_dir}.")
        per_step = {k: v / 1e9 / n for k, v in categorize(ops).items()}
        result[label] = {"steps": n, "ops_ms": per_step, "ops_total_ms": sum(per_step.values()),
                         "step_function_ms": python["train_function"] / 1e9 / n,
                         "outside_step_function_ms": (python["train"] - python["train_function"]) / 1e9 / n,
                         "top_ops": [(k, v / 1e9 / n) for k, v in ops.most_common(top)]}
    return result


def events(space):
    """Every traced event of the host planes of ``space``: (start ms, duration ms, name, on the Python thread),
    on the machine's clock."""
    return [((line.timestamp_ns * 1000 + e.offset_ps) / 1e9, e.duration_ps / 1e9, names.get(e.metadata_id, "?"),
             on_python) for line, names, on_python in _host_lines(space) for e in line.events]


# Ops marking a point of a step (first start inside the step function; worker rows without such an op show "-"):
# - every step reads its batch first (the op that starts what the step computes; before it, the step function is
#   being dispatched, to the PS tasks' parts of it too);
# - kparallax's synchronous PS path sums the tokens of its end-of-step barrier once the PS answered every push of
#   this worker (and the updates those pushes made, if they were their step's last); Grappler may rename the sum
#   (``ArithmeticOptimizer/AddOpsRewrite_kp_step_done/AddN``).
MARKS = {"batch read": r"^IteratorGetNext", "PS answered (end barrier)": r"kp_step_done/AddN"}


def parse_marks(texts):
    """``NAME=REGEX`` texts (``--mark``) -> {name: pattern}, after ``MARKS``; each must name one and compile."""
    marks = dict(MARKS)
    for text in texts:
        name, sep, pattern = text.partition("=")
        if not sep or not name.strip() or not pattern:
            raise ValueError("--mark takes NAME=REGEX, e.g. 'forward started=lm1b/lstm/transpose'. "
                             f"Received: {text!r}.")
        try:
            re.compile(pattern)
        except re.error as e:
            raise ValueError(f"--mark {name.strip()}: not a regular expression ({e}). Received: {pattern!r}.") from None
        marks[name.strip()] = pattern
    return marks


def step_phases(by_worker, marks=None):
    """Per-step phases of a synchronous run from every worker's events (``events``): {rank: [(start ms,
    duration ms, name, on_python)]} -> {"steps": n, "workers": {rank: {"start", "backprop_done", "end", <mark>...}},
    "last_backprop_done", "step", "tail"} in ms after the first worker started the step, medians over the timed
    steps (the k-th step function of each worker is step k; the shortest trace bounds n). "backprop_done" is the end
    of the worker's last op named ``gradient_tape/...`` inside its step function (None if it has none); each of
    ``marks`` ({name: regular expression}, default ``MARKS``) is the start of the first op matching it."""
    marks = MARKS if marks is None else marks
    steps = {r: sorted((t, t + d) for t, d, n, py in ev if py and n.split("#", 1)[0] == "train_function")
             for r, ev in by_worker.items()}
    n = min((len(s) for s in steps.values()), default=0)
    if not n:
        raise ValueError("no train steps found in every worker's trace. Received: workers "
                         f"{sorted(by_worker)} with {[len(steps[r]) for r in sorted(by_worker)]} steps.")
    grads = {r: sorted((t, t + d) for t, d, name, py in ev if not py and name.startswith("gradient_tape/"))
             for r, ev in by_worker.items()}
    rows = {r: {"start": [], "backprop_done": [], "end": [], **{m: [] for m in marks}} for r in by_worker}
    marked = {r: {m: sorted(t for t, _, name, py in ev if not py and re.search(pattern, name))
                  for m, pattern in marks.items()} for r, ev in by_worker.items()}
    last, length, tail = [], [], []
    for k in range(n):
        origin = min(steps[r][k][0] for r in by_worker)
        done = {}
        for r in by_worker:
            start, end = steps[r][k]
            ends = [e for s, e in grads[r] if start <= s <= end]
            done[r] = max(ends) - origin if ends else None
            rows[r]["start"].append(start - origin)
            rows[r]["end"].append(end - origin)
            rows[r]["backprop_done"].append(done[r])
            for m, times in marked[r].items():
                inside = [t for t in times if start <= t <= end]
                rows[r][m].append(inside[0] - origin if inside else None)
        finished = max(steps[r][k][1] for r in by_worker) - origin
        length.append(finished)
        if all(d is not None for d in done.values()):
            last.append(max(done.values()))
            tail.append(finished - last[-1])

    def median(values):
        values = [v for v in values if v is not None]
        return statistics.median(values) if values else None
    return {"steps": n, "workers": {r: {k: median(v) for k, v in row.items()} for r, row in sorted(rows.items())},
            "last_backprop_done": median(last), "step": median(length), "tail": median(tail), "marks": list(marks)}


def phases(directory, marks=None):
    """{label: ``step_phases``} for every ``DIR/<label>/`` holding ``worker-<rank>/`` traces (``marks``: as there)."""
    result = {}
    for label, _ in _run_dirs(directory):
        workers = sorted(glob.glob(os.path.join(directory, label, "worker-*")))
        if not workers:
            continue
        by_worker = {}
        for path in workers:
            rank = int(path.rsplit("-", 1)[1])
            by_worker[rank] = [e for _, space in _xspaces(path) for e in events(space)]
        result[label] = step_phases(by_worker, marks)
    if not result:
        raise FileNotFoundError(f"No worker-<rank>/ traces under {directory}: run the benchmark with --profile DIR "
                                f"first. Received: {directory}.")
    return result


def phases_markdown(result):
    """Every run's phases as a table: backprop done and the marks in the order they happen, in ms (one decimal for
    steps under 30 ms)."""
    lines = []
    for label, entry in result.items():
        digits = 1 if entry["step"] < 30 else 0

        def cell(value, digits=digits):
            return "-" if value is None else f"{value:.{digits}f}"

        times = {c: [row[c] for row in entry["workers"].values() if row.get(c) is not None]
                 for c in ["backprop_done"] + list(entry.get("marks", []))}
        columns = sorted((c for c, seen in times.items() if seen or c == "backprop_done"),
                         key=lambda c: min(times[c], default=0))
        titles = [c.replace("backprop_done", "backprop done") for c in columns]
        lines += ["", f"{label}: ms after the first worker started the step (medians over {entry['steps']} steps)", "",
                  "| worker | step function started | " + "".join(f"{t} | " for t in titles)
                  + "step function returned |", "|---|---:|" + "---:|" * len(columns) + "---:|"]
        for rank, row in entry["workers"].items():
            lines.append(f"| {rank} | {cell(row['start'])} | " + "".join(f"{cell(row[c])} | " for c in columns)
                         + f"{cell(row['end'])} |")
        if entry["tail"] is not None:
            lines.append(f"\nThe slowest worker's backprop is done at {entry['last_backprop_done']:.0f} ms of a "
                         f"{entry['step']:.0f} ms step: the tail after it (its last pushes or collectives, the "
                         f"update, the end-of-step synchronization) takes {entry['tail']:.0f} ms "
                         f"({100 * entry['tail'] / entry['step']:.0f}%).")
    return "\n".join(lines[1:])


def markdown(result):
    labels = list(result)
    lines = ["| worker 0, ms per step | " + " | ".join(labels) + " |", "|---|" + "---:|" * len(labels)]
    for category, _ in CATEGORIES:
        lines.append(f"| {category} | " + " | ".join(f"{result[l]['ops_ms'].get(category, 0.0):.1f}"
                                                      for l in labels) + " |")
    rows = (("**op threads, all (CPU-bound self time)**", "ops_total_ms"),
            ("step function, wall (Python waits for it)", "step_function_ms"),
            ("Python outside the step function (callbacks, eager ops)", "outside_step_function_ms"))
    for title, key in rows:
        lines.append(f"| {title} | " + " | ".join(f"{result[l][key]:.1f}" for l in labels) + " |")
    lines.append("| steps traced | " + " | ".join(str(result[l]["steps"]) for l in labels) + " |")
    for label in labels:
        lines.append("")
        lines.append(f"{label}, top op types by self time (ms per step): " + ", ".join(
            f"{name} {ms:.1f}" for name, ms in result[label]["top_ops"]))
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("directory")
    parser.add_argument("--steps", type=int, default=None, help="timed steps traced (default: counted in the trace)")
    parser.add_argument("--top", type=int, default=12)
    parser.add_argument("--phases", action="store_true",
                        help="also every worker's step phases (start, backprop done, end) and the step's tail")
    parser.add_argument("--mark", action="append", default=[], metavar="NAME=REGEX",
                        help="with --phases, also when the first op whose name matches REGEX started (repeatable)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    try:
        marks = parse_marks(args.mark)
        result = summarize(args.directory, args.steps, args.top)
        if args.phases:
            for label, entry in phases(args.directory, marks).items():
                result[label]["phases"] = entry
    except (FileNotFoundError, ValueError) as e:
        print(f"op_profile: {e}", file=sys.stderr)
        return 2
    print(markdown(result))
    if args.phases:
        print()
        print(phases_markdown({label: entry["phases"] for label, entry in result.items() if "phases" in entry}))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
