"""Values of a traced graph's tensors known while tracing: constants, and sizes read from static shapes."""

import numpy as np
import tensorflow as tf

_FOLDED = {"Sub": np.subtract, "Add": np.add, "AddV2": np.add, "Mul": np.multiply, "FloorMod": np.mod,
           "Range": np.arange, "Identity": lambda x: x, "Pack": lambda *xs: np.stack(xs),
           "ConcatV2": lambda *xs: np.concatenate(xs[:-1], axis=int(xs[-1]))}


def constant(tensor, depth=8):
    """``tensor``'s value while tracing, or None: TensorFlow's constant folding, and a few integer ops of constants
    it does not fold (``tf.nn.softmax(x, axis=0)``'s permutation: a range up to the rank minus one)."""
    value = tf.get_static_value(tensor)
    if value is not None or depth == 0 or tensor.op.type not in _FOLDED:
        return value
    inputs = [constant(x, depth - 1) for x in tensor.op.inputs]
    return None if any(x is None for x in inputs) else np.asarray(_FOLDED[tensor.op.type](*inputs))


# Ops that clamp their input between bounds: Keras' CategoryEncoding (and every lookup layer's multi_hot, count,
# one_hot and tf_idf output) sizes its ``tf.math.bincount`` by ``minimum(maxlength, maximum(minlength, max(x) + 1))``
# with ``minlength == maxlength``: a constant, though computed from the batch's largest id.
CLAMPS = ("Maximum", "Minimum", "ClipByValue")


def bounds(tensor, depth=8):
    """``(low, high)``: numbers every entry of ``tensor`` lies between, known while tracing through constants and
    ``CLAMPS`` (``(-inf, inf)`` where nothing is known)."""
    value = tf.get_static_value(tensor)
    if value is not None:
        value = np.asarray(value)
        if value.size and value.dtype.kind in "iuf":
            return float(np.min(value)), float(np.max(value))
    if depth == 0 or tensor.op.type not in CLAMPS:
        return -np.inf, np.inf
    inputs = [bounds(x, depth - 1) for x in tensor.op.inputs]
    if tensor.op.type == "ClipByValue":  # (x, low, high): min(max(x, low), high)
        (x_low, x_high), (low_low, low_high), (high_low, high_high) = inputs
        return min(max(x_low, low_low), high_low), min(max(x_high, low_high), high_high)
    pick = max if tensor.op.type == "Maximum" else min
    return pick(inputs[0][0], inputs[1][0]), pick(inputs[0][1], inputs[1][1])


def clamped(tensor):
    """The value of ``tensor``, made by an op of ``CLAMPS`` whose bounds leave it one number (a scalar, or of a
    shape known while tracing), or None."""
    if tensor.op.type not in CLAMPS or not tensor.shape.is_fully_defined():
        return None
    low, high = bounds(tensor)
    if low != high or not np.isfinite(low):
        return None
    return np.full(tensor.shape.as_list(), low, dtype=tensor.dtype.as_numpy_dtype)


def strided_axis(op, axis, rank, entries):
    """Where input axis ``axis`` of ``StridedSlice`` ``op`` (of an input of rank ``rank``, its spec of ``entries``
    entries) goes: ``(entry, out)``, the spec's entry slicing it and its axis in the output (None where that entry
    shrinks it), or ``(None, out)`` where it passes whole (within an ellipsis, or after the entries)."""
    masks = {name: op.get_attr(name + "_mask") for name in ("ellipsis", "new_axis", "shrink_axis")}
    bit = lambda name, i: (masks[name] >> i) & 1  # pylint: disable=unnecessary-lambda-assignment
    spanned = rank - sum(not bit("new_axis", i) and not bit("ellipsis", i) for i in range(entries))
    position = out = 0  # the input axis and output axis the next entry reads and makes
    for i in range(entries):
        if bit("ellipsis", i):
            if position <= axis < position + spanned:
                return None, out + axis - position
            position, out = position + spanned, out + spanned
        elif bit("new_axis", i):
            out += 1
        elif position == axis:
            return i, None if bit("shrink_axis", i) else out
        else:
            position, out = position + 1, out + (not bit("shrink_axis", i))
    return None, out + axis - position


def unwrapped(size):
    """Scalar ``size`` read through the ops that pass a size on unchanged (``Identity``, ``Cast``, ``Reshape``,
    ``Squeeze``)."""
    while size.op.type in ("Identity", "Cast", "Reshape", "Squeeze"):
        size = size.op.inputs[0]
    return size


def dimension_read(size):
    """``(x, k)`` when scalar ``size`` is ``tf.shape(x)[k]`` (a ``StridedSlice`` of a ``Shape``, begin ``[k]``,
    shrunk), k counted from the front; else None."""
    op = size.op
    if op.type != "StridedSlice" or op.get_attr("shrink_axis_mask") != 1 or op.inputs[0].op.type != "Shape":
        return None
    x, index = op.inputs[0].op.inputs[0], constant(op.inputs[1])
    rank = x.shape.rank
    if index is None or rank is None or not -rank <= int(np.ravel(index)[0]) < rank:
        return None
    return x, int(np.ravel(index)[0]) % rank


def size(tensor):
    """A scalar size's value while tracing: a constant, or a static dimension read by ``tf.shape(x)[k]`` (of a
    shape TensorFlow made a constant, too)."""
    value = constant(tensor)
    if value is not None:
        return int(value)
    op = tensor.op
    if op.type != "StridedSlice" or op.get_attr("shrink_axis_mask") != 1:
        return None
    index, shape = constant(op.inputs[1]), constant(op.inputs[0])
    if shape is not None and index is not None and np.ndim(shape) == 1:
        at = int(np.ravel(index)[0])
        return int(shape[at]) if -len(shape) <= at < len(shape) else None
    read = dimension_read(tensor)
    return None if read is None else read[0].shape[read[1]]
