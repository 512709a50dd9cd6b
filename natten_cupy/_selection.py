"""The select step of a call: which backend runs an op on a problem, and its launch plan.

``select_backend`` walks the backends for where the arrays live and returns a frozen
``Selection``: the op, the backend (name and module), the problem, and why the backends tried
before it refused. Both paths launch through it: the general path of ``ops`` (and the torch
layer) runs ``selection.backend`` on gathered arrays; the fast path (``_fast``) asks
``selection.plan(layouts)`` once per call signature for the ``_launch.Plan`` its warm calls
replay, after ``selection.tuned()`` has put an autotuned problem's winning tile in.
"""

from __future__ import annotations

import dataclasses
import logging
import types

import numpy

from ._args import NAProblem
from .backends import PREFERENCE, get_backend

__all__ = ["Selection", "select_backend"]

log = logging.getLogger("natten_cupy")


@dataclasses.dataclass(frozen=True)
class Selection:
    """The backend that runs ``op`` on ``problem`` (hashable: the module by identity)."""

    op: str
    name: str                  # the backend's NAME
    backend: types.ModuleType
    problem: NAProblem
    refused: tuple = ()        # "name: reason" of each backend tried before, fastest first

    @property
    def has_plans(self):
        """Whether the backend plans its launches (``plan``): only such calls are replayed
        warm; the reference and naive backends launch as they go."""
        return hasattr(self.backend, "plan")

    @property
    def row_inputs(self):
        """The op's inputs, in plan order, that the kernels read by 16-byte rows (the fast
        path copies those that cannot be read as they are)."""
        return self.backend.ROW_INPUTS[self.op]

    def tuned(self):
        """This selection with ``tile="autotune"`` replaced by the winner a call has timed
        (the backend's ``tuned``), or None while none has: the general path's run times the
        candidates first. Itself for any other tile, or a backend without a tile choice."""
        tune = getattr(self.backend, "tuned", None)
        if self.problem.tile != "autotune" or tune is None:
            return self
        problem = tune(self.op, self.problem)
        return None if problem is None else dataclasses.replace(self, problem=problem)

    def plan(self, layouts):
        """The ``_launch.Plan`` of the op on the current device for its operands'
        ``Layout``s, in the backend's order (``backends/__init__.py``), or None where the
        backend plans nothing for them: no plans at all, an operand that must first be
        copied, or a bias or additional tokens its planned kernels do not take. The tile
        must not be "autotune" (see ``tuned``)."""
        if not self.has_plans:
            return None
        return self.backend.plan(self.op, self.problem, layouts)


def select_backend(op, problem, xp, requested="auto"):
    """The ``Selection`` that runs ``op`` on ``problem``; ValueError if no backend can.

    NumPy arrays always run on the reference backend. ``auto`` walks PREFERENCE[op]
    (fastest first), takes the first backend that accepts the problem and logs why those
    before it refused.
    """
    if xp is numpy:
        if requested not in ("auto", "reference"):
            raise ValueError(f"backend {requested!r} runs on the GPU and needs CuPy or CUDA "
                             "arrays; NumPy/CPU arrays run on backend 'reference'")
        return Selection(op, "reference", get_backend("reference"), problem)
    names = PREFERENCE[op] if requested == "auto" else (requested,)
    reasons = []
    for name in names:
        mod = get_backend(name)
        why = "not available" if mod is None else mod.refuse(op, problem)
        if why is None:
            if reasons:
                log.info("natten_cupy %s: using %s (%s)", op, name, "; ".join(reasons))
            return Selection(op, name, mod, problem, tuple(reasons))
        reasons.append(f"{name}: {why}")
    raise ValueError(f"backend {requested!r} cannot run {op} for this problem "
                     f"(dtype {problem.dtype_name}, head_dim {problem.head_dim}): "
                     + "; ".join(reasons))
