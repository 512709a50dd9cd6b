"""The fast path for warm calls (``natten_cupy._fast``) on the GPU.

Warm calls must compute bit for bit what the general path computes, for CuPy arrays and
torch tensors, through the array API and the torch layer, for aligned, misaligned and
strided inputs; a warm call adds no cache entry; an option of the wrong type is refused
even after a good call with the same value; and forward and backward of every layer can be
captured in a CUDA graph (CuPy's and torch's) and replayed.
"""

import numpy
import pytest

import natten_cupy
from natten_cupy import _fast

pytestmark = pytest.mark.gpu

torch = pytest.importorskip("torch")

CASES = [  # (rank, spatial, kernel, options)
    (1, (37,), 7, {"is_causal": True}),
    (1, (64,), 9, {"dilation": 2, "stride": 2}),
    (2, (13, 11), (5, 3), {"dilation": (1, 2), "is_causal": (False, True)}),
    (2, (16, 16), 4, {}),
    (3, (5, 7, 6), (3, 3, 4), {"stride": (1, 2, 1), "is_causal": (True, False, False)}),
]
DTYPES = ["float16", "bfloat16", "float32", "tf32"]


def _call(rank):
    return getattr(natten_cupy, f"na{rank}d"), getattr(natten_cupy, f"na{rank}d_backward")


def _cupy_inputs(rng, spatial, dtype, heads=2, dim=32, layout="contiguous"):
    import cupy
    np_dtype = "float32" if dtype == "tf32" else dtype
    shape = (2, *spatial, heads, dim)
    xs = []
    for _ in range(4):
        host = rng.standard_normal(shape).astype(numpy.float32)
        x = cupy.asarray(host).astype(np_dtype)
        if layout == "strided":   # heads before the spatial axes in memory
            perm = (0, len(shape) - 2) + tuple(range(1, len(shape) - 2)) + (len(shape) - 1,)
            x = cupy.ascontiguousarray(x.transpose(perm)).transpose(numpy.argsort(perm))
        elif layout == "misaligned":  # contiguous, first element 2 bytes past 16
            buf = cupy.empty(x.size + 8, dtype=x.dtype)
            x = buf[1:1 + x.size].reshape(shape)
            x[...] = cupy.asarray(host).astype(np_dtype)
        xs.append(x)
    return xs


def _general(monkeypatch):
    monkeypatch.setattr(_fast, "enabled", False)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}d-{c[1]}")
@pytest.mark.parametrize("layout", ["contiguous", "strided", "misaligned"])
def test_cupy_fast_equals_general(rng, monkeypatch, case, dtype, layout):
    import cupy
    rank, spatial, kernel, opts = case
    opts = dict(opts, allow_tf32=dtype == "tf32")
    fwd, bwd = _call(rank)
    q, k, v, d_out = _cupy_inputs(rng, spatial, dtype, layout=layout)
    _fast.clear()
    got = []
    for _ in range(2):  # first call builds the entry, second is warm
        out, lse = fwd(q, k, v, kernel, return_lse=True, **opts)
        grads = bwd(d_out, q, k, v, out, lse, kernel, **opts)
        got.append((out, lse, *grads))
    assert _fast.entries() == 2, "one entry for the forward and one for the backward"
    # without return_lse: an entry of its own whose lse is a workspace, the same output
    alone = [fwd(q, k, v, kernel, **opts) for _ in range(2)]
    assert _fast.entries() == 3
    with monkeypatch.context() as m:
        _general(m)
        out, lse = fwd(q, k, v, kernel, return_lse=True, **opts)
        want = (out, lse, *bwd(d_out, q, k, v, out, lse, kernel, **opts))
    got += [(o,) for o in alone]
    for run in got:
        for g, w in zip(run, want):
            assert isinstance(g, cupy.ndarray) and g.shape == w.shape and g.dtype == w.dtype
            assert not bool(cupy.isnan(g.astype(numpy.float32)).any())
            assert bool((g.view(f"u{g.dtype.itemsize}") == w.view(f"u{w.dtype.itemsize}")).all())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_torch_tensors_through_array_api(rng, monkeypatch, dtype):
    q, k, v, d_out = (torch.randn(2, 19, 21, 4, 32, device="cuda", dtype=dtype)
                      for _ in range(4))
    _fast.clear()
    runs = []
    for _ in range(2):
        out, lse = natten_cupy.na2d(q, k, v, 5, return_lse=True, dilation=(2, 1))
        runs.append((out, lse, *natten_cupy.na2d_backward(d_out, q, k, v, out, lse, 5,
                                                          dilation=(2, 1))))
    assert _fast.entries() == 2
    with monkeypatch.context() as m:
        _general(m)
        out, lse = natten_cupy.na2d(q, k, v, 5, return_lse=True, dilation=(2, 1))
        want = (out, lse, *natten_cupy.na2d_backward(d_out, q, k, v, out, lse, 5,
                                                     dilation=(2, 1)))
    for run in runs:
        for g, w in zip(run, want):
            assert isinstance(g, torch.Tensor) and g.device == q.device
            assert torch.equal(g, w)


def test_wrong_option_type_after_a_good_call(rng):
    q, k, v, _ = _cupy_inputs(rng, (20,), "float16")
    natten_cupy.na1d(q, k, v, 5, is_causal=True)
    natten_cupy.na1d(q, k, v, 5, is_causal=True)
    with pytest.raises(TypeError, match="is_causal"):
        natten_cupy.na1d(q, k, v, 5, is_causal=1)
    with pytest.raises(TypeError, match="kernel_size"):
        natten_cupy.na1d(q, k, v, (True,))


def test_profiler_sees_warm_calls(rng):
    q, k, v, _ = _cupy_inputs(rng, (40,), "float16")
    natten_cupy.na1d(q, k, v, 7)
    natten_cupy.na1d(q, k, v, 7)
    with natten_cupy.profile() as prof:
        natten_cupy.na1d(q, k, v, 7)
    assert [r["name"] for r in prof.records] == ["na_fwd_fused"]


def test_explicit_device_context(rng):
    """Calls inside a device context launch as outside it (the arrays' device)."""
    import cupy
    q, k, v, _ = _cupy_inputs(rng, (33,), "float16")
    want = natten_cupy.na1d(q, k, v, 5)
    with cupy.cuda.Device(0):
        got = natten_cupy.na1d(q, k, v, 5)
    assert bool((got == want).all())


# ---- the torch layer ---------------------------------------------------------------------

def _layer_grads(fn, q, k, v, d_out):
    qs = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    out = fn(*qs)
    out.backward(d_out)
    return (out.detach(), *[x.grad for x in qs])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}d-{c[1]}")
def test_torch_layer_eager_equals_custom_op(rng, case, dtype):
    from natten_cupy import torch as nt
    rank, spatial, kernel, opts = case
    q, k, v, d_out = (torch.randn(2, *spatial, 2, 16, device="cuda", dtype=dtype)
                      for _ in range(4))
    fn = getattr(nt, f"na{rank}d")
    _fast.clear()
    eager = [_layer_grads(lambda q, k, v: fn(q, k, v, kernel, **opts), q, k, v, d_out)
             for _ in range(2)]
    # one lambda code object serves every parametrization: without a reset dynamo hits its
    # recompile limit after 8 of them (fullgraph=True then fails instead of running eager)
    torch._dynamo.reset()
    compiled = torch.compile(lambda q, k, v: fn(q, k, v, kernel, **opts), fullgraph=True)
    want = _layer_grads(compiled, q, k, v, d_out)
    for run in eager:
        for g, w in zip(run, want):
            assert torch.equal(g, w)
    # expanded d_out (stride 0, as from out.sum()) is copied, not misread
    g_sum = _layer_grads(lambda q, k, v: fn(q, k, v, kernel, **opts), q, k, v,
                         torch.ones((), device="cuda", dtype=dtype).expand_as(q))
    g_ref = _layer_grads(lambda q, k, v: fn(q, k, v, kernel, **opts), q, k, v,
                         torch.ones_like(q))
    for g, w in zip(g_sum, g_ref):
        assert torch.equal(g, w)


def test_torch_layer_save_on_cpu(rng):
    from natten_cupy import torch as nt
    q, k, v, d_out = (torch.randn(1, 30, 3, 32, device="cuda", dtype=torch.float16)
                      for _ in range(4))
    want = _layer_grads(lambda q, k, v: nt.na1d(q, k, v, 7), q, k, v, d_out)
    with torch.autograd.graph.save_on_cpu():
        got = _layer_grads(lambda q, k, v: nt.na1d(q, k, v, 7), q, k, v, d_out)
    for g, w in zip(got, want):
        assert torch.equal(g, w)


def _saved_pointers_moved(grad_fn):
    """Re-save every tensor grad_fn saved so that it comes back at another address and with
    other strides (heads before tokens in memory), same values."""
    def unpack(x):
        perm = (0, x.dim() - 2, *range(1, x.dim() - 2), x.dim() - 1)
        return x.permute(perm).contiguous().permute(tuple(numpy.argsort(perm)))
    for saved in grad_fn._raw_saved_tensors:
        saved.register_hooks(lambda x: x, unpack)


def test_torch_backward_found_from_its_forward(rng):
    """The eager backward finds its warm entry from the forward's (d_out's signature alone)
    and computes what the full lookup computes; a d_out of other strides gets its own
    entry; tensors a hook moved take the full lookup; calls without grad skip autograd."""
    from natten_cupy import torch as nt
    q, k, v, d_out = (torch.randn(2, 9, 10, 3, 32, device="cuda", dtype=torch.float16)
                      for _ in range(4))
    fn = lambda q, k, v: nt.na2d(q, k, v, (3, 5), dilation=(2, 1))   # noqa: E731
    _fast.clear()
    want = _layer_grads(fn, q, k, v, d_out)
    n = _fast.entries()
    assert n > 0
    qs = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    out = fn(*qs)
    first = out.grad_fn.served[0]
    assert len(first.after) == 1   # found there, by the first call's backward
    out.backward(d_out)
    assert _fast.entries() == n and len(first.after) == 1
    for g, w in zip((out.detach(), *[x.grad for x in qs]), want):
        assert torch.equal(g, w)
    # d_out with heads before tokens in memory: another signature, the same gradients
    d_perm = d_out.permute(0, 3, 1, 2, 4).contiguous().permute(0, 2, 3, 1, 4)
    got = _layer_grads(fn, q, k, v, d_perm)
    assert len(first.after) == 2
    for g, w in zip(got, want):
        assert torch.equal(g, w)
    # saved tensors moved by a per-tensor hook: the full lookup, the same gradients
    qs = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    out = fn(*qs)
    _saved_pointers_moved(out.grad_fn)
    out.backward(d_out)
    for g, w in zip((out.detach(), *[x.grad for x in qs]), want):
        assert torch.equal(g, w)
    # without grad (inputs that need none, or no_grad): no graph, the same output
    plain = fn(q, k, v)
    assert plain.grad_fn is None and torch.equal(plain, want[0])
    with torch.no_grad():
        plain = fn(*[x.detach().requires_grad_() for x in (q, k, v)])
    assert plain.grad_fn is None and torch.equal(plain, want[0])


def _warm(fn, steps=3):
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(steps):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()


@pytest.mark.parametrize("rel_pos_bias", [False, True])
def test_training_step_in_a_torch_cuda_graph(rel_pos_bias):
    """A NeighborhoodAttention2D training step (forward, backward, optimizer) captured in a
    CUDA graph and replayed gives the gradients and parameters of eager steps (with a
    relative positional bias: the ext ops' warm calls)."""
    from natten_cupy.torch import NeighborhoodAttention2D
    torch.manual_seed(0)
    model, twin = (NeighborhoodAttention2D(dim=64, num_heads=2, kernel_size=5, dilation=(1, 2),
                                           rel_pos_bias=rel_pos_bias).cuda() for _ in range(2))
    twin.load_state_dict(model.state_dict())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    opt_twin = torch.optim.SGD(twin.parameters(), lr=0.1)
    x = torch.randn(2, 24, 20, 64, device="cuda")

    def step(m, o, inp):
        o.zero_grad(set_to_none=False)
        with torch.autocast("cuda", dtype=torch.float16, cache_enabled=False):
            loss = m(inp).float().square().mean()
        loss.backward()
        o.step()
        return loss

    _warm(lambda: step(model, opt, x))
    _warm(lambda: step(twin, opt_twin, x))
    static_x = x.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_loss = step(model, opt, static_x)
    for i in range(3):
        x_i = torch.randn_like(x)
        static_x.copy_(x_i)
        graph.replay()
        loss = step(twin, opt_twin, x_i)
        torch.cuda.synchronize()
        torch.testing.assert_close(static_loss, loss, rtol=0, atol=0)
        for p, w in zip(model.parameters(), twin.parameters()):
            torch.testing.assert_close(p.grad, w.grad, rtol=0, atol=0)
            torch.testing.assert_close(p, w, rtol=0, atol=0)


def test_array_api_with_torch_tensors_in_a_torch_cuda_graph():
    q, k, v, d_out = (torch.randn(1, 40, 4, 64, device="cuda", dtype=torch.bfloat16)
                      for _ in range(4))

    def run():
        out, lse = natten_cupy.na1d(q, k, v, 9, is_causal=True, return_lse=True)
        return (out, *natten_cupy.na1d_backward(d_out, q, k, v, out, lse, 9, is_causal=True))

    _warm(run)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = run()
    for x in (q, k, v, d_out):
        x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    for g, w in zip(static, run()):
        assert torch.equal(g, w)


def test_array_api_in_a_cupy_cuda_graph(rng):
    import cupy
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        q, k, v, d_out = _cupy_inputs(rng, (12, 17), "float16", dim=64)

        def run():
            out, lse = natten_cupy.na2d(q, k, v, (3, 5), return_lse=True, stride=(1, 2))
            return (out, *natten_cupy.na2d_backward(d_out, q, k, v, out, lse, (3, 5),
                                                    stride=(1, 2)))

        for _ in range(3):
            run()   # builds the entries and warms CuPy's memory pool
        stream.begin_capture()
        static = run()
        graph = stream.end_capture()
        for x in (q, k, v, d_out):
            x[...] = cupy.random.standard_normal(x.shape).astype(x.dtype)
        graph.launch(stream)
        want = run()
    stream.synchronize()
    for g, w in zip(static, want):
        assert bool((g == w).all())


def test_mixed_frameworks_take_the_general_path(rng):
    q, k, v, _ = _cupy_inputs(rng, (20,), "float16")
    want = natten_cupy.na1d(q, k, v, 5)
    got = natten_cupy.na1d(q, torch.from_dlpack(k), v, 5)
    assert bool((got == want).all())


# ---- unfused ops -------------------------------------------------------------------------

def _unfused_all(rank, q, k, v, d_out, rpb, kernel, opts):
    m = natten_cupy
    qk = getattr(m, f"na{rank}d_qk")(q, k, kernel, rpb=rpb, **opts)
    attn = m.softmax(qk, scale=0.25)
    out = getattr(m, f"na{rank}d_av")(attn, v, kernel, **opts)
    d_attn, dv = getattr(m, f"na{rank}d_av_backward")(d_out, attn, v, kernel, **opts)
    dq, dk = getattr(m, f"na{rank}d_qk_backward")(d_attn, q, k, kernel, **opts)
    return qk, out, d_attn, dv, dq, dk


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}d-{c[1]}")
@pytest.mark.parametrize("layout", ["contiguous", "strided"])
def test_cupy_unfused_fast_equals_general(rng, monkeypatch, case, dtype, layout):
    import cupy
    rank, spatial, kernel, opts = case
    opts = {n: v for n, v in opts.items() if n != "stride"}
    opts["allow_tf32"] = dtype == "tf32"
    q, k, v, d_out = _cupy_inputs(rng, spatial, dtype, layout=layout)
    _fast.clear()
    got = [_unfused_all(rank, q, k, v, d_out, None, kernel, opts) for _ in range(2)]
    assert _fast.entries() == 4, "qk, av, av_backward, qk_backward"
    with monkeypatch.context() as m:
        _general(m)
        want = _unfused_all(rank, q, k, v, d_out, None, kernel, opts)
    for run in got:
        for g, w in zip(run, want):
            assert isinstance(g, cupy.ndarray) and g.shape == w.shape and g.dtype == w.dtype
            assert bool((g.view(f"u{g.dtype.itemsize}") == w.view(f"u{w.dtype.itemsize}")).all())


def test_cupy_qk_with_rpb_fast_equals_general(rng, monkeypatch):
    import cupy
    q, k, _, _ = _cupy_inputs(rng, (11, 13), "float16")
    rpb = cupy.asarray(rng.standard_normal((2, 9, 5))).astype(cupy.float16)
    got = [natten_cupy.na2d_qk(q, k, (5, 3), rpb=rpb, dilation=(1, 2)) for _ in range(2)]
    with monkeypatch.context() as m:
        _general(m)
        want = natten_cupy.na2d_qk(q, k, (5, 3), rpb=rpb, dilation=(1, 2))
    for g in got:
        assert bool((g.view("u2") == want.view("u2")).all())


@pytest.mark.parametrize("with_rpb", [False, True])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_torch_unfused_eager_equals_compiled(rng, dtype, with_rpb):
    from natten_cupy import torch as nt
    q, k, v, d_out = (torch.randn(2, 13, 11, 2, 32, device="cuda", dtype=dtype)
                      for _ in range(4))
    rpb = torch.randn(2, 9, 5, device="cuda", dtype=dtype) if with_rpb else None
    opts = dict(dilation=(1, 2), is_causal=(True, False))

    def chain(q, k, v, rpb):
        attn = torch.softmax(nt.na2d_qk(q, k, (5, 3), rpb=rpb, **opts).float(), -1).to(dtype)
        return nt.na2d_av(attn, v, (5, 3), **opts)

    def grads(fn):
        leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
        r = None if rpb is None else rpb.detach().clone().requires_grad_()
        out = fn(*leaves, r)
        out.backward(d_out)
        return [out.detach()] + [x.grad for x in leaves] + ([] if r is None else [r.grad])

    _fast.clear()
    eager = [grads(chain) for _ in range(2)]
    assert _fast.entries() >= 2
    # aot_eager: the graph's torch ops (the softmax between qk and av) run as in eager, so
    # every natten_cupy output must match bit for bit; inductor fuses the softmax its own way.
    torch._dynamo.reset()   # chain's code object is shared by the parametrizations
    want = grads(torch.compile(chain, fullgraph=True, backend="aot_eager"))
    for run in eager:
        for i, (g, w) in enumerate(zip(run, want)):
            if i == 4:   # d_rpb: float32 atomics in any order
                torch.testing.assert_close(g, w)
            else:
                assert torch.equal(g, w)
    tol = dict(rtol=2e-2, atol=2e-2) if dtype != torch.float32 else {}
    for g, w in zip(eager[0], grads(torch.compile(chain, fullgraph=True))):
        torch.testing.assert_close(g, w, **tol)


# ---- lse gradients and extra tokens on the GPU --------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_torch_lse_and_extra_tokens_match_float64(dtype):
    """CUDA eager (fast path) and torch.compile, against the CPU float64 run of the same
    call: out, lse and the gradients of a loss that uses both and the extra tokens."""
    from natten_cupy import torch as nt
    gen = torch.Generator().manual_seed(3)
    host = [torch.randn(2, 12, 11, 2, 32, generator=gen, dtype=torch.float64)
            for _ in range(3)]
    extra = [torch.randn(2, 7, 2, 32, generator=gen, dtype=torch.float64) for _ in range(2)]
    opts = dict(dilation=(1, 2), is_causal=(True, False))

    def loss(q, k, v, ek, ev):
        out, lse = nt.na2d(q, k, v, 5, additional_keys=ek, additional_values=ev,
                           return_lse=True, **opts)
        return out.float().square().sum() + (lse.float() * 0.1).sum(), out, lse

    def run(fn, tensors):
        leaves = [t.detach().clone().requires_grad_() for t in tensors]
        total, out, lse = fn(*leaves)
        grads = torch.autograd.grad(total, leaves)
        return [out.detach().double().cpu(), lse.detach().double().cpu()] + \
            [g.double().cpu() for g in grads]

    want = run(loss, host + extra)
    cuda = [t.to("cuda", dtype) for t in host + extra]
    eager = run(loss, cuda)
    compiled = run(torch.compile(loss, fullgraph=True), cuda)
    tol = {torch.float16: 2e-2, torch.bfloat16: 1e-1, torch.float32: 2e-3}[dtype]
    for got in (eager, compiled):
        for g, w in zip(got, want):
            err = (g - w).abs().max() / w.abs().max()
            assert err < tol, (dtype, float(err))


# ---- a relative positional bias and additional tokens (the ext ops) ----------------------

EXT_CASES = [  # (rank, spatial, kernel, options, with rpb, tokens T, their heads H_x)
    (1, (37,), 7, {"is_causal": True}, True, 0, 0),
    (2, (13, 11), (5, 3), {"dilation": (1, 2)}, True, 0, 0),
    (3, (5, 7, 6), (3, 3, 3), {"is_causal": (True, False, False)}, True, 0, 0),
    (2, (12, 11), 5, {"is_causal": (True, False)}, False, 7, 2),
    (3, (5, 7, 6), (3, 3, 4), {"stride": (1, 2, 1)}, False, 5, 1),
    (2, (9, 10), 3, {}, True, 4, 2),     # both: tokens merged in array math (general path)
    (1, (20,), 5, {}, False, 0, 2),      # T = 0: the general path zeroes their gradients
]
SERVED = {0, 1, 2, 3, 4}   # EXT_CASES the warm calls run from one plan


def _ext_inputs(case, dtype, device="cuda", heads=2, dim=32):
    rank, spatial, kernel, opts, with_rpb, T, hx = case
    gen = torch.Generator().manual_seed(11)
    make = lambda *shape: torch.randn(shape, generator=gen).to(device, dtype)   # noqa: E731
    q, k, v, d_out = (make(2, *spatial, heads, dim) for _ in range(4))
    ks = (kernel,) * rank if isinstance(kernel, int) else kernel
    rpb = make(heads, *(2 * n - 1 for n in ks)) if with_rpb else None
    keys, values = (make(2, T, hx, dim), make(2, T, hx, dim)) if hx else (None, None)
    return q, k, v, d_out, rpb, keys, values


def _served_entries():
    return sum(e is not _fast._SLOW for e in _fast._entries.values())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("ci", range(len(EXT_CASES)))
def test_torch_layer_ext_eager_equals_custom_op(monkeypatch, ci, dtype):
    """Warm eager calls with a bias and/or tokens give what the ext ops give, bit for bit:
    out, lse and the gradients of q, k, v, rpb and the tokens (from out's gradient, and
    from lse's too, which takes the ops' backward)."""
    from natten_cupy import torch as nt
    case = EXT_CASES[ci]
    rank, _, kernel, opts = case[:4]
    if dtype == torch.float32:
        opts = dict(opts, allow_tf32=True)   # (exact float32 fused kernels take no bias)
    q, k, v, d_out, rpb, keys, values = _ext_inputs(case, dtype)
    fn = getattr(nt, f"na{rank}d")

    def run(with_lse):
        leaves = [None if x is None else x.detach().clone().requires_grad_()
                  for x in (q, k, v, rpb, keys, values)]
        out, lse = fn(*leaves[:3], kernel, rpb=leaves[3], additional_keys=leaves[4],
                      additional_values=leaves[5], return_lse=True, **opts)
        loss = (out * d_out).sum() + (lse.sum() * 0.5 if with_lse else 0)
        loss.backward()
        return [out.detach(), lse.detach()] + [x.grad for x in leaves if x is not None]

    for with_lse in (False, True):
        _fast.clear()
        runs = [run(with_lse) for _ in range(2)]
        entries = _fast.entries()
        runs.append(run(with_lse))
        assert _fast.entries() == entries, "a warm call adds no entry"
        assert _served_entries() == (2 if ci in SERVED else 0)   # forward and backward
        with monkeypatch.context() as m:
            _general(m)
            want = run(with_lse)
        for got in runs:
            assert len(got) == len(want)
            for g, w in zip(got, want):
                assert g is not None and g.dtype == w.dtype and g.shape == w.shape
                assert not torch.isnan(g).any()
                assert torch.equal(g, w)


@pytest.mark.parametrize("framework", ["cupy", "torch"])
@pytest.mark.parametrize("ci", range(len(EXT_CASES)))
def test_array_api_ext_fast_equals_general(monkeypatch, ci, framework):
    """The array API's warm calls with a bias and/or tokens (CuPy arrays and torch tensors,
    inputs misaligned by 2 bytes where given as CuPy: copied first) equal the general path."""
    import cupy
    case = EXT_CASES[ci]
    rank, _, kernel, opts = case[:4]
    tensors = _ext_inputs(case, torch.float16)
    if framework == "cupy":
        def misaligned(t):
            x = cupy.asarray(t)
            buf = cupy.empty(x.size + 8, dtype=x.dtype)
            y = buf[1:1 + x.size].reshape(x.shape)
            y[...] = x
            return y
        tensors = [None if t is None else (misaligned(t) if i in (1, 5) else cupy.asarray(t))
                   for i, t in enumerate(tensors)]
    q, k, v, d_out, rpb, keys, values = tensors
    fwd, bwd = _call(rank)
    kw = dict(rpb=rpb, additional_keys=keys, additional_values=values, **opts)

    def run():
        out, lse = fwd(q, k, v, kernel, return_lse=True, **kw)
        return (out, lse, *bwd(d_out, q, k, v, out, lse, kernel, **kw))

    _fast.clear()
    got = [run(), run()]
    assert _served_entries() == (2 if ci in SERVED else 0)
    with monkeypatch.context() as m:
        _general(m)
        want = run()
    bits = (lambda x: x.view(f"u{x.dtype.itemsize}")) if framework == "cupy" else \
        (lambda x: x.view(torch.int16) if x.element_size() == 2 else x.view(torch.int32))
    for g_run in got:
        assert len(g_run) == len(want)
        for g, w in zip(g_run, want):
            assert type(g) is type(w) and tuple(g.shape) == tuple(w.shape)
            assert bool((bits(g) == bits(w)).all())
