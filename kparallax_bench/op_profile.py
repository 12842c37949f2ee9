"""Where worker 0's time goes: TensorFlow profiler traces of benchmark runs, summarized per step.

``python scripts/benchmark.py ... --profile DIR`` traces worker 0's timed steps of each variant into
``DIR/<variant>@<workers>/``; this module reads the XPlane files (``*.xplane.pb``) written there and reports, per
timed step, the *self* time of every traced event on the host threads (an event's duration minus the events nested
in it on the same thread), grouped into categories: the model's compute, embedding gathers and scatters, optimizer
updates, the PS path (remote calls, sends and receives), Horovod, the input pipeline, and the runtime's own
function/executor overhead. Threads run in parallel, so the sum can exceed the wall time of a step.

    python -m kparallax_bench.op_profile DIR [--steps N] [--top 12] [--json out.json]
"""

import argparse
import collections
import glob
import json
import os
import re
import sys

CATEGORIES = (  # (category, regular expression on the event name), first match wins
    ("Horovod collectives", r"horovod|Horovod|gloo"),
    ("PS path: remote calls, send/recv", r"_Send|_Recv|_HostSend|_HostRecv|Remote|remote|RecvTensor|Rendezvous|"
                                         r"EagerClient|RunComponentFunction|grpc|Grpc|EnqueueRequest|"
                                         r"ClusterFunctionLibraryRuntime|ProcessFunctionLibraryRuntime::Run"),
    ("embedding gathers/scatters, unique", r"Gather|Scatter|UnsortedSegment|Unique|SparseSegment|"
                                           r"DynamicPartition|DynamicStitch"),
    ("optimizer updates", r"ResourceApply|ResourceSparseApply|ApplyAdagrad|ApplyGradientDescent|ApplyAdam|"
                          r"AssignAddVariableOp|AssignVariableOp|AssignSubVariableOp"),
    ("input pipeline", r"Iterator|tf_data|Dataset|Prefetch"),
    ("runtime: functions, executor, eager dispatch", r"__inference|__forward|__backward|Executor|Eager|"
                                                      r"FunctionRun|Function|PartitionedCall|While|If|"
                                                      r"ThreadpoolListener|TraceMe|InstantiatedCapturedFunction|"
                                                      r"train|_Arg|_Retval|ReadVariableOp|VarHandleOp|Identity|"
                                                      r"NoOp|Const"),
    ("model compute (matmul, activations, loss, ...)", r".*"),
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
    """({event name: self picoseconds}, train step count) over the host plane's threads."""
    totals, steps = collections.Counter(), 0
    for plane in space.planes:
        if not plane.name.startswith("/host:"):
            continue
        names = {k: m.name for k, m in plane.event_metadata.items()}
        for line in plane.lines:
            events = sorted(((e.offset_ps, e.duration_ps, names.get(e.metadata_id, "?")) for e in line.events),
                            key=lambda e: (e[0], -e[1]))
            stack = []  # (end, key) of the enclosing events on this thread
            for start, duration, name in events:
                key = _op_type(name)
                while stack and stack[-1][0] <= start:
                    stack.pop()
                if stack:
                    totals[stack[-1][1]] -= duration  # nested: not the parent's own time
                totals[key] += duration
                stack.append((start + duration, key))
                steps += key == "train"  # Keras' fit traces each step as "train"
    return totals, steps


def categorize(totals):
    by_category = collections.Counter()
    for name, ps in totals.items():
        for category, pattern in CATEGORIES:
            if re.search(pattern, name):
                by_category[category] += ps
                break
    return by_category


def summarize(directory, steps=None, top=12):
    """{run label: {"steps", "ms_per_step": {category: ms}, "top_ops": [(name, ms)]}} for DIR/<label>/..."""
    result = {}
    for label in sorted(os.listdir(directory)):
        run_dir = os.path.join(directory, label)
        if not os.path.isdir(run_dir):
            continue
        totals, counted = collections.Counter(), 0
        for _, space in _xspaces(run_dir):
            t, s = self_times(space)
            totals.update(t)
            counted += s
        n = steps or counted
        if not n:
            raise ValueError(f"{run_dir}: no train steps found in the trace; pass --steps. Received: {run_dir}.")
        ms = {k: v / 1e9 / n for k, v in categorize(totals).items()}
        result[label] = {"steps": n, "ms_per_step": dict(sorted(ms.items(), key=lambda kv: -kv[1])),
                         "total_ms_per_step": sum(ms.values()),
                         "top_ops": [(k, v / 1e9 / n) for k, v in totals.most_common(top)]}
    return result


def markdown(result):
    labels = list(result)
    categories = [c for c, _ in CATEGORIES]
    lines = ["| worker 0, self time per step (ms) | " + " | ".join(labels) + " |",
             "|---|" + "---:|" * len(labels)]
    for category in categories:
        lines.append(f"| {category} | " + " | ".join(f"{result[l]['ms_per_step'].get(category, 0.0):.1f}"
                                                      for l in labels) + " |")
    lines.append("| **all traced threads** | " + " | ".join(f"**{result[l]['total_ms_per_step']:.1f}**"
                                                           for l in labels) + " |")
    lines.append("| steps traced | " + " | ".join(str(result[l]["steps"]) for l in labels) + " |")
    for label in labels:
        lines.append("")
        lines.append(f"{label}, top events by self time (ms per step): " + ", ".join(
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
