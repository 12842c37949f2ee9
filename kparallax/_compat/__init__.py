"""Every private TensorFlow / Keras / Horovod call and every behavioural workaround kparallax relies on.

The pinned stack is tensorflow-cpu 2.15.1 (Keras 2.15 as ``tf.keras``) and horovod 0.28.1 (Gloo). Each module
below says which versions its workarounds are for and which symptom each prevents, so that supporting another pin
(for example TF 2.18 + tf-keras with ``TF_USE_LEGACY_KERAS=1``) means editing this package only.

    tf          shared PS variables (VarHandleOp with a fixed shared name), read hooks, eager context, graphs
    keras       Keras 2 check, optimizer families and clones, the layer being built, Keras' data split
    horovod     the collective keep-alive (Grappler prunes collectives that feed only control edges)
    connect     the serialized first connection to the PS tasks (a TF server crash on simultaneous connects)
    hosts       the host-name check for Horovod's Gloo process sets across hosts
    process     the teardown exit (TF's static destructors can abort a process holding live gRPC channels)
    bind_shim   LD_PRELOAD library that keeps TF's servers off the wildcard address
    assign_hook, striped, batch_norm, keras_losses
                the assignment hook, the striped table, BatchNormalization's statistics, compiled losses and metrics
    repeated_rows
                a scalar of a traced step recomputed on the batch's rows repeated twice (a sum or a mean)

Importing this package imports nothing: the launcher uses ``hosts``, ``process`` and ``bind_shim`` and must never
load TensorFlow or Horovod.
"""
