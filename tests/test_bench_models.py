"""bench/models.py without a GPU: its FlexAttention mask_mod is SPEC's neighborhood, and the
README table renders from its JSON."""

import os
import sys

import pytest

torch = pytest.importorskip("torch")

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "bench"))
import models  # noqa: E402
import peers  # noqa: E402
import workloads as wl  # noqa: E402

GEOMETRIES = [  # small stand-ins for the M set's option mixes, plus stride
    ((13, 11), (7, 5), (1, 1), (1, 1), (False, False)),
    ((17, 16), (3, 5), (1, 1), (4, 2), (False, False)),
    ((5, 9, 10), (3, 5, 5), (1, 1, 1), (1, 1, 1), (True, False, False)),
    ((40,), (9,), (1,), (1,), (True,)),
    ((19, 13), (4, 6), (2, 3), (2, 1), (True, False)),
    ((6, 7, 9), (2, 3, 4), (2, 1, 4), (1, 2, 2), (False, True, True)),
]


@pytest.mark.parametrize("geom", GEOMETRIES, ids=lambda g: "x".join(map(str, g[0])))
def test_mask_mod_is_the_neighborhood(geom):
    spatial, kernel, stride, dilation, causal = geom
    w = wl.Workload("t", spatial, kernel, 1, 8, "test", stride=stride, dilation=dilation,
                    causal=causal)
    n = w.tokens
    i = torch.arange(n)[:, None]
    j = torch.arange(n)[None, :]
    got = models._mask_mod(w)(0, 0, i, j)
    want = peers.dense_mask(peers.Geometry.of(w))
    assert torch.equal(got.expand(n, n), want)
