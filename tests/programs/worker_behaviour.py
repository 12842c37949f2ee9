"""Worker program for launcher tests.

Usage: worker_behaviour.py MODE (fail_rank1 | same_index | ok | compile_outside | custom_loop | skew_steps |
                               skew_steps_async | virtual_batch | batch_norm_global | batch_norm_per_worker |
                               dropout_masks | several_models | shuffle_seeds | bad_id_rank1 | made_before |
                               built_by_first_call | unaggregated_state | manual_update | async_two_optimizers |
                               chief_only_model | chief_only_model_placed | ps_write_unseen)
"""

import os
import sys

mode = sys.argv[1]
if mode == "fail_rank1" and os.environ.get("KPARALLAX_TASK_INDEX") == "1":
    print("worker 1 failing on purpose", flush=True)
    sys.exit(3)
if mode == "same_index":
    os.environ["KPARALLAX_TASK_INDEX"] = "0"  # both workers claim index 0

if mode == "made_before":  # an optimizer and an adapted lookup layer made before the strategy
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    early = [tf.keras.optimizers.Adam(0.01), tf.keras.layers.StringLookup(vocabulary=["a", "b"])]

import kparallax as kp

try:
    strategy = kp.HybridStrategy(kp.Cluster.from_env(), sync=mode not in ("skew_steps_async", "async_two_optimizers"),
                                 partitions=3 if mode in ("bad_id_rank1", "chief_only_model_placed") else 1)
except (ValueError, ConnectionError) as e:
    print(f"kparallax error: {e}", file=sys.stderr, flush=True)
    sys.exit(2)
print(f"worker {strategy.worker_index} of {strategy.num_workers} ok", flush=True)
if mode == "compile_outside":
    import numpy as np  # pylint: disable=import-outside-toplevel
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    model = tf.keras.Sequential([tf.keras.Input((3,)), tf.keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")  # outside strategy.scope()
    for train in (lambda: model.fit(np.zeros((8, 3)), np.zeros((8, 1)), verbose=0),
                  lambda: model.train_on_batch(np.zeros((8, 3)), np.zeros((8, 1)))):
        try:
            train()
        except ValueError as e:
            print(f"refused: {e}", flush=True)
        else:
            sys.exit("training a model compiled outside the scope went on silently")
if mode == "custom_loop":
    import numpy as np  # pylint: disable=import-outside-toplevel
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    with strategy.scope():
        model = tf.keras.Sequential([tf.keras.Input((3,)), tf.keras.layers.Embedding(10, 2),
                                     tf.keras.layers.Flatten(), tf.keras.layers.Dense(1)])
        model.compile(optimizer=tf.keras.optimizers.Adam(0.1), loss="mse")
    before = model.get_weights()

    def step(optimizer):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(np.zeros((4, 3), np.int32))))
        optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))

    # An optimizer of the loop's own, and the compiled model's (kparallax's: its gradients would be averaged, but
    # nothing else of the training step happens in a loop), eagerly and in a tf.function.
    for what, optimizer in (("own", tf.keras.optimizers.SGD(0.1)), ("compiled", model.optimizer)):
        for how, run in (("eager", step), ("tf.function", tf.function(step))):
            try:
                run(optimizer)
            except ValueError as e:  # in a tf.function, after TensorFlow's "in user code:" lines
                text = str(e)
                print(f"refused ({what}, {how}): {text[max(0, text.find(type(optimizer).__name__ + '.')):]}",
                      flush=True)
            else:
                sys.exit(f"a custom training loop's optimizer ({what}, {how}) trained silently")
    if any(not np.array_equal(a, b) for a, b in zip(before, model.get_weights())):
        sys.exit("a refused custom training loop changed the weights")
if mode == "async_two_optimizers":
    # A custom train_step applying a second optimizer to its Dense layer (a GAN's pattern) under sync=False: each
    # worker would update its own copy of that layer alone. Refused at the first step, before any weight changes.
    import numpy as np  # pylint: disable=import-outside-toplevel
    import tensorflow as tf  # pylint: disable=import-outside-toplevel

    class TwoOptimizers(tf.keras.Model):
        def __init__(self):
            super().__init__()
            self.table, self.out = tf.keras.layers.Embedding(10, 2), tf.keras.layers.Dense(1)
            self.second = tf.keras.optimizers.SGD(0.1)

        def call(self, ids):
            return self.out(tf.reduce_mean(self.table(ids), axis=1))

        def train_step(self, data):
            ids, y = data
            with tf.GradientTape(persistent=True) as tape:
                loss = tf.reduce_mean(tf.square(self(ids) - y))
            self.second.apply_gradients(zip(tape.gradient(loss, self.out.trainable_variables),
                                            self.out.trainable_variables))
            self.optimizer.apply_gradients(zip(tape.gradient(loss, self.table.trainable_variables),
                                               self.table.trainable_variables))
            return {"loss": loss}

    with strategy.scope():
        model = TwoOptimizers()
        model(np.zeros((1, 3), np.int32))
        model.compile(optimizer=tf.keras.optimizers.Adam(0.1))
    # Alike on every worker: fit's broadcast changes nothing. Only worker 0 writes the PS table, so another worker
    # reading the weights right away may see the chief's initial values: compare with the values set, not a snapshot.
    model.set_weights([np.full_like(w, 0.5) for w in model.get_weights()])
    try:
        model.fit(np.ones((16, 3), np.int32), np.ones((16, 1)), batch_size=4, verbose=0)
    except ValueError as e:  # after TensorFlow's "in user code:" lines
        text = str(e)
        print(f"refused: {text[text.find('A second optimizer'):]}", flush=True)
    else:
        sys.exit("a second optimizer in an asynchronous step trained silently")
    if any(not np.all(w == 0.5) for w in model.get_weights()):
        sys.exit("a refused second optimizer changed the weights")
if mode == "shuffle_seeds":
    # Each worker seeds its dataset's shuffle with its own rank (as a script seeding per worker does): refused, as
    # their batches of their own orders would overlap. With one seed on every worker, fit trains.
    import numpy as np  # pylint: disable=import-outside-toplevel
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    with strategy.scope():
        model = tf.keras.Sequential([tf.keras.Input((1,)), tf.keras.layers.Dense(1)])
        model.compile(optimizer="sgd", loss="mse")
    rows = tf.data.Dataset.from_tensor_slices((np.arange(64, dtype=np.float32)[:, None], np.zeros((64, 1))))
    try:
        model.fit(rows.shuffle(64, seed=100 + strategy.worker_index).batch(4), verbose=0)
    except ValueError as e:
        print(f"refused: {e}", flush=True)
    else:
        sys.exit("workers split datasets shuffled with different seeds silently")
    model.fit(rows.shuffle(64, seed=100).batch(4), verbose=0)
    print("one seed: trained", flush=True)
if mode in ("skew_steps", "skew_steps_async"):
    # worker 1's optimizer makes one extra step, as a loss-scale skip on worker 0 would
    import numpy as np  # pylint: disable=import-outside-toplevel
    import tensorflow as tf  # pylint: disable=import-outside-toplevel

    class Skew(tf.keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 2 and strategy.worker_index == 1:
                self.model.optimizer.iterations.assign_add(1)

    with strategy.scope():
        model = tf.keras.Sequential([tf.keras.Input((3,)), tf.keras.layers.Dense(1)])
        model.compile(optimizer="sgd", loss="mse")
    model.fit(np.zeros((64, 3)), np.zeros((64, 1)), batch_size=4, verbose=0, callbacks=[Skew()])
if mode == "virtual_batch":
    import numpy as np  # pylint: disable=import-outside-toplevel
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    with strategy.scope():
        model = tf.keras.Sequential([tf.keras.Input((3,)), tf.keras.layers.Dense(2),
                                     tf.keras.layers.BatchNormalization(virtual_batch_size=2, synchronized=True,
                                                                        name="vbn")])
        try:
            model.compile(optimizer="sgd", loss="mse")
            model.fit(np.zeros((16, 3)), np.zeros((16, 2)), batch_size=4, verbose=0)
        except ValueError as e:
            print(f"refused: {e}", flush=True)
        else:
            sys.exit("virtual_batch_size trained on per-worker sub-batches silently")
if mode == "autotuned_steps":
    # Keras' tuner would change steps_per_execution on each worker from its own timing (a 2-worker fit hung).
    import numpy as np  # pylint: disable=import-outside-toplevel
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    with strategy.scope():
        model = tf.keras.Sequential([tf.keras.Input((3,)), tf.keras.layers.Dense(1)])
        try:
            model.compile(optimizer="sgd", loss="mse", steps_per_execution="auto")
        except ValueError as e:
            print(f"refused at compile: {e}", flush=True)
        else:
            sys.exit("steps_per_execution='auto' compiled on several workers")
        model.compile(optimizer="sgd", loss="mse", steps_per_execution=2)
        model.fit(np.zeros((16, 3)), np.zeros((16, 1)), batch_size=4, verbose=0)
        print("a number: trained", flush=True)
        model.autotune_steps_per_execution = True
        try:
            model.fit(np.zeros((16, 3)), np.zeros((16, 1)), batch_size=4, verbose=0)
        except ValueError as e:
            print(f"refused at fit: {e}", flush=True)
        else:
            sys.exit("autotune_steps_per_execution trained on several workers")
if mode == "unaggregated_state":
    # A layer's running mean of its input, assigned in the step with Keras' default aggregation (NONE): worker 0's
    # rows have mean 3, worker 1's mean 4, so each worker's copy would move its own way.
    import numpy as np  # pylint: disable=import-outside-toplevel
    import tensorflow as tf  # pylint: disable=import-outside-toplevel

    class Running(tf.keras.layers.Layer):
        def build(self, shape):
            self.moving = self.add_weight("moving", shape[-1:], initializer="zeros", trainable=False)
            self.calls = self.add_weight("calls", [], initializer="zeros", trainable=False)  # the same everywhere

        def call(self, x, training=None):
            if training:
                self.moving.assign(0.5 * self.moving + 0.5 * tf.reduce_mean(x, axis=0))
                self.calls.assign_add(1.0)
            return x - self.moving

    with strategy.scope():
        model = tf.keras.Sequential([tf.keras.Input((1,)), Running(name="running"), tf.keras.layers.Dense(1)])
        model.compile(optimizer="sgd", loss="mse")
        try:
            model.fit(np.arange(8, dtype=np.float32)[:, None], np.zeros((8, 1)), batch_size=2, shuffle=False,
                      verbose=0)
        except ValueError as e:
            print(f"refused: {e}", flush=True)
        else:
            sys.exit("a running statistic assigned from each worker's rows trained silently")
        # train_on_batch loops of new models, one built before, one built by its first call (its variables
        # broadcast when that call's step is traced): both refused after their first call
        for built, how in (([tf.keras.Input((1,))], "built before"), ([], "built by its first call")):
            model = tf.keras.Sequential(built + [Running(name="running"), tf.keras.layers.Dense(1)])
            model.compile(optimizer="sgd", loss="mse")
            rows = np.arange(8, dtype=np.float32)[:, None][strategy.worker_index::2]
            calls = 0
            try:
                for _ in range(3):
                    model.train_on_batch(rows, np.zeros((4, 1)))
                    calls += 1
            except ValueError as e:
                print(f"refused after {calls} train_on_batch call(s) ({how}): {e}", flush=True)
            else:
                sys.exit("a running statistic assigned from each worker's rows trained silently in train_on_batch")
if mode == "manual_update":
    # A custom train_step updating its weights by hand (plain SGD, no optimizer): each worker would apply its own
    # batch's gradient to its own copy (before: 0.037 off one process after 2 epochs, silently).
    import numpy as np  # pylint: disable=import-outside-toplevel
    import tensorflow as tf  # pylint: disable=import-outside-toplevel

    class ByHand(tf.keras.Sequential):
        def train_step(self, data):
            x, y = data
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(tf.square(self(x, training=True) - y))
            for variable, gradient in zip(self.trainable_variables, tape.gradient(loss, self.trainable_variables)):
                variable.assign_sub(0.05 * gradient)
            return {"loss": loss}

    with strategy.scope():
        model = ByHand([tf.keras.Input((2,)), tf.keras.layers.Dense(1, name="out")])
        model.compile(optimizer="sgd")
        try:
            model.fit(np.arange(16, dtype=np.float32).reshape(8, 2), np.zeros((8, 1)), batch_size=2, shuffle=False,
                      verbose=0)
        except ValueError as e:
            print(f"refused: {e}", flush=True)
        else:
            sys.exit("weights updated by hand from each worker's gradient trained silently")
if mode == "ps_write_unseen":
    # A callback shrinking the table after every batch through a function of the user's defined elsewhere: its hook's
    # code names no write, so fit's workers do not meet after it, and worker 1's next step could read the table
    # before worker 0's write lands.
    import numpy as np  # pylint: disable=import-outside-toplevel
    import tensorflow as tf  # pylint: disable=import-outside-toplevel

    def shrink(model):
        table = model.layers[0].embeddings
        table.assign(table * 0.9)

    class Upkeep(tf.keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            shrink(self.model)

    with strategy.scope():
        model = tf.keras.Sequential([tf.keras.Input((2,), dtype=tf.int32), tf.keras.layers.Embedding(10, 2),
                                     tf.keras.layers.Flatten(), tf.keras.layers.Dense(1)])
        model.compile(optimizer="sgd", loss="mse")
        try:
            model.fit(np.ones((8, 2), np.int32), np.zeros((8, 1)), batch_size=2, verbose=0, callbacks=[Upkeep()])
        except ValueError as e:
            print(f"refused: {e}", flush=True)
        else:
            sys.exit("a write of a PS variable the workers did not meet after trained silently")
if mode in ("batch_norm_global", "batch_norm_per_worker"):
    # rows 0..7 as one feature: worker 0 keeps rows 0-3 (mean 1.5), worker 1 rows 4-7 (mean 5.5); with
    # momentum 0 the moving mean after one step is the mean the step normalized with.
    import numpy as np  # pylint: disable=import-outside-toplevel
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    with strategy.scope():
        model = tf.keras.Sequential([tf.keras.Input((1,)), tf.keras.layers.BatchNormalization(
            momentum=0.0, synchronized=mode == "batch_norm_global")])
        model.compile(optimizer="sgd", loss="mse")
    model.fit(np.arange(8, dtype=np.float32)[:, None], np.zeros((8, 1)), batch_size=4, shuffle=False, verbose=0)
    print(f"moving mean {float(model.layers[0].moving_mean.numpy()[0]):.4f}", flush=True)
if mode == "dropout_masks":
    # the same global seed on every worker (as a user's script sets it); each prints the dropout mask its training
    # step drew for its batch of ones, and the flips RandomFlip (a layer with a tf.random.Generator) drew
    import numpy as np  # pylint: disable=import-outside-toplevel
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    tf.keras.utils.set_random_seed(7)

    class Masks(tf.keras.Model):
        def __init__(self):
            super().__init__()
            self.drop = tf.keras.layers.Dropout(0.5)
            self.dense = tf.keras.layers.Dense(1)
            # each worker's own record of what its step drew: ON_READ, one per worker (an unaggregated variable
            # the step assigns differently on the workers is refused after fit's first step)
            own = {"trainable": False, "synchronization": tf.VariableSynchronization.ON_READ}
            self.seen = tf.Variable(tf.zeros((4, 8)), **own)
            self.flip = tf.keras.layers.RandomFlip("horizontal")
            self.flipped = tf.Variable(tf.zeros((4, 8)), **own)

        def call(self, x, training=False):
            return self.dense(self.drop(x, training=training))

        def train_step(self, data):
            x, y = data
            with tf.GradientTape() as tape:
                dropped = self.drop(tf.ones_like(x), training=True)
                loss = tf.reduce_mean(tf.square(self.dense(dropped) - y))
            self.seen.assign(dropped)
            images = tf.reshape(tf.tile(tf.range(8.0), [4]), (4, 1, 8, 1))
            self.flipped.assign(tf.reshape(self.flip(images, training=True), (4, 8)))
            variables = self.dense.trainable_variables
            self.optimizer.apply_gradients(zip(tape.gradient(loss, variables), variables))
            return {"loss": loss}

    with strategy.scope():
        model = Masks()
        model(np.ones((1, 8), np.float32))
        model.compile(optimizer="sgd")
    model.fit(np.ones((8, 8), np.float32), np.ones((8, 1), np.float32), batch_size=4, epochs=1, shuffle=False,
              verbose=0)
    print("dropout mask " + "".join("1" if v else "0" for v in model.seen.numpy().ravel()), flush=True)
    print("flipped rows " + "".join("1" if row[0] else "0" for row in model.flipped.numpy()), flush=True)
if mode == "bad_id_rank1":
    # worker 1's batch holds an id past its table (60 rows in 3 stripes); worker 0's are all in it
    import numpy as np  # pylint: disable=import-outside-toplevel
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    with strategy.scope():
        model = tf.keras.Sequential([tf.keras.Input((3,), dtype=tf.int32), tf.keras.layers.Embedding(60, 4),
                                     tf.keras.layers.Flatten(), tf.keras.layers.Dense(1)])
        model.compile(optimizer="adagrad", loss="mse")
    ids = np.array([[1, 2, 70 if strategy.worker_index == 1 else 3]] * 4)
    model.train_on_batch(ids, np.zeros((4, 1)))
    sys.exit("a batch with an id outside the table trained")
if mode in ("chief_only_model", "chief_only_model_placed"):
    # worker 0 alone builds a model holding a table inside the scope (a copy to check a saved file), then every
    # worker builds the model it trains: a copy of the first (its table named as the first's), or a new model
    import numpy as np  # pylint: disable=import-outside-toplevel
    import tensorflow as tf  # pylint: disable=import-outside-toplevel

    def build():
        return tf.keras.Sequential([tf.keras.Input((4,), dtype=tf.int32), tf.keras.layers.Embedding(60, 3),
                                    tf.keras.layers.Flatten(), tf.keras.layers.Dense(1)])

    with strategy.scope():
        first = build()
        if strategy.is_chief:
            tf.keras.models.clone_model(first)
        model = tf.keras.models.clone_model(first) if mode == "chief_only_model" else build()
        model.compile(optimizer="sgd", loss="mse")
        model.fit(np.ones((16, 4), np.int32), np.zeros((16, 1)), batch_size=4, verbose=0)
    sys.exit("models holding different PS variables trained")
if mode == "several_models":
    # a script training eight models one after another, each from Keras' random initialization (different on every
    # worker): each fit starts from worker 0's weights; prints each model's weights' sum after its fit
    import numpy as np  # pylint: disable=import-outside-toplevel
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    for width in range(1, 9):
        with strategy.scope():
            model = tf.keras.Sequential([tf.keras.Input((3,)), tf.keras.layers.Dense(width),
                                         tf.keras.layers.Dense(1)])
            model.compile(optimizer="sgd", loss="mse")
        model.fit(np.ones((8, 3), np.float32), np.ones((8, 1), np.float32), batch_size=4, epochs=1, verbose=0)
        print(f"model {width} weights sum {sum(float(np.sum(w)) for w in model.get_weights()):.6f}", flush=True)
if mode == "built_by_first_call":
    # models without an input shape, as Keras' guides write them: one compiled outside the scope (evaluated only),
    # a Sequential one and a subclassed one with a table, trained with Keras' default verbose=1
    import numpy as np  # pylint: disable=import-outside-toplevel
    import tensorflow as tf  # pylint: disable=import-outside-toplevel

    class Pooled(tf.keras.Model):
        def __init__(self):
            super().__init__()
            self.table = tf.keras.layers.Embedding(40, 4, name="table")
            self.out = tf.keras.layers.Dense(1, name="out")

        def call(self, ids):
            return self.out(tf.reduce_mean(self.table(ids), axis=1))

    outside = tf.keras.Sequential([tf.keras.layers.Dense(1)])
    outside.compile(optimizer="sgd", loss="mse")
    print(f"outside the scope: loss {outside.evaluate(np.ones((4, 3)), np.ones((4, 1)), verbose=0):.4f}", flush=True)
    with strategy.scope():
        for model, x in ((tf.keras.Sequential([tf.keras.layers.Dense(2), tf.keras.layers.Dense(1)]),
                          np.ones((8, 3), np.float32)),
                         (Pooled(), np.arange(16, dtype=np.int32).reshape(8, 2))):
            model.compile(optimizer="sgd", loss="mse")
            model.fit(x, np.ones((8, 1), np.float32), batch_size=2, epochs=1)
