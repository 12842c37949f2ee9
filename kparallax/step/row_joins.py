"""Entries of something else than the batch joined to the batch's rows along their axis, followed until they part.

``tf.concat([per_example, prior], 0)`` joins the batch's rows (a per-example loss) to entries that are not the
batch's (a weight's, a prior's, sampled ids): one process joins them to the global batch once, each worker to its
own part. ``row_axes`` gives such a tensor the rows' axis ``UNKNOWN`` and a ``Join`` (``made``), and ``follow``
says what the ops reading it make of it:
- computed entry by entry (a cast, an element-wise op with values without rows or with a join of the same layout,
  as replayed inputs' predictions and their labels, a product with a weight, a gather at the joined ids, a
  reduction along another axis, a reshape splitting each entry into a whole count of entries, a new axis, a reversal
  or equal split along another axis, a tile or broadcast along other axes, joins of the same layout put side by
  side along another axis): the same join, its axis moved;
- split or sliced at the parts' edges (bounds known while tracing, or read from the parts' sizes while the step
  runs: ``tf.split(x, [tf.shape(rows)[0], -1])``, ``tf.slice(x, [0], tf.shape(rows))``): each part back, the
  batch's rows (``int``: their axis) or entries without them (``None``), as a sampled softmax looks up the true and
  sampled ids in one gather and splits the looked-up rows back;
- reduced or taken a softmax of along the joined axis (``tf.reduce_mean(tf.concat([per_example, prior], 0))``):
  ``met``, a ``joined`` meeting. One process takes it over the global batch and those entries once, each worker
  over its own part and them, so the averaged gradient is not one process's (a custom ``train_step`` of that mean
  on 2 workers: 0.010 off one process after 3 epochs, silently, before this was seen); so is a loop carrying a
  value from entry to entry along it (a ``tf.scan`` over its entries: ``row_axes`` records it at the loop);
- made into a list along another axis (``tf.TensorArray.unstack``, as a Keras RNN reads its time steps): a list
  whose elements are the join (``listed``); an element read, a join written (the RNN's outputs, one per time step)
  and the list stacked back keep it. Along the join, a list of its entries (``EACH``, ``tf.map_fn``'s): an element
  read is one entry (``ENTRY``), anything computed from it alone is of that entry, and written at the index it was
  read at, the list is the entries again, stacked back the join;
- a call of functions (a ``tf.function``, a ``tf.cond``'s branches) or a loop: ``row_axes`` follows their bodies with
  the join given to them (a loop's variable a join while it stays one from step to step);
- anything else: ``UNKNOWN``, as any op ``row_axes`` does not follow (nothing refused).
"""

import dataclasses

import numpy as np

from kparallax.step import traced_values

UNKNOWN = "unknown"

_PER_ENTRY = {"Identity", "Snapshot", "StopGradient", "PreventGradient", "Cast", "CheckNumerics",
              "CheckNumericsV2", "EnsureShape", "ZerosLike", "OnesLike", "Neg", "Abs", "Square", "Sqrt", "Exp", "Log",
              "Log1p", "Sigmoid", "Tanh", "Relu", "Softplus"}
_ELEMENTWISE = {"Add", "AddV2", "Sub", "Mul", "MulNoNan", "RealDiv", "Div", "DivNoNan", "Maximum", "Minimum",
                "SquaredDifference", "Equal", "NotEqual", "Less", "LessEqual", "Greater", "GreaterEqual", "SelectV2",
                "BiasAdd"}
_REDUCTIONS = {"Sum", "Mean", "Max", "Min", "Prod", "EuclideanNorm"}
_SOFTMAX = {"Softmax", "LogSoftmax"}
ENTRY = "entry"  # a Join's axis: a value of one entry of the join (an element of its list of entries)
EACH = "each"  # a listed Join's axis: a list whose element i is entry i of the join (``tf.map_fn``'s over it)
LISTS = {"TensorListFromTensor", "TensorListGetItem", "TensorListSetItem", "TensorListPushBack",
         "TensorListPopBack", "TensorListStack", "TensorListLength", "TensorListElementShape"}  # list ops


@dataclasses.dataclass(frozen=True, eq=False)  # compared by identity: it holds graph tensors
class Join:
    """A tensor whose axis ``axis`` joins the batch's rows to entries of something else than the batch: the
    ``parts`` (the inputs of ``source``, a ``ConcatV2`` along their axis ``along``), the one at ``rows`` holding
    the batch's rows on that axis, the others none; each entry of a part ``scale`` entries of the joined axis."""

    axis: int
    parts: tuple
    along: int
    rows: int
    source: object
    scale: int = 1  # entries of the joined axis per entry of a part (a reshape split each into as many)
    listed: bool = False  # a list whose elements are the join (on their axis ``axis``)

    def moved(self, axis, listed=None):
        """The same join on ``axis`` of another tensor (computed from this one entry by entry); of a list's
        elements if ``listed`` (None: as this one)."""
        listed = self.listed if listed is None else listed
        return self if (axis, listed) == (self.axis, self.listed) else dataclasses.replace(self, axis=axis,
                                                                                           listed=listed)

    @property
    def held(self):
        """The pair (tensor, axis) holding the batch's rows: the part of them, at the join."""
        return self.parts[self.rows], self.along


def equivalent(join, other, counts):
    """Whether ``other`` is ``join``, or a join of the same layout (``_aligned``: a mask joined as the inputs are),
    on the same axis of a list's elements alike. ``counts``: as ``follow``'s."""
    if other is None or (other.axis, other.listed) != (join.axis, join.listed):
        return False
    return _aligned(join, other, counts)


def made(op, value_axes, along):
    """The ``Join`` of ``ConcatV2`` ``op`` along ``along`` of inputs of rows' axes ``value_axes``, when exactly one
    holds the batch's rows, on that axis, and the others none; else None."""
    rows = [k for k, axis in enumerate(value_axes) if axis is not None]
    if len(rows) != 1 or value_axes[rows[0]] != along:
        return None
    return Join(along, tuple(op.inputs[:-1]), along, rows[0], op)


def follow(op, axes, joins, counts, at_read_index=False):
    """``(outputs, met)`` of graph ``op`` reading a join (``joins``: per input, its ``Join`` or None; ``axes``:
    per input, its rows' axis): per output a ``Join``, the batch's rows' axis, None or ``UNKNOWN`` (see the module
    docstring), and ``met`` True when the op reduces along the joined axis. ``counts(bound, join, k)`` says whether
    a bound (an int, or ``(tensor, axis)`` read while the step runs) is the count of entries of the join's part
    ``k``; ``at_read_index``: a list write's index is one a list of a join's entries was read at."""
    unknown = [UNKNOWN] * len(op.outputs)
    held = [(k, join) for k, join in enumerate(joins) if join is not None]
    # the join of a value before a mask's (a masked RNN's tf.where(mask, output, before): the inputs' join named)
    index, join = next(((k, j) for k, j in held if not op.inputs[k].dtype.is_bool), held[0])
    if any(axis is not None for axis, other in zip(axes, joins) if other is None):
        return unknown, False
    if op.type in LISTS:
        return _listed(op, joins, counts, at_read_index), False
    if any(other.listed for _, other in held):  # a list: passed on as it is, or read by a list op alone
        return ([join] if op.type in ("Identity", "Snapshot") and len(held) == 1 else unknown), False
    if not all(_aligned(join, other, counts) for _, other in held if other is not join):
        return unknown, False
    if any(other.axis == ENTRY for _, other in held):  # computed from one entry (and values without rows): its own
        return ([join] * len(op.outputs) if all(other.axis == ENTRY for _, other in held) else unknown), False
    kind, x = op.type, op.inputs[index]
    rank = x.shape.rank
    if rank is None:
        return unknown, False
    if kind in _PER_ENTRY and index == 0:
        return [join] + [UNKNOWN] * (len(op.outputs) - 1), False
    if kind in _ELEMENTWISE:
        out_rank = op.outputs[0].shape.rank
        moved = {join.axis + out_rank - op.inputs[k].shape.rank for k, join in held}
        return ([join.moved(moved.pop())] if len(moved) == 1 and out_rank is not None else unknown), False
    if kind in ("ConcatV2", "Pack"):  # joins side by side (a bidirectional RNN's two directions): each entry's own
        return _side_by_side(op, held, rank), False
    if len(held) > 1:
        return unknown, False
    if kind in _REDUCTIONS and index == 0:
        return _reduced(op, join, rank)
    if kind in _SOFTMAX:
        return (unknown, True) if join.axis == rank - 1 else ([join], False)
    if kind == "MatMul":  # a dense layer of the joined entries (a side without rows): each entry's own
        flip = op.get_attr("transpose_a" if index == 0 else "transpose_b")
        if rank != 2 or join.axis != (int(flip) if index == 0 else 1 - int(flip)):
            return unknown, False
        return [join.moved(index)], False
    if kind == "Reshape" and index == 0:
        return [_reshaped(op, join)], False
    if kind == "Squeeze" and index == 0:
        dims = [d % rank for d in op.get_attr("squeeze_dims")]
        if not dims or join.axis in dims:
            return unknown, False
        return [join.moved(join.axis - sum(d < join.axis for d in dims))], False
    if kind == "ExpandDims" and index == 0:
        where = traced_values.constant(op.inputs[1])
        if where is None:
            return unknown, False
        where = int(np.ravel(where)[0]) % (rank + 1)
        return [join.moved(join.axis + 1 if where <= join.axis else join.axis)], False
    if kind == "Transpose" and index == 0:
        permutation = traced_values.constant(op.inputs[1])
        if permutation is None:
            return unknown, False
        return [join.moved([int(a) for a in np.ravel(permutation)].index(join.axis))], False
    if kind == "GatherV2" and index == 1 and not op.get_attr("batch_dims"):
        gathered = traced_values.constant(op.inputs[2])
        params = op.inputs[0].shape.rank
        if gathered is None or params is None:
            return unknown, False
        return [join.moved(int(np.ravel(gathered)[0]) % params + join.axis)], False
    if kind == "ResourceGather" and index == 1 and not op.get_attr("batch_dims"):
        return [join], False
    if kind == "Unique" and index == 0:  # (the distinct values: a set without rows, where each value is in it)
        return [None, join], False
    if kind in ("Slice", "StridedSlice") and index == 0:
        bounds = _slice_bounds(op, join.axis, rank)
        if bounds is None:
            return unknown, False
        part = _part(join, *bounds[:2], counts)
        return [join.moved(bounds[2]) if part is join else bounds[2] if isinstance(part, int) else part], False
    if kind == "SplitV" and index == 0:
        return _split(op, join, rank, counts), False
    if kind == "Tile" and index == 0:  # copies along other axes (a mask tiled over an RNN's units)
        multiples = traced_values.constant(op.inputs[1])
        if multiples is None or int(np.ravel(multiples)[join.axis]) != 1:
            return unknown, False
        return [join], False
    if kind == "BroadcastTo" and index == 0:  # new axes before it, or other axes of size 1 broadcast
        out_rank, size = op.outputs[0].shape.rank, x.shape[join.axis]
        if out_rank is None or size == 1:
            return unknown, False
        return [join.moved(join.axis + out_rank - rank)], False
    if kind == "ReverseV2" and index == 0:  # (a bidirectional RNN's backward time steps)
        reversed_axes = traced_values.constant(op.inputs[1])
        if reversed_axes is None or join.axis in {int(a) % rank for a in np.ravel(reversed_axes)}:
            return unknown, False
        return [join], False
    if kind == "Split" and index == 1:  # (axis, value) in equal parts: along another axis (an LSTM's gates)
        along = traced_values.constant(op.inputs[0])
        if along is None or int(np.ravel(along)[0]) % rank == join.axis:
            return unknown, False
        return [join] * len(op.outputs), False
    return unknown, False


def _side_by_side(op, held, rank):
    """``ConcatV2`` or ``Pack`` of joins alone (``held``: pairs (input, join), aligned), each on the same axis: the
    join, where they are put together along another axis; ``UNKNOWN`` otherwise."""
    values = len(op.inputs) - (op.type == "ConcatV2")
    axis = held[0][1].axis
    if len(held) != values or any(join.axis != axis for _, join in held):
        return [UNKNOWN]
    if op.type == "Pack":
        along = op.get_attr("axis") % (rank + 1)
        return [held[0][1].moved(axis + 1 if along <= axis else axis)]
    along = traced_values.constant(op.inputs[-1])
    return [UNKNOWN] if along is None or int(np.ravel(along)[0]) % rank == axis else [held[0][1]]


def _listed(op, joins, counts, at_read_index):
    """The outputs of list op ``op`` reading a join or a list of one (``joins``: per input): a tensor's slices along
    an axis before the join made into a list of the join, along the join a list of its entries (``EACH``, as
    ``tf.map_fn`` reads them); an element read (of the entries: one entry, ``ENTRY``); a join written to a list
    without rows or of the same layout (one entry at the index an entry was read at: a list of the entries); the
    list stacked back on axis 0; ``UNKNOWN`` otherwise."""
    kind, unknown = op.type, [UNKNOWN] * len(op.outputs)
    listed, item = joins[0], joins[-1]
    if kind == "TensorListFromTensor":
        if listed is None or listed.axis == ENTRY:
            return unknown
        return [listed.moved(listed.axis - 1 if listed.axis else EACH, True)]
    if kind in ("TensorListLength", "TensorListElementShape"):
        return [None]
    if kind in ("TensorListSetItem", "TensorListPushBack"):
        if item is None or item.listed or any(j is not None for j in joins[1:-1]):
            return unknown
        if item.axis == ENTRY and not (kind == "TensorListSetItem" and at_read_index):
            return unknown
        written = item.moved(EACH if item.axis == ENTRY else item.axis, True)
        return [listed or written] if listed is None or equivalent(listed, written, counts) else unknown
    if listed is None or not listed.listed or any(j is not None for j in joins[1:]):
        return unknown
    element = listed.moved(ENTRY if listed.axis == EACH else listed.axis, False)
    if kind == "TensorListGetItem":
        return [element]
    if kind == "TensorListPopBack" and listed.axis != EACH:
        return [listed, element]
    if kind == "TensorListStack":
        return [element.moved(0 if listed.axis == EACH else element.axis + 1)]
    return unknown


def _aligned(join, other, counts):
    """Whether joins ``join`` and ``other`` hold their parts entry for entry (the same join, or two of the same
    layout: inputs and labels of the batch each joined to as many replayed ones)."""
    if other.scale != join.scale:
        return False
    if other.source is join.source:
        return True
    if len(other.parts) != len(join.parts) or other.rows != join.rows:
        return False
    for k, part in enumerate(other.parts):
        size = part.shape[other.along]
        if not counts(size * other.scale if size is not None else (part, other.along, other.scale), join, k):
            return False
    return True


def _reduced(op, join, rank):
    """A reduction of a join: ``met`` along the joined axis, else the join on its axis in the output."""
    reduced = traced_values.constant(op.inputs[1])
    if reduced is None:
        return [UNKNOWN], False
    reduced = {int(a) % rank for a in np.atleast_1d(reduced)} if rank else set()
    if join.axis in reduced:
        return [UNKNOWN], True
    keep = op.get_attr("keep_dims")
    return [join.moved(join.axis if keep else join.axis - sum(a < join.axis for a in reduced))], False


def _reshaped(op, join):
    """A reshape of a join along its first axis into entries of sizes known while tracing (``[-1]``, ``[-1, 1]``):
    the join, each entry of the input split into a whole count of the output's; ``UNKNOWN`` otherwise (entries
    holding parts of several, or a fixed count of them)."""
    before, after = op.inputs[0].shape, op.outputs[0].shape
    if (join.axis != 0 or not before[1:].is_fully_defined() or after.rank is None or not after.rank
            or not after[1:].is_fully_defined() or not after[1:].num_elements()):
        return UNKNOWN
    split, rest = divmod(before[1:].num_elements(), after[1:].num_elements())
    if rest or not split:
        return UNKNOWN
    return dataclasses.replace(join, axis=0, scale=join.scale * split)


def _slice_bounds(op, axis, rank):
    """``(begin, size, axis)`` of a ``Slice`` along ``axis``, or of a ``StridedSlice`` of stride 1 along it (other
    axes shrunk, new ones added, an ellipsis) and where that axis is in its output: each bound an int or ``(tensor,
    axis)`` read while the step runs, a size -1 to the end; None where not known (or a negative end)."""
    if op.type == "Slice":
        begin, size = _bound(op.inputs[1], axis), _bound(op.inputs[2], axis)
        return None if begin is None or size is None else (begin, size, axis)
    strides, entries = traced_values.constant(op.inputs[3]), op.inputs[1].shape[0]
    if strides is None or entries is None:
        return None
    entry, out = traced_values.strided_axis(op, axis, rank, entries)
    if entry is None:
        return 0, -1, out  # the joined axis within an ellipsis or after the slice's entries: whole
    if out is None or int(np.ravel(strides)[entry]) != 1:  # shrunk, or strided
        return None
    return _slice_entry(op, entry, (op.get_attr("begin_mask") >> entry) & 1, (op.get_attr("end_mask") >> entry) & 1,
                        out)


def _slice_entry(op, i, from_start, to_end, out):
    """``(begin, size, out)`` of entry ``i`` of a strided slice along the joined axis (at ``out`` in its output);
    None where not known, or not from 0 to an end or from a part's edge to the end."""
    begin = 0 if from_start else _bound(op.inputs[1], i)
    if to_end:
        return None if begin is None else (begin, -1, out)  # to the end
    end = _bound(op.inputs[2], i)
    if begin != 0 or end is None or isinstance(end, int) and end < 0:
        return None
    return begin, end, out  # from 0, the end is the size


def _split(op, join, rank, counts):
    """``SplitV`` (value, sizes, axis) of a join: along another axis, the join in each output; along the joined
    one, each output the parts its size spans from where the last ended (``_part``)."""
    along = traced_values.constant(op.inputs[2])
    if along is None:
        return [UNKNOWN] * len(op.outputs)
    if int(np.ravel(along)[0]) % rank != join.axis:
        return [join] * len(op.outputs)
    outputs, start = [], 0
    for k in range(len(op.outputs)):
        size = _bound(op.inputs[1], k)
        end = None if start is None or size is None else _end(join, start, size, counts)
        outputs.append(UNKNOWN if end is None else _covering(join, start, end))
        start = end
    return outputs


def _part(join, begin, size, counts):
    """What a slice of ``join``'s axis holds, from ``begin``, ``size`` entries (-1: to the end): the join (every
    part), the batch's rows' axis (the rows' part alone), None (parts without rows alone) or ``UNKNOWN`` (bounds not
    on the parts' edges, or rows and other entries but not all)."""
    start = _start(join, begin, counts)
    end = None if start is None else _end(join, start, size, counts)
    return UNKNOWN if end is None else _covering(join, start, end)


def _start(join, begin, counts):
    """The part a slice beginning at ``begin`` starts with, when ``begin`` is a part's edge; else None."""
    if begin == 0:
        return 0
    for k in range(1, len(join.parts)):
        if (k == 1 and counts(begin, join, 0)) or (isinstance(begin, int) and _static_sum(join, 0, k) == begin):
            return k
    return None


def _end(join, start, size, counts):
    """The part after the last that ``size`` entries from part ``start`` span (-1: every part after it), when
    on a part's edge; else None."""
    if size == -1:
        return len(join.parts)
    for k in range(start + 1, len(join.parts) + 1):
        if (k == start + 1 and counts(size, join, start)) or (
                isinstance(size, int) and _static_sum(join, start, k) == size):
            return k
    return None


def _covering(join, start, end):
    """What parts ``start`` to ``end`` (not included) of ``join`` hold, one after the other."""
    if start == 0 and end == len(join.parts):
        return join
    if start == join.rows and end == join.rows + 1:
        return join.axis
    if not start <= join.rows < end:
        return None
    return UNKNOWN


def _static_sum(join, start, end):
    """The entries of parts ``start`` to ``end`` along the join, when known while tracing; else None."""
    sizes = [part.shape[join.along] for part in join.parts[start:end]]
    return None if any(size is None for size in sizes) else sum(sizes) * join.scale


def _bound(vector, k):
    """Entry ``k`` of an int vector (a slice's begin or size, a split's sizes): an int known while tracing, or
    ``(tensor, axis)`` where it is ``tf.shape(tensor)[axis]`` (an entry of a ``tf.shape``; of a ``tf.stack``, also
    ``(tensor, axis, factor)``: that size times an int, ``_read``); None otherwise."""
    value = traced_values.constant(vector)
    if value is not None:
        flat = np.ravel(value)
        return int(flat[k]) if k < flat.size else None
    op = vector.op
    if op.type == "Shape":
        return op.inputs[0], k
    if op.type != "Pack" or k >= len(op.inputs):
        return None
    return _read(op.inputs[k])


def _read(scalar):
    """A scalar bound: an int known while tracing, ``(tensor, axis)`` where it is ``tf.shape(tensor)[axis]``, or
    ``(tensor, axis, factor)`` where it is that times an int known while tracing; None otherwise."""
    value = traced_values.size(scalar) if scalar.shape.rank == 0 else None
    if value is not None:
        return int(value)
    scalar = traced_values.unwrapped(scalar)
    if scalar.op.type == "Mul":
        factors = [traced_values.constant(x) for x in scalar.op.inputs]
        for read, factor in ((scalar.op.inputs[0], factors[1]), (scalar.op.inputs[1], factors[0])):
            inner = None if factor is None or np.size(factor) != 1 else _read(read)
            if isinstance(inner, int):
                return inner * int(np.ravel(factor)[0])
            if isinstance(inner, tuple) and len(inner) == 2:
                return (*inner, int(np.ravel(factor)[0]))
        return None
    return traced_values.dimension_read(scalar)
