"""In-place Functions (ctx.mark_dirty, Note [In-place Functions] in
torch_opaque/_impl/in_place.py, Note [In-place ops] in csrc/in_place.cpp):
ops with a mutable schema (Tensor(a!)); eager semantics, gradients, export and
compile, each compared with the same Function unwrapped."""

import pytest
import torch

import torch_opaque
from torch_opaque.errors import UnsupportedError


class MulInPlace(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, k):
        ctx.k = k
        x.mul_(k)
        ctx.mark_dirty(x)
        return x

    @staticmethod
    def backward(ctx, g):
        return g * ctx.k, None


class ExpInPlace(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        x.exp_()
        ctx.mark_dirty(x)
        ctx.save_for_backward(x)
        return x

    @staticmethod
    def backward(ctx, g):
        (y,) = ctx.saved_tensors
        return g * y


class AddInPlaceWithAux(torch.autograd.Function):
    """Two outputs: the dirty first argument and a new tensor."""

    @staticmethod
    def forward(ctx, x, y):
        x.add_(y)
        ctx.mark_dirty(x)
        return x, y * 2

    @staticmethod
    def backward(ctx, gx, gaux):
        return gx, gx + 2 * gaux


def wrapped(cls):
    return torch_opaque.wrap(type(cls.__name__ + "Op", (cls,), {}), name=cls.__name__ + "Op")


OPS = {c: wrapped(c) for c in (MulInPlace, ExpInPlace, AddInPlaceWithAux)}
CASES = [
    (MulInPlace, lambda a: (a, 3.0)),
    (ExpInPlace, lambda a: (a,)),
    (AddInPlaceWithAux, lambda a: (a, torch.arange(4.0, requires_grad=True))),
]


def first(out):
    return out[0] if isinstance(out, tuple) else out


def run_eager(cls, make_args, seed=0):
    """(result values, version bump, is-the-input, grads of base and other leaves)."""
    torch.manual_seed(seed)
    base = torch.randn(4, requires_grad=True)
    a = base * 1  # a non-leaf that requires grad
    args = make_args(a)
    before = a._version
    out = cls.apply(*args)
    is_input = first(out) is a
    bumped = a._version > before
    outs = out if isinstance(out, tuple) else (out,)
    sum(o.sum() * (i + 1) for i, o in enumerate(outs)).backward()
    leaves = [base] + [t for t in args[1:] if isinstance(t, torch.Tensor)]
    return [o.detach() for o in outs], bumped, is_input, [t.grad for t in leaves]


@pytest.mark.parametrize("cls, make_args", CASES, ids=lambda c: getattr(c, "__name__", ""))
def test_eager_values_identity_version_and_grads_equal_stock(cls, make_args):
    ref = run_eager(cls, make_args)
    for _ in range(2):  # the first call (primed) and later ones
        got = run_eager(OPS[cls], make_args)
        torch.testing.assert_close(got[0], ref[0])
        assert got[1] and got[2] and ref[1] and ref[2]
        torch.testing.assert_close(got[3], ref[3])


def test_without_grad_the_input_is_modified_and_returned():
    for fn in (MulInPlace.apply, OPS[MulInPlace].apply):
        x = torch.ones(3)
        with torch.no_grad():
            y = fn(x, 2.0)
        assert y is x and torch.equal(x, torch.full((3,), 2.0))
        z = torch.ones(3)
        assert fn(z, 3.0) is z and torch.equal(z, torch.full((3,), 3.0))


def test_a_leaf_that_requires_grad_is_refused_as_in_stock():
    for fn in (MulInPlace.apply, OPS[MulInPlace].apply):
        with pytest.raises(RuntimeError, match="a leaf Variable that requires grad"):
            fn(torch.ones(3, requires_grad=True), 2.0)


@pytest.mark.parametrize("cls, make_args", CASES[:2], ids=lambda c: getattr(c, "__name__", ""))
def test_a_view_of_another_tensor_rebases_its_base_as_in_stock(cls, make_args):
    def run(fn):
        base = torch.linspace(-1, 1, 6, requires_grad=True)
        b = base * 1
        v = b[2:]
        y = fn(*make_args(v))
        assert y is v
        (b * torch.arange(6.0)).sum().backward()
        return b.detach(), base.grad

    ref = run(cls.apply)
    got = run(OPS[cls].apply)
    torch.testing.assert_close(got, ref)


def test_unsupported_in_place_forms_are_refused_clearly():
    class DirtyNonInput(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            y = x * 2
            ctx.mark_dirty(y)
            return y

        @staticmethod
        def backward(ctx, g):
            return 2 * g

    class DirtyNotReturned(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            x.mul_(2)
            ctx.mark_dirty(x)
            return x * 1

        @staticmethod
        def backward(ctx, g):
            return 2 * g

    class OtherArgModified(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, buf):
            x.mul_(2)
            buf.add_(1)
            ctx.mark_dirty(x)
            return x

        @staticmethod
        def backward(ctx, g):
            return 2 * g, None

    F = torch_opaque.wrap(DirtyNonInput, name="DirtyNonInput")
    with pytest.raises(UnsupportedError, match="torch_opaque: .*DirtyNonInput: ctx.mark_dirty"
                       r"\(\) was given a tensor that is not one of forward's tensor arguments"):
        F.apply(torch.ones(2))
    F = torch_opaque.wrap(DirtyNotReturned, name="DirtyNotReturned")
    with pytest.raises(UnsupportedError, match="marked argument 'x' dirty but does not return it"):
        F.apply(torch.ones(2))
    F = torch_opaque.wrap(OtherArgModified, name="OtherArgModified")
    with pytest.raises(UnsupportedError, match="forward modified its argument 'buf' in place"):
        F.apply(torch.ones(2), torch.zeros(2))


class ExpInPlaceSetup(torch.autograd.Function):
    """setup_context style, as NumpyExpMarkDirty in torch's own corpus."""

    @staticmethod
    def forward(x):
        x.exp_()
        return x

    @staticmethod
    def setup_context(ctx, inputs, output):
        (x,) = inputs
        ctx.mark_dirty(x)
        ctx.save_for_backward(output)

    @staticmethod
    def backward(ctx, g):
        (y,) = ctx.saved_tensors
        return g * y


OPS[ExpInPlaceSetup] = wrapped(ExpInPlaceSetup)


@pytest.mark.parametrize("compiled", [False, True])
def test_setup_context_style_works_as_stock(compiled):
    def run(fn):
        torch.manual_seed(0)
        base = torch.randn(4, requires_grad=True)
        a = base * 1
        before = a._version
        out = fn(a)
        assert out is a or compiled
        (a * torch.arange(4.0)).sum().backward()
        return a.detach(), a._version - before if not compiled else 0, base.grad

    ref = run(ExpInPlaceSetup.apply)
    op = OPS[ExpInPlaceSetup].apply
    got = run(torch.compile(lambda x: op(x), backend="aot_eager", fullgraph=True) if compiled else op)
    torch.testing.assert_close(got, ref)
    x = torch.zeros(2)
    assert torch.ops.opaque.ExpInPlaceSetupOp.Tensor(x) is None and torch.equal(x, torch.ones(2))


class Model(torch.nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x, w):
        h = x * w  # an intermediate modified in place
        y = self.fn(h, 3.0)
        z = ExpOp.apply(x)  # the input itself modified in place
        return y.sin() + h, z.cos()


ExpOp = OPS[ExpInPlace]


def op_of(fn_cls, *args):
    """The OpOverload a call of ``fn_cls.apply(*args)`` runs."""
    from torch_opaque._impl.function import lookup

    fn = lookup(fn_cls)
    fn_cls.apply(*args)
    (ov,) = fn.overloads.values()
    return ov.op


def test_the_op_has_a_mutable_schema_and_calling_it_modifies_the_argument():
    op = op_of(OPS[MulInPlace], torch.ones(2), 2.0)
    assert str(op._schema) == "opaque::MulInPlaceOp.Tensor_float(Tensor(a!) x, float k) -> ()"
    x = torch.ones(3)
    before = x._version
    assert op(x, 3.0) is None
    # as the stock Function bumps it: one write in forward, one for ctx.mark_dirty
    assert torch.equal(x, torch.full((3,), 3.0)) and x._version == before + 2
    aux = op_of(OPS[AddInPlaceWithAux], torch.ones(2), torch.ones(2))
    assert str(aux._schema).endswith("(Tensor(a!) x, Tensor y) -> Tensor")
    x, y = torch.zeros(3), torch.arange(3.0)
    torch.testing.assert_close(aux(x, y), y * 2)  # only the output that is not x
    torch.testing.assert_close(x, y)


def test_version_counter_and_grad_fn_as_in_stock():
    def run(fn):
        a = torch.randn(4, requires_grad=True) * 1
        before = a._version
        out = fn(a, 2.0)
        return out is a, a._version - before, a.requires_grad, a.is_leaf

    assert run(OPS[MulInPlace].apply) == run(MulInPlace.apply)
    with torch.no_grad():
        assert run(OPS[MulInPlace].apply) == run(MulInPlace.apply)
    b = torch.randn(3, requires_grad=True) * 1
    OPS[MulInPlace].apply(b, 2.0)
    assert b.grad_fn.name() == "opaque::MulInPlaceOpBackward"


def test_views_the_stock_function_refuses_are_refused_with_its_error():
    def run(fn):
        base = torch.randn(6, requires_grad=True) * 1
        with pytest.raises(RuntimeError, match="modifies inplace an input that is a view"):
            fn(base[2:], torch.ones(4))
        return base[2:]._version

    assert run(OPS[AddInPlaceWithAux].apply) == 0  # refused before the write
    run(AddInPlaceWithAux.apply)


def test_forward_mode_ad_of_an_in_place_op_is_refused_clearly():
    import torch.autograd.forward_ad as fwAD

    with fwAD.dual_level():
        x = fwAD.make_dual(torch.ones(3), torch.ones(3))
        with pytest.raises(NotImplementedError, match="torch_opaque: .*MulInPlaceOp.* modifies its "
                           "arguments in place .*forward-mode AD"):
            OPS[MulInPlace].apply(x, 2.0)


@pytest.mark.parametrize("strict", [False, True])
def test_export_keeps_one_node_and_functionalizes(strict):
    F = OPS[MulInPlace]
    ep = torch.export.export(Model(F.apply), (torch.randn(4), torch.randn(4)), strict=strict)
    targets = [n.target for n in ep.graph.nodes if n.op == "call_function"]
    name = torch.ops.opaque.MulInPlaceOp
    assert sum(1 for t in targets if getattr(t, "overloadpacket", None) is name) == 1
    assert sum(1 for t in targets if "ExpInPlaceOp" in str(t)) == 1
    x, w = torch.randn(4), torch.randn(4)
    x_ref = x.clone()
    ref = Model(MulInPlace.apply)(x_ref, w)
    got = ep.module()(x, w)
    torch.testing.assert_close(got, ref)
    torch.testing.assert_close(x, x_ref)  # the input mutation is kept
    # Functionalized: auto_functionalized_v2 of the op, x written back as an input mutation.
    core = ep.run_decompositions()
    hops = [n for n in core.graph.nodes if n.target is torch.ops.higher_order.auto_functionalized_v2]
    assert sorted(str(n.args[0]) for n in hops) == [
        "opaque.ExpInPlaceOp.Tensor", "opaque.MulInPlaceOp.Tensor_float"]
    assert list(core.graph_signature.user_inputs_to_mutate.values()) == ["x"]
    x = torch.randn(4)
    x_ref = x.clone()
    torch.testing.assert_close(core.module()(x, w), Model(MulInPlace.apply)(x_ref, w))
    torch.testing.assert_close(x, x_ref)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compile_values_and_grads_equal_stock(backend):
    def run(fn, exp, compiled):
        def step(x, w):
            h = x * w
            y = fn(h, 3.0)
            z = exp(x * 1)
            return (y.sin() + h).sum() + z.cos().sum()

        torch.manual_seed(0)
        x = torch.randn(5, requires_grad=True)
        w = torch.randn(5, requires_grad=True)
        f = torch.compile(step, backend=backend, fullgraph=True) if compiled else step
        loss = f(x, w)
        loss.backward()
        return loss.detach(), x.grad, w.grad

    ref = run(MulInPlace.apply, ExpInPlace.apply, False)
    got = run(OPS[MulInPlace].apply, ExpOp.apply, True)
    torch.testing.assert_close(got, ref)


MulOp = OPS[MulInPlace].apply


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compile_without_grad_functionalizes_the_mutable_op(backend):
    def f(x, mul, exp):
        h = x * 2
        return mul(h, 3.0) + 1, exp(x)

    x = torch.randn(5)
    x_ref = x.clone()
    ref = f(x_ref, MulInPlace.apply, ExpInPlace.apply)
    compiled = torch.compile(lambda x: f(x, MulOp, ExpOp.apply), backend=backend, fullgraph=True)
    got = compiled(x)
    torch.testing.assert_close(got, ref)
    torch.testing.assert_close(x, x_ref)  # the input was modified, as by the stock Function
