"""Where worker 0's time goes: TensorFlow profiler traces of benchmark runs, summarized per step.

``python scripts/benchmark.py ... --profile DIR`` traces worker 0's timed steps of each variant into
``DIR/<variant>@<workers>/``; this module reads the XPlane files (``*.xplane.pb``) written there and reports, per
timed step, the *self* time of every traced event on the host threads (an event's duration minus the events nested
in it on the same thread) of the ops on TensorFlow's op threads, grouped into categories (matmuls, the rest of the
model's compute, embedding gathers and scatters, optimizer updates, the PS path's sends and receives, executor and
function overhead), and the Python thread's split of each step: the step function's wall time and what runs outside
it (callbacks, eager collectives). Horovod's and gRPC's own threads are not traced by TensorFlow (see the CPU
profile by role of the benchmark, or ``perf``). Op threads run in parallel: their sum can exceed a step.

    python -m kparallax_bench.op_profile DIR [--steps N] [--top 12] [--json out.json]
"""

import argparse
import collections
import glob
import json
import os
import re
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


def _op_type(name):
    """``scope/op_name:OpType`` (a kernel's trace name) -> ``OpType``; other names unchanged."""
    name = name.split("#", 1)[0]  # TraceMe metadata ("train#step_num=3#")
    return name.rsplit(":", 1)[1] if ":" in name and "::" not in name else name


def self_times(space):
    """Per step ingredients of one trace: ({op type: self picoseconds} on TensorFlow's op threads, {"train": ps,
    "train_function": ps} on the Python thread, number of "train" events = steps)."""
    ops, python, steps = collections.Counter(), collections.Counter(), 0
    for plane in space.planes:
        if not plane.name.startswith("/host:"):
            continue
        names = {k: m.name for k, m in plane.event_metadata.items()}
        for line in plane.lines:
            on_python = line.name.startswith("python")
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
    for label in sorted(os.listdir(directory)):
        run_dir = os.path.join(directory, label)
        if not os.path.isdir(run_dir):
            continue
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
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    try:
        result = summarize(args.directory, args.steps, args.top)
    except (FileNotFoundError, ValueError) as e:
        print(f"op_profile: {e}", file=sys.stderr)
        return 2
    print(markdown(result))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
