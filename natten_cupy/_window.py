"""Window arithmetic of neighborhood attention, per axis, in Python.

This module is the Python twin of ``cuda_src/natten/window.cuh``: the same rules
(SPEC section 1), written for whole coordinate vectors at once so the reference
backend can build gather tables from them.

Vocabulary (one axis, extent ``L``, kernel ``k``, stride ``s``, dilation ``d``):

* a coordinate ``i`` lies in dilation group ``g = i % d`` at in-group index ``i' = i // d``;
  the group has ``L_g = ceil((L - g) / d)`` members;
* a query's window is the half-open in-group range ``[start, end)``; its *slot base* is
  ``start`` (the key in slot ``t`` of the unfused attention weights is ``start + t``);
  non-causal windows hold exactly ``k`` keys, causal ones ``end - start <= k``;
* the inverse window of a key is the in-group range of queries whose window holds it;
* a *box* is ``rows`` consecutive in-group indices of one group (a CTA's share of an axis);
  its *span* is the length of the union of its rows' windows (inverse windows), the keys
  (queries) it reaches on the axis: ``box_span`` gives the largest over every box.
"""

from __future__ import annotations

import numpy

__all__ = [
    "group_size",
    "window_bounds",
    "inverse_bounds",
    "forward_table",
    "inverse_table",
    "box_ranges",
    "box_span",
]


def group_size(extent, dilation, group):
    """Members of dilation group ``group`` on an axis of ``extent``: ceil((L - g) / d)."""
    return (extent - group + dilation - 1) // dilation


def window_bounds(ig, group_len, kernel, stride, causal):
    """In-group window ``[start, end)`` of in-group query index ``ig`` (int array or int).

    ``group_len`` may be an array broadcastable against ``ig`` (one value per group).
    """
    ig = numpy.asarray(ig, dtype=numpy.int64)
    group_len = numpy.asarray(group_len, dtype=numpy.int64)
    leader_base = (ig // stride) * stride
    if causal:
        leader = numpy.minimum(leader_base + stride - 1, group_len - 1)
        start = numpy.maximum(leader - kernel + 1, 0)
        end = ig + 1
    else:
        leader = numpy.minimum(leader_base + stride // 2, group_len - 1)
        start = numpy.clip(leader - kernel // 2, 0, group_len - kernel)
        end = start + kernel
    return start, end


def inverse_bounds(jg, group_len, kernel, stride, causal):
    """In-group query range ``[lo, hi)`` whose windows contain in-group key index ``jg``.

    Window starts and ends are non-decreasing in the query index, so the set is
    contiguous: ``lo`` is the first query whose window ends after ``jg``, ``hi - 1``
    the last query whose window starts at or before ``jg``. Found by bisection over
    all in-group queries, which needs no closed form per case.
    """
    jg = numpy.asarray(jg, dtype=numpy.int64)
    group_len = numpy.broadcast_to(numpy.asarray(group_len, dtype=numpy.int64), jg.shape)

    def first_true(pred):
        lo = numpy.zeros(jg.shape, dtype=numpy.int64)
        hi = group_len.copy()  # pred(hi) is taken as true
        while True:
            active = lo < hi
            if not active.any():
                return lo
            mid = (lo + hi) // 2
            ok = pred(mid)
            hi = numpy.where(active & ok, mid, hi)
            lo = numpy.where(active & ~ok, mid + 1, lo)

    def ends_after(mid):
        _, end = window_bounds(mid, group_len, kernel, stride, causal)
        return end > jg

    def starts_after(mid):
        start, _ = window_bounds(mid, group_len, kernel, stride, causal)
        return start > jg

    return first_true(ends_after), first_true(starts_after)


def box_ranges(group_len, kernel, stride, causal, rows, inverse=False):
    """The boxes of ``rows`` rows of one dilation group (starting at multiples of ``rows``,
    the last one cut at the group's end): arrays (first row, last row, start, end), where
    ``[start, end)`` is the union of the rows' windows (with ``inverse``: inverse windows).
    Starts and ends never decrease with the row, so that union is one range."""
    first = numpy.arange(0, group_len, rows, dtype=numpy.int64)
    last = numpy.minimum(first + rows, group_len) - 1
    bounds = inverse_bounds if inverse else window_bounds
    start, _ = bounds(first, group_len, kernel, stride, causal)
    _, end = bounds(last, group_len, kernel, stride, causal)
    return first, last, start, end


def box_span(extent, kernel, stride, dilation, causal, rows, inverse=False):
    """Largest span on one axis, over every dilation group and every box of ``rows`` rows
    (``box_ranges``): ``end - start`` of the union of the box's windows, or with ``inverse``
    of its inverse windows."""
    best = 1
    for g in range(dilation):
        _, _, start, end = box_ranges(group_size(extent, dilation, g), kernel, stride, causal,
                                      rows, inverse)
        best = max(best, int((end - start).max()))
    return best


def forward_table(extent, kernel, stride, dilation, causal):
    """Keys of every query on one axis, as slots.

    Returns ``(keys, valid)``, both of shape ``[extent, kernel]``: ``keys[i, t]`` is the
    coordinate of the key in slot ``t`` of query ``i`` (clamped into range where the slot
    is empty), ``valid[i, t]`` whether that slot holds a key of the window.
    """
    i = numpy.arange(extent, dtype=numpy.int64)
    g, ig = i % dilation, i // dilation
    start, end = window_bounds(ig, group_size(extent, dilation, g), kernel, stride, causal)
    jg = start[:, None] + numpy.arange(kernel, dtype=numpy.int64)[None, :]
    valid = jg < end[:, None]
    keys = g[:, None] + dilation * numpy.minimum(jg, end[:, None] - 1)
    return keys, valid


def inverse_table(extent, kernel, stride, dilation, causal):
    """Queries whose windows hold each key on one axis.

    Returns ``(queries, slots, valid)``, each ``[extent, M]`` with ``M`` the largest inverse
    window on the axis: ``queries[j, u]`` is a query coordinate whose window holds key
    ``j``, ``slots[j, u]`` the slot of ``j`` in that query's window, ``valid[j, u]``
    whether entry ``u`` is used (padding entries repeat a valid one).
    """
    j = numpy.arange(extent, dtype=numpy.int64)
    g, jg = j % dilation, j // dilation
    glen = group_size(extent, dilation, g)
    lo, hi = inverse_bounds(jg, glen, kernel, stride, causal)
    width = int((hi - lo).max())
    ig = lo[:, None] + numpy.arange(width, dtype=numpy.int64)[None, :]
    valid = ig < hi[:, None]
    ig = numpy.minimum(ig, hi[:, None] - 1)
    start, _ = window_bounds(ig, glen[:, None], kernel, stride, causal)
    return g[:, None] + dilation * ig, jg[:, None] - start, valid
