"""Every private TensorFlow / Keras / Horovod call and every behavioural workaround kparallax relies on.

The pinned stack is tensorflow-cpu 2.15.1 (Keras 2.15 as ``tf.keras``) and horovod 0.28.1 (Gloo). Each module
below says which versions its workarounds are for and which symptom each prevents, so that supporting another pin
(for example TF 2.18+ with tf-keras and ``TF_USE_LEGACY_KERAS=1``) means editing this package only. Keras' internals
are reached by module through one function, ``keras.internal`` (``keras.src`` or ``tf_keras.src``).

    tf          shared PS variables (VarHandleOp with a fixed shared name), read hooks, eager context, graphs,
                the chain of datasets a tf.data pipeline is built from
    keras       Keras 2 check, optimizer families and clones, the layer being built, Keras' data split
    horovod     the collective keep-alive (Grappler prunes collectives that feed only control edges)
    connect     the serialized first connection to the PS tasks (a TF server crash on simultaneous connects)
    hosts       the host-name check for Horovod's Gloo process sets across hosts
    process     the teardown exit (TF's static destructors can abort a process holding live gRPC channels)
    bind_shim   LD_PRELOAD library that keeps TF's servers off the wildcard address
    assign_hook, striped, batch_norm, keras_losses
                the assignment hook, the striped table, synchronized BatchNormalization, compiled losses

Process-wide patches, each installed once, none replaced while a step is traced:

    tf.keras.Model.compile, get_weights, set_weights, save, save_weights, export, load_weights
                (core/keras_hooks.install, core/layer_weights): a model compiled in a strategy's scope gets its
                own methods; models holding PS variables save and present their tables whole
    apply_gradients of Keras' two optimizer base classes (core/keras_hooks): a second optimizer in a model's
                step averages over the workers; elsewhere in a job of several workers it is refused
    ResourceVariable.assign / assign_add / assign_sub / scatter_* (assign_hook): aggregated variables combined
                over the workers in the step, PS variables' writes guarded (made once, or refused)
    BatchNormalizationBase._calculate_mean_and_var (batch_norm): synchronized layers' moments over the workers
    tf.nn.embedding_lookup* dispatch for the striped table (striped): lookups gather from the owning stripes
    _ParallelInterleaveDataset.__init__ (tf): keeps its ``deterministic`` argument, so fit can refuse a dataset
                that gives its elements out of order
    a compiled model's LossesContainer._losses (keras_losses, per model at its first step): summed and masked
                losses scaled for the workers

Importing this package imports nothing: the launcher uses ``hosts``, ``process`` and ``bind_shim`` and must never
load TensorFlow or Horovod.
"""
