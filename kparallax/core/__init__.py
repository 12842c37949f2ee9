"""The training library's model side: the strategy facade (``strategy``), where variables go (``placement``,
``registry``, ``shared_variables``, ``tables``, ``partition_search``), Keras integration (``keras_hooks``, ``model_state``, ``layer_weights``, ``train_function``, ``fitting``, ``errors``,
``fit_callbacks``, ``data``) and the validated options (``options``). ``options`` is TensorFlow-free."""
