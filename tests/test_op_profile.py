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
