"""A compiled model's train function and training step under the strategy.

``make_train_function`` runs ``steps_per_execution`` one-step functions per execution (each ends at the step's
barrier); before the first, it traces the step once to move replicated variables with sparse gradients onto PS tasks
(``hybrid``) and to warn where the batch's rows meet without ``kp.all_gather``. ``train_step_synchronous`` wraps the
model's own ``train_step`` in three contexts: the model's step (with the worker's own random seed), the global-loss
contract (``step/global_losses.py``) and the combined aggregated variables (``step/state_variables.py``); its logs
are taken over the workers (``step/logs.py``).
"""

import contextlib

import tensorflow as tf

from kparallax._compat import keras as keras_compat
from kparallax._compat import optimizers as optimizer_compat
from kparallax.core import model_state
from kparallax.core import placement
from kparallax.step import global_losses
from kparallax.step import logs as logs_lib
from kparallax.step import rows
from kparallax.step import state_variables
from kparallax.step import train_step

def make_train_function(original, model, force=False):
    """``steps_per_execution = N``: N calls of a one-step train function per execution, each ending at the step's
    barrier (Keras' in-graph loop does not keep the PS update of one step before the reads of the next)."""
    if model.train_function is not None and not force:
        return model.train_function
    single, placed = keras_compat.single_step_train_function(model, original), False

    def train_function(iterator):
        nonlocal single, placed
        creating = contextlib.nullcontext()
        if not placed:
            # The function traced before a move holds the moved variables' old handles: dropped with it.
            single, placed = _placed(original, model, single, iterator), True
            _warn_rows_meeting(model, single, iterator)
            model.train_function = train_function  # Keras' make_train_function, called again there, replaced it
            weights = model_state.compiled(model).weights
            if weights is not None:  # a model built by that trace: worker 0's values, before the step
                weights.sync_new()
                if _runs_eagerly(single):  # no trace: the step builds the model as it runs
                    creating = weights.broadcast_created()
        outputs = None
        with creating:
            for _ in range(keras_compat.steps_per_execution(model)):  # Keras lowers it for an epoch's last execution
                outputs = single(iterator)
        if model.__dict__.get("_kparallax_announce_pending"):  # a model built by its first step
            announce(model_state.compiled(model).strategy, model)
        return outputs

    model.train_function = train_function
    return train_function


def _warn_rows_meeting(model, single, iterator):
    """Worker 0 of a synchronous job of several workers: one warning where the traced step multiplies the batch's
    rows with each other without ``kp.all_gather`` (``rows.warn_rows_meeting``). Traces ``single`` without running
    it (its first call reuses the trace)."""
    strategy = model_state.compiled(model).strategy
    if strategy.num_workers == 1 or not strategy.options.sync or not strategy.is_chief or _runs_eagerly(single):
        return
    specs = [s for s in tf.nest.flatten(getattr(iterator, "element_spec", None)) if hasattr(s, "shape")]
    batch_rows = next((s.shape[0] for s in specs if s.shape.rank), None)
    rows.warn_rows_meeting(single.get_concrete_function(iterator).graph, batch_rows, strategy.num_workers)


def _runs_eagerly(single):
    """Whether the one-step train function ``single`` runs eagerly (``run_eagerly=True``: a plain Python function;
    ``tf.config.run_functions_eagerly(True)``)."""
    return not hasattr(single, "get_concrete_function") or tf.config.functions_run_eagerly()


def _placed(original, model, single, iterator):
    """Before the first step of ``single`` (a traced one-step train function): traces it without running it. If
    that trace found replicated variables with sparse gradients (``train_step.route``: under ``hybrid`` they belong
    on PS tasks, as Embedding tables do), moves them there (``HybridStrategy.move_to_ps``) and returns a train
    function traced anew; else ``single``, whose trace the first step reuses. No batch is consumed."""
    state = model_state.compiled(model)
    if _runs_eagerly(single) or state.step.moves_sparse is None:
        return single  # run_eagerly: an eager step cannot use PS variables
    state.step.probing, state.step.decided = True, False
    try:
        single.get_concrete_function(iterator)
    finally:
        state.step.probing = False
    moving, state.step.pending_moves = state.step.pending_moves, []
    if not moving:
        return single
    # The optimizer may hold slots for them already (built by a saver or a loader before the first step). Initial
    # ones (no step taken) are the state the PS-side copies start from; trained ones the move would lose.
    optimizer = optimizer_compat.step_optimizer(model)
    held = [v for v in moving if optimizer_compat.holds_slots(optimizer, v)]
    steps = int(optimizer.iterations.numpy())
    if held and steps:
        names = [v.name for v in held]
        raise ValueError(
            f"Variable(s) {names} get sparse gradients (tf.IndexedSlices), so under architecture='hybrid' they live on "
            "PS tasks, but the optimizer already holds their trained state here (loaded before the first step, e.g. "
            "by load_weights, BackupAndRestore or strategy.load_model), which moving them would lose. Received: "
            f"optimizer state after {steps} step(s) for replicated variables {names}. Name them in a placement rule "
            f"so they are made where they belong, e.g. placement={{{placement.variable_path(held[0])!r}: 'ps'}} (or "
            "'replicated' to allgather their rows); saved state loads either way.")
    state.strategy.move_to_ps(model, moving)
    model_state.guard_tracking(state.strategy, model, optimizer)
    if state.strategy.is_chief and model.__dict__.get("_kparallax_announced"):
        print("kparallax: moved to PS (sparse gradients): " + "; ".join(
            "{} -> ps[{}]".format(*state.strategy.ps_info(v)) for v in moving), flush=True)
    return keras_compat.single_step_train_function(model, original)


def train_step_synchronous(original, model, data):
    """The model's own ``train_step`` (Keras' or the user's) in kparallax's synchronous step: its losses follow the
    global-batch contract (``step/global_losses.py``), the assignments of its aggregated replicated variables are
    combined over the workers (``step/state_variables.py``), and its logs are taken over all workers in the step
    (``step/logs.py``: Keras' metrics from their summed states, other scalars averaged)."""
    state = model_state.compiled(model)
    strategy = state.strategy
    # Before this step's update (program order).
    iterations = optimizer_compat.step_optimizer(model).iterations.read_value()
    share = (global_losses.batch_share(data, strategy.num_workers)
             if state.uneven_batches and strategy.num_workers > 1 else None)
    with (train_step.model_step(strategy, _worker_random_seed(strategy)),
          global_losses.workers(strategy.num_workers, share, strategy.options.backward_passes_per_step),
          state_variables.combined(model, strategy.is_ps_variable, strategy.num_workers, share)):
        logs = original(model, data)
    return logs_lib.over_workers(logs, model.metrics, iterations, strategy.num_workers, "kp_step_logs", share,
                                 worker_index=strategy.worker_index)


def train_step_asynchronous(original, model, data):
    """Asynchronous training (``sync=False``): the model's own ``train_step`` as it is, marked as the model's
    training step (``train_step.model_step``), in which its compiled optimizer applies gradients (outside one, in a
    job of several workers, it is refused: a custom training loop)."""
    strategy = model_state.compiled(model).strategy
    with train_step.model_step(strategy):
        return original(model, data)


@contextlib.contextmanager
def _worker_random_seed(strategy):
    """While the training step is traced with a global seed set (``tf.keras.utils.set_random_seed``, the same on
    every worker): the random ops of the step (Dropout and other random layers without a generator of their own, a
    custom ``train_step``'s ``tf.random`` noise) draw from a seed of this worker's own, as one process draws
    independent values for the rows of its global batch. With the same seed everywhere, every worker drew the same
    masks and noise for its rows. Random layers that keep a ``tf.random.Generator`` (``RandomFlip``, ...) and create
    it in the step are seeded from a stream of this worker's own too (``keras_compat.worker_seed_generator``). Worker
    0 keeps the global seed; the draws stay reproducible run to run."""
    graph = tf.compat.v1.get_default_graph()
    seed = None if tf.executing_eagerly() else graph.seed
    with keras_compat.worker_seed_generator(strategy.worker_index):
        if seed is None or strategy.worker_index == 0:
            yield
            return
        graph.seed = (seed * 1_000_003 + strategy.worker_index) % (2 ** 31 - 1)
        try:
            yield
        finally:
            graph.seed = seed


def announce(strategy, model):
    """Prints, once per model on worker 0, where its variables live (tables -> PS tasks, sizes); for a model not
    built yet, after its first step (``make_train_function``), which creates them."""
    if model.__dict__.get("_kparallax_announced"):
        return
    if not model.built:
        model.__dict__["_kparallax_announce_pending"] = True
        return
    model.__dict__.pop("_kparallax_announce_pending", None)
    model.__dict__["_kparallax_announced"] = True
    on_ps = {}
    for variable in model.trainable_variables:
        entry = strategy.registry.get(variable)
        if entry is not None:
            path = entry.table.path if entry.table is not None else entry.path
            tasks, size = on_ps.get(path, ([], 0))
            on_ps[path] = (tasks + [entry.task], size + variable.shape.num_elements() * variable.dtype.size)
    replicated = [v for v in model.trainable_variables if strategy.registry.get(v) is None]
    shown = "; ".join(f"{path} -> ps{sorted(set(tasks))} ({_bytes(size)})" for path, (tasks, size) in on_ps.items())
    print(f"kparallax: {strategy.num_workers} worker(s), {strategy.cluster.num_ps} PS task(s), architecture "
          f"{strategy.options.architecture}; on PS: {shown or 'nothing'}; {len(replicated)} replicated variable(s) "
          f"({_bytes(sum(v.shape.num_elements() * v.dtype.size for v in replicated))})", flush=True)


def _bytes(n):
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"
