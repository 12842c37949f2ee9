"""Every architecture and sparse-path option, run for real (kparallax-run, PS servers, Horovod), checked against
an independent single plain-Keras process on the concatenated batch (2 workers x B == 1 process x 2B)."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from kparallax import testing

PROGRAMS = os.path.join(os.path.dirname(__file__), "programs")
from programs import equivalence_common as common

RTOL, ATOL = 1e-5, 1e-6
NAMES = ("adam", "momentum")

# id: (PS tasks, HybridStrategy options, extra kparallax-run flags, micro-batches per update)
CONFIGS = {
    "hybrid-local-aggregation": (1, {"local_aggregation": True}, [], 1),
    "allreduce-via-launcher-flag": (0, {}, ["--architecture", "allreduce"], 1),
    "allreduce-sparse-as-dense": (0, {"architecture": "allreduce", "sparse_as_dense": True}, [], 1),
    "ps": (1, {"architecture": "ps"}, [], 1),
    "ps-local-aggregation": (1, {"architecture": "ps", "local_aggregation": True}, [], 1),
    "partitions-2-over-2-ps-local-aggregation": (2, {"partitions": 2, "local_aggregation": True}, [], 1),
    "rule-ps:3-uneven-over-2-ps": (2, {"placement": {".*_embedding/embeddings": "ps:3"}}, [], 1),
    "partitions-auto": (2, {"partitions": "auto", "max_partitions": 8, "auto_steps": 2}, [], 1),
    "accumulate-2-local-aggregation": (1, {"backward_passes_per_step": 2, "local_aggregation": True}, [], 2),
    "ps-accumulate-2-partitions-2": (2, {"architecture": "ps", "backward_passes_per_step": 2, "partitions": 2}, [], 2),
}


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    out = {}
    for k in (1, 2):
        ref_dir = tmp_path_factory.mktemp(f"reference_k{k}")
        done = subprocess.run([sys.executable, os.path.join(PROGRAMS, "train_reference.py"), str(ref_dir),
                               ",".join(NAMES), str(k)], capture_output=True, text=True, timeout=300, check=False)
        assert done.returncode == 0, done.stderr[-3000:]
        out[k] = ref_dir
    return out


def _train(tmp_path, ps, options, launcher_args=(), names=NAMES):
    out = tmp_path / "out"
    out.mkdir()
    run = testing.run_local([sys.executable, os.path.join(PROGRAMS, "train_kparallax.py"), str(out), ",".join(names),
                             json.dumps(options)], log_dir=str(tmp_path / "logs"), workers=2, ps=ps, timeout=300,
                            launcher_args=launcher_args)
    assert run.returncode == 0, run.report()
    return out, run


def _load(out, name):
    got = np.load(out / f"{name}.npz")
    with open(out / f"{name}.json", encoding="utf-8") as f:
        return got, json.load(f)


def _assert_matches(got, ref, rtol=RTOL, atol=ATOL, what=""):
    weights = [k for k in ref.files if k.startswith("arr_")]
    assert [k for k in got.files if k.startswith("arr_")] == weights, "get_weights() must present whole tables"
    initial = common.initial_weights(common.build_model("probe"))
    for i, key in enumerate(weights):
        assert not np.allclose(ref[key], initial[i]), f"{what}: weight {i} did not train; the test would be vacuous"
        np.testing.assert_allclose(got[key], ref[key], rtol=rtol, atol=atol, err_msg=f"{what}: weight {i}")
    np.testing.assert_allclose(got["loss"], ref["loss"], rtol=max(rtol, 1e-5), err_msg=f"{what}: loss")


@pytest.mark.multiprocess
@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_matches_single_process(config, references, tmp_path):
    ps, options, launcher_args, k = CONFIGS[config]
    out, run = _train(tmp_path, ps, options, launcher_args)
    for name in NAMES:
        got, info = _load(out, name)
        _assert_matches(got, np.load(references[k] / f"{name}.npz"), what=f"{config}/{name}")
        assert info["iterations"] == common.STEPS // k, info  # one optimizer update per k micro-batches
    log = run.logs()["worker-0.log"]
    first = f"{NAMES[0]}_embedding/embeddings"
    if config.startswith("allreduce"):
        assert f"placement: {first} [{common.VOCAB}, {common.EMB}] -> replicated (architecture 'allreduce')" in log
        assert "architecture: allreduce -> allreduce" in log
    elif config.startswith("ps"):
        assert f"placement: {NAMES[0]}_hidden/kernel [48, 16] -> ps[0]" in log
        assert "architecture: ps -> ps" in log
    if config == "rule-ps:3-uneven-over-2-ps":
        assert f"placement: {first} [1000, 8] -> 3 shard(s) of rows [334, 333, 333] on ps[0, 1, 1]" in log
    if config == "partitions-2-over-2-ps-local-aggregation":
        assert f"placement: {first} [1000, 8] -> 2 shard(s) of rows [500, 500] on ps[0, 1]" in log
        mine = sorted(k for k in info["push_counts"] if k.startswith(NAMES[-1]))
        assert mine == [f"{NAMES[-1]}_embedding/embeddings/part_{i}_of_2" for i in range(2)], info["push_counts"]


# optimizer option: the same optimizer without it (the option must change the result, or the test is vacuous)
OPTIONED = {"clipnorm": "adam", "legacy_clip_both": "legacy_momentum", "adam_ema": "adam",
            "global_clipnorm": "momentum", "legacy_clip_global": "legacy_momentum"}


@pytest.fixture(scope="module")
def optioned_references(tmp_path_factory):
    ref_dir = tmp_path_factory.mktemp("reference_optioned")
    names = list(OPTIONED) + sorted(set(OPTIONED.values()))
    done = subprocess.run([sys.executable, os.path.join(PROGRAMS, "train_reference.py"), str(ref_dir),
                           ",".join(names), "1"], capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    for optioned, plain in OPTIONED.items():
        a, b = np.load(ref_dir / f"{optioned}.npz"), np.load(ref_dir / f"{plain}.npz")
        assert not np.allclose(a["arr_0"], b["arr_0"], rtol=1e-3, atol=1e-4), optioned
    return ref_dir


@pytest.mark.multiprocess
@pytest.mark.parametrize("config", ["hybrid-ps:3-over-2-ps-local-aggregation", "ps", "allreduce"])
def test_clipping_and_ema_match_single_process(config, optioned_references, tmp_path):
    """clipnorm / clipvalue act as in one process on the global batch's gradient, whose sparse form holds one slice
    per looked-up id: on a table split over 2 PS tasks (the norm spans its shards; one worker pushes for both) and
    on dense PS variables; global_clipnorm's one norm spans the replicated and PS paths. use_ema's averages of PS
    variables (kept by the chief's clones) replace the weights as in one process."""
    ps, options = {"hybrid-ps:3-over-2-ps-local-aggregation": (2, {"placement": {".*_embedding/embeddings": "ps:3"},
                                                                   "local_aggregation": True}),
                   "ps": (1, {"architecture": "ps"}), "allreduce": (0, {"architecture": "allreduce"})}[config]
    out, _ = _train(tmp_path, ps, options, names=tuple(OPTIONED))
    for name in OPTIONED:
        got, _ = _load(out, name)
        _assert_matches(got, np.load(optioned_references / f"{name}.npz"), what=f"{config}/{name}")


@pytest.mark.multiprocess
def test_auto_search_logs_samples_and_choice(tmp_path):
    _, run = _train(tmp_path, 2, CONFIGS["partitions-auto"][1], names=("adam",))
    log = run.logs()["worker-0.log"]
    for p in (2, 4, 8):
        assert f"partition search: P={p} -> " in log
    chosen = [line for line in log.splitlines() if "chosen P=" in line]
    assert len(chosen) == 1 and "fit t(P) = " in chosen[0], chosen
    p = int(chosen[0].rsplit("chosen P=", 1)[1])
    assert 2 <= p <= 8


@pytest.mark.multiprocess
def test_local_aggregation_pushes_once_per_host(tmp_path):
    """Two workers on one host: one push per step with local aggregation, two without; same weights. The default
    ("auto") does not aggregate here: the PS is on the same host, so pushes cross no network."""
    on_dir, off_dir, auto_dir = tmp_path / "on", tmp_path / "off", tmp_path / "auto"
    for d in (on_dir, off_dir, auto_dir):
        d.mkdir()
    on, _ = _train(on_dir, 1, {"local_aggregation": True}, names=("adam",))
    off, _ = _train(off_dir, 1, {"local_aggregation": False}, names=("adam",))
    auto, _ = _train(auto_dir, 1, {}, names=("adam",))
    (got_on, info_on), (got_off, info_off) = _load(on, "adam"), _load(off, "adam")
    assert info_on["push_counts"] == {"adam_embedding/embeddings": common.STEPS}
    assert info_off["push_counts"] == {"adam_embedding/embeddings": common.STEPS * common.WORKERS}
    assert _load(auto, "adam")[1]["push_counts"] == info_off["push_counts"]
    for key in got_on.files:
        np.testing.assert_allclose(got_on[key], got_off[key], rtol=RTOL, atol=ATOL, err_msg=key)


@pytest.mark.multiprocess
def test_fp16_compression_within_its_tolerance(references, tmp_path):
    """fp16 carries ~3 significant digits: after 12 steps every weight stays within 2e-3 of its scale, and the
    result differs from the fp32 run (so the compression really happened)."""
    out, _ = _train(tmp_path, 1, {"compression": "fp16"}, names=("adam",))
    got, ref = np.load(out / "adam.npz"), np.load(references[1] / "adam.npz")
    differs = False
    for key in [k for k in ref.files if k.startswith("arr_")]:
        scale = float(np.abs(ref[key]).max())
        np.testing.assert_allclose(got[key], ref[key], rtol=0, atol=2e-3 * scale, err_msg=key)
        differs |= not np.allclose(got[key], ref[key], rtol=RTOL, atol=ATOL)
    assert differs, "fp16 compression left every weight equal to the fp32 result: was it applied?"


@pytest.mark.multiprocess
@pytest.mark.parametrize("architecture", ["hybrid", "ps"])
def test_async_trains_with_a_slow_worker(architecture, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    run = testing.run_local([sys.executable, os.path.join(PROGRAMS, "train_async.py"), str(out), architecture],
                            log_dir=str(tmp_path / "logs"), workers=2, ps=1, timeout=300)
    assert run.returncode == 0, run.report()
    with open(out / "async.json", encoding="utf-8") as f:
        info = json.load(f)
    assert info["loss"][-1] < 0.7 * info["loss"][0], info["loss"]
    pushes = info["push_counts"]["async_embedding/embeddings"]
    steps = info["steps_per_worker"]
    # Every worker applies its own update on arrival (no aggregation): the chief sees at least its own pushes and
    # at most everyone's.
    assert steps <= pushes <= 2 * steps, pushes
    assert "sync=False" in run.logs()["worker-0.log"]


@pytest.mark.multiprocess
@pytest.mark.parametrize("config", ["hybrid-local-aggregation", "partitions-2-over-2-ps-local-aggregation"])
def test_tables_sharing_ids_with_local_aggregation(config, tmp_path, monkeypatch):
    """Two tables looked up with the same ids (a token embedding and a per-token bias, as lm1b's softmax weights and
    biases) under local aggregation: the worker that does not push sends the same empty ids for both tables, and
    each table's allgather must still run (when Grappler merged the two there, the run hung at its first step)."""
    monkeypatch.setenv("KP_EQUIVALENCE_TOKEN_BIAS", "1")
    ref_dir = tmp_path / "reference"
    ref_dir.mkdir()
    done = subprocess.run([sys.executable, os.path.join(PROGRAMS, "train_reference.py"), str(ref_dir), "adam", "1"],
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    ps, options, _, _ = CONFIGS[config]
    out, run = _train(tmp_path, ps, options, names=("adam",))
    got, info = _load(out, "adam")
    assert sorted(k.split("/")[0] for k in info["push_counts"]) == sorted(
        ["adam_embedding", "adam_token_bias"] * ps), info["push_counts"]
    _assert_matches(got, np.load(ref_dir / "adam.npz"), what=f"token bias/{config}")
    assert "placement: adam_token_bias/embeddings [1000, 1] -> " in run.logs()["worker-0.log"]
