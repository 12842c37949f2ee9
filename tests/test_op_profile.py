"""kparallax_bench.op_profile on a real TensorFlow profiler trace of a small Keras fit (single process)."""

import numpy as np
import pytest
import tensorflow as tf

from kparallax_bench import op_profile


def test_a_traced_fit_is_summarized_per_step(tmp_path):
    model = tf.keras.Sequential([tf.keras.Input((64,)), tf.keras.layers.Dense(256), tf.keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    x, y = np.ones((64, 64), np.float32), np.ones((64, 1), np.float32)
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)  # traced once, outside the profile
    tf.profiler.experimental.start(str(tmp_path / "dense@1"))
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)  # 4 steps
    tf.profiler.experimental.stop()
    result = op_profile.summarize(str(tmp_path))["dense@1"]
    assert result["steps"] == 4
    assert result["ops_ms"]["model compute: matmul"] > 0 and result["step_function_ms"] > 0
    # The kernel's name depends on the CPU: "MatMul", or oneDNN's "_MklMatMul" / "_MklNativeFusedMatMul" on AVX-512
    # machines (seen 2026-11-23); the matmul category matches them all the same way.
    assert any("MatMul" in name for name, _ in result["top_ops"]), result["top_ops"]
    assert "| model compute: matmul |" in op_profile.markdown({"dense@1": result})


def test_a_directory_without_traces_is_named(tmp_path):
    (tmp_path / "run@2").mkdir()
    with pytest.raises(FileNotFoundError, match="run the benchmark with --profile DIR first"):
        op_profile.summarize(str(tmp_path))


def _worker(start, backprop_done, end):
    """One step of one worker as traced events: (start ms, duration ms, name, on the Python thread)."""
    return [(start, end - start, "train_function", True),
            (start + 1, backprop_done - start - 1, "gradient_tape/dense/MatMul:MatMul", False),
            (start + 2, 3, "dense/MatMul:MatMul", False)]


def test_step_phases_align_the_workers_steps_and_measure_the_tail():
    # Two steps of two workers on one clock: worker 1 starts 10 ms later and computes longer; both return together.
    by_worker = {0: _worker(0, 40, 100) + _worker(200, 230, 290)
                 + [(80, 2, "kp_step_done/AddN:AddN", False), (280, 2, "kp_step_done/AddN:AddN", False),
                    (4, 1, "IteratorGetNext:IteratorGetNext", False),
                    (206, 1, "IteratorGetNext:IteratorGetNext", False)],
                 1: _worker(10, 70, 101) + _worker(205, 250, 291)}
    result = op_profile.step_phases(by_worker)
    assert result["steps"] == 2
    assert result["workers"][0] == {"start": 0, "backprop_done": 35, "end": 95,   # medians of (40, 30), (100, 90)
                                    "batch read": 5,   # (4, 6)
                                    "PS answered (end barrier)": 80}   # worker 0's end barrier (80, 80)
    assert result["workers"][1] == {"start": 7.5, "backprop_done": 60, "end": 96, "batch read": None,
                                    "PS answered (end barrier)": None}
    assert result["last_backprop_done"] == 60   # the slowest worker: (70, 50)
    assert result["step"] == 96 and result["tail"] == 36   # steps (101, 91), tails (101 - 70, 91 - 50)
    table = op_profile.phases_markdown({"run@2": result})
    assert "| worker | step function started | batch read | backprop done | PS answered (end barrier) |" in table
    assert "| 1 | 8 | - | 60 | - | 96 |" in table and "| 0 | 0 | 5 | 35 | 80 | 95 |" in table
    assert "takes 36 ms (38%)" in table


def test_marks_from_the_command_line_add_to_the_default_ones_and_bad_ones_are_named():
    marks = op_profile.parse_marks(["forward started=^dense/MatMul:"])
    assert list(marks) == ["batch read", "PS answered (end barrier)", "forward started"]
    result = op_profile.step_phases({0: _worker(0, 40, 100)}, marks)
    assert result["workers"][0]["forward started"] == 2   # the first match, not the gradient's MatMul at 1
    with pytest.raises(ValueError, match="--mark takes NAME=REGEX.*Received: 'dense/MatMul'"):
        op_profile.parse_marks(["dense/MatMul"])
    with pytest.raises(ValueError, match=r"--mark x: not a regular expression.*Received: '\('"):
        op_profile.parse_marks(["x=("])
    assert op_profile.main(["/nonexistent", "--phases", "--mark", "x=("]) == 2


def test_step_phases_without_steps_in_a_trace_are_refused():
    with pytest.raises(ValueError, match="no train steps found in every worker's trace"):
        op_profile.step_phases({0: _worker(0, 40, 100), 1: []})


def test_every_worker_of_a_traced_run_is_read(tmp_path):
    model = tf.keras.Sequential([tf.keras.Input((8,)), tf.keras.layers.Dense(4), tf.keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    x, y = np.ones((32, 8), np.float32), np.ones((32, 1), np.float32)
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    for rank in range(2):  # two "workers" traced one after the other: steps are aligned by their index
        tf.profiler.experimental.start(str(tmp_path / "dense@2" / f"worker-{rank}"))
        model.fit(x, y, batch_size=16, epochs=1, verbose=0)  # 2 steps
        tf.profiler.experimental.stop()
    result = op_profile.phases(str(tmp_path))["dense@2"]
    assert result["steps"] == 2 and sorted(result["workers"]) == [0, 1]
    for row in result["workers"].values():
        assert row["start"] <= row["backprop_done"] <= row["end"], row
    assert op_profile.summarize(str(tmp_path))["dense@2"]["steps"] == 2   # the op table reads worker 0 only
