"""The training scripts as users run them: under kparallax-run and as one plain process, on the offline corpus,
synthetic data and small ImageNet-layout TFRecords; TensorBoard scalars; 2 workers converge like 1 process."""

import glob
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

from kparallax import testing

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
LM1B = os.path.join(ROOT, "scripts", "train_lm1b.py")
RESNET = os.path.join(ROOT, "scripts", "train_resnet50.py")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    out = tmp_path_factory.mktemp("corpus")
    done = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "make_lm1b_corpus.py"), "--output_dir",
                           str(out)], capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    return str(out)


def _scalars(event_dir):
    found = {}
    for path in glob.glob(os.path.join(event_dir, "events.out.tfevents.*")):
        for event in tf.compat.v1.train.summary_iterator(path):
            for value in event.summary.value:
                found.setdefault(value.tag, []).append(float(tf.make_ndarray(value.tensor)))
    return found


@pytest.mark.multiprocess
def test_lm1b_script_two_workers_on_the_offline_corpus(corpus, tmp_path):
    model_dir = tmp_path / "model"
    run = testing.run_local([sys.executable, LM1B, "--config=lm1b_tiny", f"--data_dir={corpus}",
                             f"--model_dir={model_dir}", "--train_steps=40", "--log_every=10", "--warmup_steps=5"],
                            log_dir=str(tmp_path / "logs"), workers=2, ps=1, timeout=300)
    assert run.returncode == 0, run.report()
    out = run.logs()["worker-0.log"]
    assert "step 40: loss" in out and "words_per_sec" in out
    result = json.loads((model_dir / "result.json").read_text())
    assert math.isfinite(result["heldout_perplexity"]) and result["heldout_perplexity"] < 2000
    config = json.loads((model_dir / "config.json").read_text())
    assert config["workers"] == 2 and config["architecture"] == "hybrid" and config["model"]["vocab_size"] <= 2000
    scalars = _scalars(str(model_dir / "tensorboard"))
    for tag in ("loss", "perplexity", "learning_rate", "words_per_sec", "bytes_per_step/dense",
                "bytes_per_step/sparse"):
        assert len(scalars.get(tag, [])) == 4, (tag, sorted(scalars))
    assert all(b > 0 for b in scalars["bytes_per_step/dense"] + scalars["bytes_per_step/sparse"])
    assert scalars["learning_rate"][-1] == pytest.approx(0.2)
    assert "placement: lm1b/softmax_w/embeddings [" in out and "-> ps[0]" in out

    # The same command again: the checkpoint is at the last step, so nothing is trained, and the result keeps the
    # finished run's training figures (they were NaN before) with the held-out ones of the same weights.
    again = testing.run_local([sys.executable, LM1B, "--config=lm1b_tiny", f"--data_dir={corpus}",
                               f"--model_dir={model_dir}", "--train_steps=40", "--log_every=10", "--warmup_steps=5"],
                              log_dir=str(tmp_path / "logs_again"), workers=2, ps=1, timeout=300)
    assert again.returncode == 0, again.report()
    out = again.logs()["worker-0.log"]
    assert "nothing to train: the checkpoint in" in out and "at step 40 of 40" in out, out[-2000:]
    assert "step 41" not in out
    repeated = json.loads((model_dir / "result.json").read_text())
    assert math.isfinite(repeated["final_loss"]) and repeated["final_loss"] == result["final_loss"]
    assert repeated["heldout_perplexity"] == pytest.approx(result["heldout_perplexity"], rel=1e-4)


@pytest.mark.multiprocess
def test_lm1b_script_as_one_plain_process_with_synthetic_data(tmp_path):
    done = subprocess.run([sys.executable, LM1B, "--config=lm1b_tiny", "--data=synthetic", "--train_steps=15",
                           "--log_every=5", f"--model_dir={tmp_path}", "--synthetic_windows=512"],
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "step 15: loss" in done.stdout
    assert json.loads((tmp_path / "config.json").read_text())["architecture"] == "allreduce"


@pytest.mark.multiprocess
def test_lm1b_two_workers_converge_like_one_process(corpus, tmp_path):
    """Same global batch (2 x 16 vs 1 x 32), same steps: held-out loss within 3%."""
    steps = ["--config=lm1b_tiny", f"--data_dir={corpus}", "--train_steps=150", "--log_every=50"]
    one = subprocess.run([sys.executable, LM1B, *steps, "--batch_size=32", f"--model_dir={tmp_path / 'one'}"],
                         capture_output=True, text=True, timeout=600, check=False)
    assert one.returncode == 0, one.stderr[-3000:]
    two = testing.run_local([sys.executable, LM1B, *steps, "--batch_size=16", f"--model_dir={tmp_path / 'two'}"],
                            log_dir=str(tmp_path / "logs"), workers=2, ps=1, timeout=600)
    assert two.returncode == 0, two.report()
    loss_one = json.loads((tmp_path / "one" / "result.json").read_text())["heldout_loss"]
    loss_two = json.loads((tmp_path / "two" / "result.json").read_text())["heldout_loss"]
    assert loss_one < 6.5 and loss_two < 6.5  # both learned (log(2000) = 7.6 at the start)
    assert abs(loss_two - loss_one) / loss_one < 0.03, (loss_one, loss_two)


@pytest.mark.multiprocess
def test_resnet_script_on_imagenet_layout_records(tmp_path):
    data = tmp_path / "imagenet"
    data.mkdir()
    from kparallax_models import imagenet_data  # pylint: disable=import-outside-toplevel
    rng = np.random.default_rng(0)
    for shard in range(2):
        with tf.io.TFRecordWriter(str(data / f"train-{shard:05d}-of-00002")) as writer:
            for i in range(16):
                image = rng.integers(0, 255, (40, 40, 3), dtype=np.uint8)
                imagenet_data.write_example(writer, tf.io.encode_jpeg(image).numpy(), 1 + (i % 10))
    run = testing.run_local([sys.executable, RESNET, "--config=resnet50_tiny", f"--data_dir={data}",
                             f"--model_dir={tmp_path / 'model'}", "--train_steps=4", "--log_every=2"],
                            log_dir=str(tmp_path / "logs"), workers=2, ps=0, timeout=300)
    assert run.returncode == 0, run.report()
    assert "step 4: loss" in run.logs()["worker-0.log"] and "images_per_sec" in run.logs()["worker-0.log"]


def test_bad_flags_and_data_give_one_clear_error(tmp_path):
    missing = subprocess.run([sys.executable, LM1B, f"--data_dir={tmp_path}/nothing", f"--model_dir={tmp_path}/m"],
                             capture_output=True, text=True, timeout=120, check=False)
    assert missing.returncode != 0 and "Vocabulary file" in missing.stderr and "does not exist" in missing.stderr
    (tmp_path / "ro").mkdir()
    (tmp_path / "ro" / "file").write_text("x")
    unwritable = subprocess.run([sys.executable, LM1B, "--data=synthetic", f"--model_dir={tmp_path}/ro/file/sub"],
                                capture_output=True, text=True, timeout=120, check=False)
    assert unwritable.returncode != 0 and "--model_dir is not writable" in unwritable.stderr
    preset = subprocess.run([sys.executable, LM1B, "--config=lm2b", "--data=synthetic", f"--model_dir={tmp_path}/p"],
                            capture_output=True, text=True, timeout=120, check=False)
    assert preset.returncode != 0 and "Unknown lm1b preset 'lm2b'" in preset.stderr
    bad = subprocess.run([sys.executable, LM1B, "--partitions=zero"], capture_output=True, text=True, timeout=120,
                         check=False)
    assert bad.returncode != 0 and "--partitions must be an integer >= 1 or 'auto'" in bad.stderr
    few = subprocess.run([sys.executable, LM1B, "--config=lm1b_tiny", "--data=synthetic", "--synthetic_windows=3",
                          f"--model_dir={tmp_path}/f"], capture_output=True, text=True, timeout=120, check=False)
    assert few.returncode == 2 and "fewer windows than one batch of 16 (worker 0 has 3)" in few.stderr, few.stderr
    for done in (unwritable, preset, bad, few):  # one line, not the script's whole help before it
        assert "flags:" not in done.stdout + done.stderr and "Trains the LM1B" not in done.stdout + done.stderr


@pytest.mark.parametrize("script, flag, message", [
    ("lm1b", "--batch_size=0", "flag --batch_size=0: 0 is not a positive integer"),
    ("lm1b", "--learning_rate=-1", "flag --learning_rate=-1.0: --learning_rate must be a finite number > 0"),
    ("lm1b", "--checkpoint_every=-1", "flag --checkpoint_every=-1: -1 is not a positive integer"),
    ("lm1b", "--train_steps=-1", "flag --train_steps=-1: -1 is not a non-negative integer"),
    ("lm1b", "--epochs=0", "flag --epochs=0: 0 is not a positive integer"),
    ("lm1b", "--warmup_steps=-5", "flag --warmup_steps=-5: -5 is not a non-negative integer"),
    ("resnet", "--batch_size=0", "flag --batch_size=0: 0 is not a positive integer"),
    ("resnet", "--learning_rate=nan", "flag --learning_rate=nan: --learning_rate must be a finite number > 0"),
    ("resnet", "--log_every=0", "flag --log_every=0: 0 is not a positive integer")])
def test_out_of_range_flags_stop_before_training(script, flag, message, tmp_path):
    """Before, a negative learning rate trained to a loss of 7e7, --checkpoint_every=-1 checkpointed every step and
    --train_steps=-1 ended at once with exit 0."""
    script = {"lm1b": LM1B, "resnet": RESNET}[script]
    done = subprocess.run([sys.executable, script, flag, "--data=synthetic", f"--model_dir={tmp_path}/m"],
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 1 and message in done.stderr, done.stderr[-2000:]
    assert not os.path.exists(tmp_path / "m")


def test_unreadable_data_files_are_named(tmp_path):
    data = tmp_path / "data"
    (data / "training-monolingual.tokenized.shuffled").mkdir(parents=True)
    (data / "1b_word_vocab.txt").write_text("<S> 2\n</S> 2\n<UNK> 0\nthe 2\ncat 1\n")
    first = data / "training-monolingual.tokenized.shuffled" / "news.en-00001-of-00001"
    first.write_bytes(b"the cat\n" * 50 + b"\xff\xfe\n")
    text = subprocess.run([sys.executable, LM1B, "--config=lm1b_tiny", f"--data_dir={data}", f"--model_dir={tmp_path}/m"],
                          capture_output=True, text=True, timeout=120, check=False)
    assert text.returncode == 2 and f"{first.name}:" in text.stderr and "is not UTF-8 text (byte 0xff" in text.stderr, \
        text.stderr[-2000:]
    (tmp_path / "img").mkdir()
    (tmp_path / "img" / "train-00000-of-00001").write_bytes(b"\x00" * 100)
    records = subprocess.run([sys.executable, RESNET, "--config=resnet50_tiny", f"--data_dir={tmp_path}/img",
                              f"--model_dir={tmp_path}/r"], capture_output=True, text=True, timeout=120, check=False)
    assert records.returncode == 2 and "train-00000-of-00001 is not a readable TFRecord file" in records.stderr, \
        records.stderr[-2000:]
    assert "Traceback" not in text.stderr + records.stderr


def test_the_demo_runs_as_one_plain_process_as_its_docstring_says():
    """Its docstring's plain-process command (before: an unknown --no_ps flag) and a bad flag's one line."""
    demo = os.path.join(ROOT, "examples", "demo.py")
    done = subprocess.run([sys.executable, demo, "--architecture", "allreduce", "--epochs", "1", "--examples", "2000"],
                          capture_output=True, text=True, timeout=180, check=False)
    assert done.returncode == 0 and "workers=1 ps=0 final loss=" in done.stdout, done.stderr[-2000:]
    bad = subprocess.run([sys.executable, demo, "--epochs", "0"], capture_output=True, text=True, timeout=60,
                         check=False)
    assert bad.returncode == 2 and "argument --epochs: must be an integer >= 1. Received: '0'" in bad.stderr


@pytest.mark.multiprocess
def test_nan_loss_stops_and_keeps_the_last_good_checkpoint(tmp_path):
    run = testing.run_local([sys.executable, LM1B, "--config=lm1b_tiny", "--data=synthetic", "--synthetic_windows=512",
                             f"--model_dir={tmp_path / 'm'}", "--train_steps=40", "--checkpoint_every=1",
                             "--learning_rate=1e25", "--eval=false"],
                            log_dir=str(tmp_path / "logs"), workers=2, ps=1, timeout=300)
    assert run.returncode == 2, run.report()
    # Both workers stop on the same step; whichever exits first ends the run, and the launcher shows its log tail
    # (the other may be stopped before it prints), so read the message there.
    log = run.output
    assert "the loss became NaN/Inf at step" in log and "Traceback" not in log, run.report()
    bad_step = int(log.split("the loss became NaN/Inf at step ")[1].split(";")[0])
    saved = sorted(int(p.name[5:]) for p in (tmp_path / "m").glob("ckpt-*"))
    assert all(step < bad_step for step in saved), (saved, bad_step)
