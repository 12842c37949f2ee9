"""A metric state the training step sets instead of adding to (an assign or a scatter that sets entries), and any
write of a state of aggregation NONE (kparallax/step/metric_states.py): refused while a step of several workers is
traced, since a logged result comes from the workers' states summed (or, for NONE, could only be their results
averaged); states that add (assign_add, assign_sub, assign(state + delta), scatter_add), states that say how they
combine, and every Keras metric are not.
In one process, tracing Keras' own train_step; the refusal in a real 2-worker fit is in test_launcher.py
(metric_set_state)."""

import pytest
import tensorflow as tf

from kparallax.step import metric_states


class _Written(tf.keras.metrics.Metric):
    """A state written by ``how`` from the batch's mean prediction."""

    def __init__(self, how, aggregation=tf.VariableAggregation.SUM):
        super().__init__(name="written")
        self.how = how
        self.state = self.add_weight("state", initializer="zeros", aggregation=aggregation)

    def update_state(self, y_true, y_pred, sample_weight=None):
        x = tf.reduce_mean(y_pred)
        writes = {"set": lambda: self.state.assign(x),
                  "maximum": lambda: self.state.assign(tf.maximum(self.state, x)),
                  "constant": lambda: self.state.assign(1.0),
                  "subtracted_from": lambda: self.state.assign(x - self.state),
                  "scaled_by_itself": lambda: self.state.assign(self.state + self.state * x),
                  "assign_add": lambda: self.state.assign_add(x),
                  "assign_sub": lambda: self.state.assign_sub(x),
                  "plus": lambda: self.state.assign(self.state + x),
                  "plus_first": lambda: self.state.assign(x + self.state),
                  "minus": lambda: self.state.assign(self.state - x)}
        writes[self.how]()

    def result(self):
        return self.state


class _Scattered(tf.keras.metrics.Metric):
    """A state per class (the first target column's 0 or 1) written by ``how`` at the batch's classes."""

    def __init__(self, how, aggregation=tf.VariableAggregation.SUM):
        super().__init__(name="scattered")
        self.how = how
        self.state = self.add_weight("state", shape=(2,), initializer="zeros", aggregation=aggregation)

    def update_state(self, y_true, y_pred, sample_weight=None):
        classes = tf.cast(y_true[:, 0], tf.int32)
        rows = tf.IndexedSlices(tf.reduce_mean(y_pred, axis=1), classes)
        nd = (classes[:, None], rows.values)
        writes = {"scatter_update": lambda: self.state.scatter_update(rows),
                  "scatter_max": lambda: self.state.scatter_max(rows),
                  "scatter_mul": lambda: self.state.scatter_mul(rows),
                  "scatter_nd_update": lambda: self.state.scatter_nd_update(*nd),
                  "scatter_add": lambda: self.state.scatter_add(rows),
                  "scatter_sub": lambda: self.state.scatter_sub(rows),
                  "scatter_nd_add": lambda: self.state.scatter_nd_add(*nd)}
        writes[self.how]()

    def result(self):
        return tf.reduce_sum(self.state)


class _Unaggregated(tf.keras.metrics.Metric):
    """A row count kept in a ``tf.Variable`` (aggregation NONE unless given), written by ``how``."""

    def __init__(self, how, **aggregation):
        super().__init__(name="unaggregated")
        self.how = how
        self.count = tf.Variable(tf.zeros(2), trainable=False, name="count", **aggregation)

    def update_state(self, y_true, y_pred, sample_weight=None):
        rows = tf.cast(tf.shape(y_true)[0], tf.float32)
        writes = {"assign_add": lambda: self.count.assign_add([rows, 1.0]),
                  "assign": lambda: self.count.assign(self.count + [rows, 1.0]),
                  "assign_sub": lambda: self.count.assign_sub([rows, 1.0]),
                  "scatter_add": lambda: self.count.scatter_add(tf.IndexedSlices([rows], [0]))}
        writes[self.how]()

    def result(self):
        return self.count[0]


def _trace_step(metrics, workers=2):
    model = tf.keras.Sequential([tf.keras.Input((3,)), tf.keras.layers.Dense(2, activation="sigmoid")])
    model.compile("sgd", "mse", metrics=metrics)
    x, y = tf.ones((4, 3)), tf.constant([[1., 0.], [0., 1.], [1., 1.], [0., 0.]])

    @tf.function
    def step():
        with metric_states.checked(model, workers):
            return model.train_step((x, y))

    return step()


@pytest.mark.parametrize("how, made", [("set", "Mean"), ("maximum", "Maximum"), ("constant", "float"),
                                       ("subtracted_from", "Sub"), ("scaled_by_itself", "AddV2")])
def test_a_state_set_in_the_step_is_refused_naming_the_metric_and_the_fixes(how, made):
    with pytest.raises(ValueError) as refused:
        _trace_step([_Written(how)])
    message = str(refused.value)
    assert "Metric 'written' (_Written) sets its state 'state' in the training step (assign)" in message
    assert f"Received: state.assign(<{made}>) in a step of 2 workers." in message
    assert "aggregation=tf.VariableAggregation.MEAN" in message and "kp.all_gather(values)" in message


@pytest.mark.parametrize("how", ["assign_add", "assign_sub", "plus", "plus_first", "minus"])
def test_a_state_added_to_is_not_refused(how):
    assert "written" in _trace_step([_Written(how)])


@pytest.mark.parametrize("aggregation", [tf.VariableAggregation.MEAN, tf.VariableAggregation.ONLY_FIRST_REPLICA])
def test_a_state_saying_how_the_workers_combine_is_not_refused(aggregation):
    assert "written" in _trace_step([_Written("maximum", aggregation)])


@pytest.mark.parametrize("how, made", [("scatter_update", "IndexedSlices"), ("scatter_max", "IndexedSlices"),
                                       ("scatter_mul", "IndexedSlices"), ("scatter_nd_update", "indices, updates")])
def test_a_state_set_by_a_scatter_is_refused(how, made):
    with pytest.raises(ValueError) as refused:
        _trace_step([_Scattered(how)])
    message = str(refused.value)
    assert f"Metric 'scattered' (_Scattered) sets its state 'state' in the training step ({how})" in message
    assert f"Received: state.{how}(<{made}>) in a step of 2 workers." in message


@pytest.mark.parametrize("how", ["scatter_add", "scatter_sub", "scatter_nd_add"])
def test_a_state_added_to_by_a_scatter_is_not_refused(how):
    assert "scattered" in _trace_step([_Scattered(how)])


def test_a_scatter_of_a_state_saying_how_the_workers_combine_is_not_refused():
    assert "scattered" in _trace_step([_Scattered("scatter_update", tf.VariableAggregation.ONLY_FIRST_REPLICA)])


@pytest.mark.parametrize("how, made", [("assign_add", "list"), ("assign", "AddV2"), ("assign_sub", "list"),
                                       ("scatter_add", "IndexedSlices")])
def test_any_write_of_a_state_without_an_aggregation_is_refused(how, made):
    with pytest.raises(ValueError) as refused:
        _trace_step([_Unaggregated(how)])
    message = str(refused.value)
    assert (f"Metric 'unaggregated' (_Unaggregated) writes its state 'count' in the training step ({how}), a "
            "variable of aggregation NONE") in message
    assert f"Received: count.{how}(<{made}>) of an aggregation=NONE state in a step of 2 workers." in message
    assert "self.add_weight('count', ...)" in message and "aggregation=tf.VariableAggregation.SUM" in message


@pytest.mark.parametrize("aggregation", [tf.VariableAggregation.SUM, tf.VariableAggregation.MEAN,
                                         tf.VariableAggregation.ONLY_FIRST_REPLICA])
def test_a_tf_variable_state_given_an_aggregation_is_not_refused(aggregation):
    assert "unaggregated" in _trace_step([_Unaggregated("assign_add", aggregation=aggregation)])


def test_one_worker_is_not_checked():
    assert "written" in _trace_step([_Written("maximum")], workers=1)
    assert "unaggregated" in _trace_step([_Unaggregated("assign_add")], workers=1)


def test_keras_metrics_are_not_refused():
    m = tf.keras.metrics
    metrics = [m.AUC(), m.AUC(multi_label=True, num_labels=2, name="auc_labels"), m.Accuracy(), m.BinaryAccuracy(),
               m.BinaryCrossentropy(), m.BinaryIoU(), m.CategoricalAccuracy(), m.CategoricalCrossentropy(),
               m.CategoricalHinge(), m.CosineSimilarity(), m.F1Score(), m.FBetaScore(), m.FalseNegatives(),
               m.FalsePositives(), m.Hinge(), m.KLDivergence(), m.LogCoshError(), m.MeanAbsoluteError(),
               m.MeanAbsolutePercentageError(), m.MeanRelativeError(normalizer=[1., 1.]), m.MeanSquaredError(),
               m.MeanSquaredLogarithmicError(), m.Poisson(), m.Precision(), m.PrecisionAtRecall(0.5), m.R2Score(),
               m.Recall(), m.RecallAtPrecision(0.5), m.RootMeanSquaredError(), m.SensitivityAtSpecificity(0.5),
               m.SpecificityAtSensitivity(0.5), m.SquaredHinge(), m.TopKCategoricalAccuracy(k=1),
               m.TrueNegatives(), m.TruePositives(), m.MeanIoU(2), m.IoU(2, [0]), m.OneHotIoU(2, [0]),
               m.OneHotMeanIoU(2)]
    logs = _trace_step(metrics)
    assert len(logs) == len(metrics) + 1  # and the loss
