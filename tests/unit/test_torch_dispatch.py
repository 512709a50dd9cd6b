"""The registration of ``torch.ops.natten_cupy.*`` (``torch.library.Library`` kernels, not
``torch.library.custom_op``): what it must keep, on CPU tensors (the reference backend).

opcheck, fake tensors, autograd through the raw ops, the double-backward refusal,
``save_on_cpu``, and torch.compile (fullgraph, aot_eager and inductor) of forward + backward
and of a module's training step, equal to eager; and that a call does not go through
custom_op's Python wrappers (what made it slow: ``bench/probes/torch_dispatch.py``).
"""

import importlib
import sys

import numpy
import pytest

torch = pytest.importorskip("torch")

import natten_cupy.torch as nt  # noqa: E402
from natten_cupy import _torch_library  # noqa: E402

OPS = torch.ops.natten_cupy
LISTS = ([3, 3], [1, 1], [1, 1], [False, True])


def _t(rng, shape, requires_grad=False, dtype=torch.float64):
    return torch.from_numpy(rng.standard_normal(shape)).to(dtype).requires_grad_(requires_grad)


def _qkv(rng, requires_grad=True, spatial=(5, 7)):
    return tuple(_t(rng, (1, *spatial, 2, 3), requires_grad) for _ in range(3))


@pytest.fixture
def rng():
    return numpy.random.default_rng(7)


def test_schemas_and_tags_are_stable():
    want = {
        "na_fused_forward": "natten_cupy::na_fused_forward(Tensor q, Tensor k, Tensor v, "
                            "SymInt[] kernel_size, SymInt[] stride, SymInt[] dilation, "
                            "bool[] is_causal, float? scale, str backend, bool allow_tf32, "
                            "bool deterministic, bool lse_grad=False, str tile=\"\") "
                            "-> (Tensor, Tensor)",
        "na_qk_backward": "natten_cupy::na_qk_backward(Tensor d_attn, Tensor q, Tensor k, "
                          "bool with_rpb, SymInt[] kernel_size, SymInt[] dilation, "
                          "bool[] is_causal, str backend, bool allow_tf32) "
                          "-> (Tensor, Tensor, Tensor)",
    }
    for name, schema in want.items():
        assert str(getattr(OPS, name).default._schema) == schema
    for name in _torch_library._SCHEMAS:
        op = getattr(OPS, name).default
        assert torch.Tag.pt2_compliant_tag in op.tags
        assert torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), "Autograd"), name
        assert torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), "CPU"), name
        assert torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), "CUDA"), name


def _files_called(fn):
    """Source files of the Python functions that one call of ``fn`` enters."""
    seen = set()

    def prof(frame, event, arg):
        if event == "call":
            seen.add(frame.f_code.co_filename.replace("\\", "/"))
    sys.setprofile(prof)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return seen


def test_calls_skip_custom_op_wrappers(rng):
    q, k, v = _qkv(rng)
    d = torch.ones(1, 5, 7, 2, 3, dtype=torch.float64)

    def fwd_bwd():
        nt.na2d(q, k, v, 3).backward(d)
        a = torch.softmax(nt.na2d_qk(q, k, 3), -1)
        nt.na2d_av(a, v, 3).backward(d)
    fwd_bwd()
    files = _files_called(fwd_bwd)
    assert not [f for f in files if f.endswith(("torch/_library/autograd.py",
                                                "torch/_library/custom_ops.py"))]


def test_opcheck_every_op(rng):
    q, k, v = _qkv(rng)
    rpb = _t(rng, (2, 5, 5), True)
    attn = _t(rng, (1, 5, 7, 2, 9), True)
    out, lse = OPS.na_fused_forward(q, k, v, *LISTS, None, "auto", False, False)
    d = [t.detach() for t in (q, k, v, out, lse)]
    samples = [
        (OPS.na_fused_forward.default, (q, k, v, *LISTS, 0.5, "auto", False, False, True)),
        (OPS.na_fused_forward.default, (*d[:3], *LISTS, None, "auto", False, False)),
        (OPS.na_fused_backward.default, (d[3].clone(), *d, *LISTS, None, "auto", False, False)),
        (OPS.na_qk.default, (q, k, rpb, [3, 3], [1, 2], [False, True], "auto", False)),
        (OPS.na_qk_backward.default, (attn.detach(), d[0], d[1], False, [3, 3], [1, 1],
                                      [True, False], "auto", False)),
        (OPS.na_av.default, (attn, v, [3, 3], [1, 2], [False, False], "auto", False)),
    ]
    for op, args in samples:
        torch.library.opcheck(op, args)


def test_fake_tensors_give_shapes(rng):
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        q = torch.empty(2, 5, 7, 4, 8, dtype=torch.float16)
        out, lse = OPS.na_fused_forward(q, q, q, *LISTS, None, "auto", False, False)
        attn = OPS.na_qk(q, q, None, [3, 3], [1, 1], [False, False], "auto", False)
        dq, dk, d_rpb = OPS.na_qk_backward(attn, q, q, True, [3, 3], [1, 1], [False, False],
                                           "auto", False)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert lse.shape == q.shape[:-1] and lse.dtype == torch.float32
    assert attn.shape == (2, 5, 7, 4, 9)
    assert dq.shape == q.shape and d_rpb.shape == (4, 5, 5)


def test_raw_ops_are_differentiable(rng):
    q, k, v = _qkv(rng)
    torch.autograd.gradcheck(
        lambda q, k, v: OPS.na_fused_forward(q, k, v, *LISTS, 0.7, "auto", False, False, True),
        (q, k, v))
    rpb = _t(rng, (2, 5, 5), True)
    torch.autograd.gradcheck(
        lambda q, k, rpb: OPS.na_qk(q, k, rpb, [3, 3], [1, 2], [False, False], "auto", False),
        (q, k, rpb))   # (causal logits hold -inf, which finite differences cannot take)
    attn = _t(rng, (1, 5, 7, 2, 9), True)
    torch.autograd.gradcheck(
        lambda a, v: OPS.na_av(a, v, [3, 3], [1, 1], [False, True], "auto", False), (attn, v))
    # without lse_grad, lse is not differentiable
    _, lse = OPS.na_fused_forward(q, k, v, *LISTS, None, "auto", False, False)
    assert not lse.requires_grad


def test_no_grad_and_inputs_without_grad_build_no_graph(rng):
    q, k, v = _qkv(rng, requires_grad=False)
    out, lse = OPS.na_fused_forward(q, k, v, *LISTS, None, "auto", False, False)
    assert out.grad_fn is None and lse.grad_fn is None
    q.requires_grad_()
    with torch.no_grad():
        assert nt.na2d(q, k, v, 3).grad_fn is None


@pytest.mark.parametrize("call", ["fused", "fused-lse", "qk", "av"])
def test_double_backward_is_refused(rng, call):
    q, k, v = _qkv(rng)
    attn = _t(rng, (1, 5, 7, 2, 9), True)
    out = {"fused": lambda: nt.na2d(q, k, v, 3),
           "fused-lse": lambda: nt.na2d(q, k, v, 3, return_lse=True)[1],
           "qk": lambda: nt.na2d_qk(q, k, 3),
           "av": lambda: nt.na2d_av(attn, v, 3)}[call]()
    inputs = (attn, v) if call == "av" else (q, k)
    grads = torch.autograd.grad(out.square().sum(), inputs, create_graph=True)
    with pytest.raises(RuntimeError, match="double backward .* is not supported"):
        sum(g.sum() for g in grads).backward()


def test_save_on_cpu_every_op(rng):
    q, k, v = _qkv(rng)
    rpb = _t(rng, (2, 5, 5), True)

    def grads():
        out, lse = nt.na2d(q, k, v, 3, is_causal=(True, False), return_lse=True)
        attn = torch.softmax(nt.na2d_qk(q, k, 3, rpb=rpb), -1)
        y = out.square().sum() + lse.sum() + nt.na2d_av(attn, v, 3).square().sum()
        return torch.autograd.grad(y, (q, k, v, rpb))
    want = grads()
    packed = []

    def pack(t):
        packed.append(t)
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        torch.autograd.grad(nt.na2d(q, k, v, 3).sum(), q)
    assert len(packed) == 5   # q, k, v, out, lse
    with torch.autograd.graph.save_on_cpu(pin_memory=False):
        got = grads()
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=0)


def _compile_or_skip(fn, backend):
    if backend == "inductor":
        try:
            importlib.import_module("torch._inductor")
        except Exception as e:  # pragma: no cover - depends on the install
            pytest.skip(f"inductor unavailable: {e}")
    return torch.compile(fn, fullgraph=True, backend=backend)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_forward_backward_equals_eager(rng, backend):
    torch._dynamo.reset()

    def f(q, k, v, rpb):
        out, lse = nt.na2d(q, k, v, 3, dilation=(1, 2), return_lse=True)
        attn = torch.softmax(nt.na2d_qk(q, k, 3, rpb=rpb, is_causal=(True, False)), -1)
        return out + nt.na2d_av(attn, v, 3, is_causal=(True, False)), lse
    q, k, v = _qkv(rng)
    rpb = _t(rng, (2, 5, 5), True)
    compiled = _compile_or_skip(f, backend)
    for _ in range(2):   # the second call replays the compiled graph
        results = []
        for fn in (f, compiled):
            out, lse = fn(q, k, v, rpb)
            results.append((out, lse, torch.autograd.grad(out.square().sum() + lse.sum(),
                                                          (q, k, v, rpb))))
        (eo, el, eg), (co, cl, cg) = results
        torch.testing.assert_close(co, eo)
        torch.testing.assert_close(cl, el)
        for g, w in zip(cg, eg):
            torch.testing.assert_close(g, w)


def test_compiled_training_step_equals_eager(rng):
    """A module's forward, loss, backward and optimizer step in one fullgraph-compiled
    function (aot_eager: no C++ compiler needed), against the same step eager."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    eager = nt.NeighborhoodAttention2D(8, 2, 3, dilation=(1, 2)).double()
    comp = nt.NeighborhoodAttention2D(8, 2, 3, dilation=(1, 2)).double()
    comp.load_state_dict(eager.state_dict())
    opts = {m: torch.optim.SGD(m.parameters(), lr=0.1) for m in (eager, comp)}
    x = _t(rng, (2, 6, 7, 8))

    def step(mod, opt, x):
        loss = mod(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss
    compiled = torch.compile(step, backend="aot_eager")
    for _ in range(3):
        want = step(eager, opts[eager], x)
        got = compiled(comp, opts[comp], x)
        torch.testing.assert_close(got, want)
    for (n, p), w in zip(comp.named_parameters(), eager.parameters()):
        torch.testing.assert_close(p, w, msg=n)
    # the module's forward itself compiles whole
    fwd = torch.compile(comp, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(fwd(x), eager(x))
