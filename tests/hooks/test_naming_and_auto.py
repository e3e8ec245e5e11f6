"""Op naming (stable, collision-free, idempotent) and the zero-code-change mode."""

import textwrap
import warnings

import pytest
import torch

import torch_opaque
from conftest import aten_calls, op_calls
from support.processes import run_python


_counter = iter(range(10**6))


def _make(name=None):
    class Twice(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, g):
            return g * 2

    Twice.__qualname__ = name or f"Twice{next(_counter)}"
    return Twice


def test_default_name_is_stable_across_processes():
    code = textwrap.dedent(
        """
        import torch, torch_opaque
        class Foo(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x): return x * 2
            @staticmethod
            def backward(ctx, g): return g * 2
        Foo.__module__ = "some.pkg.mod"
        torch_opaque.wrap(Foo)
        print(torch_opaque.lookup(Foo).name)
        """
    )
    names = {
        run_python(code, with_fixtures=False).stdout.strip()
        for _ in range(2)
    }
    assert len(names) == 1
    (name,) = names
    assert name.startswith("Foo_") and len(name) == len("Foo_") + 6


def test_same_class_name_in_two_modules_gets_two_ops():
    a, b = _make("Same"), _make("Same")
    a.__module__, b.__module__ = "pkg_a.ops", "pkg_b.ops"
    torch_opaque.wrap(a)
    torch_opaque.wrap(b)
    assert torch_opaque.lookup(a).name != torch_opaque.lookup(b).name
    x = torch.ones(2, requires_grad=True)
    a.apply(x).sum().backward()
    b.apply(x).sum().backward()
    torch.testing.assert_close(x.grad, torch.full((2,), 4.0))


def test_wrapping_twice_is_harmless_and_renaming_is_refused():
    cls = _make()
    assert torch_opaque.wrap(cls) is cls
    assert torch_opaque.wrap(cls) is cls
    assert torch_opaque.op(cls) is cls
    with pytest.raises(ValueError, match="is already wrapped as opaque::"):
        torch_opaque.wrap(cls, name="Other")


def test_explicit_name_collision_is_refused():
    # (the first class is kept alive: a collected class frees its name)
    first = torch_opaque.wrap(_make(), name="TakenName")
    with pytest.raises(ValueError, match="op name opaque::TakenName is already used by"):
        torch_opaque.wrap(_make(), name="TakenName")
    assert first.apply(torch.ones(1)).shape == (1,)


def test_custom_namespace():
    cls = _make()
    torch_opaque.op(name="Dbl", namespace="myproj")(cls)
    x = torch.randn(3)
    gm = torch.export.export(_Call(cls), (x,)).graph_module
    assert len(op_calls(gm, "Dbl", namespace="myproj")) == 1


def test_subclass_of_wrapped_class_is_not_routed_to_parent_op():
    parent = _make()
    torch_opaque.wrap(parent)

    class Child(parent):
        @staticmethod
        def forward(ctx, x):
            return x * 3

    x = torch.ones(2)
    torch.testing.assert_close(Child.apply(x), torch.full((2,), 3.0))


class _Call(torch.nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return self.fn.apply(x).cos()


class Cube(torch.autograd.Function):
    """Never wrapped explicitly: auto mode must pick it up."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x**3

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return 3 * x**2 * g


@pytest.mark.parametrize("strict", [False, True])
def test_torch_opaque_export_wraps_every_function(strict):
    Cube2 = type(f"Cube2_{strict}", (Cube,), {})
    x = torch.randn(4)
    plain = torch.export.export(_Call(Cube2), (x,), strict=strict)
    assert not torch_opaque.is_wrapped(Cube2)
    assert aten_calls(plain.graph_module, "pow")  # upstream inlines the forward
    ep = torch_opaque.export(_Call(Cube2), (x,), strict=strict)
    name = torch_opaque.lookup(Cube2).name
    assert len(op_calls(ep.graph_module, name)) == 1
    assert not aten_calls(ep.graph_module, "pow")
    torch.testing.assert_close(ep.module()(x), (x**3).cos())


def test_auto_context_in_eager_and_restores_apply():
    func = torch.autograd.Function.apply.__func__
    x = torch.randn(3, requires_grad=True)
    with torch_opaque.auto():
        y = Cube.apply(x)
    assert y.grad_fn.name().startswith("opaque::Cube_")
    assert torch_opaque.lookup(Cube) is not None and not torch_opaque.is_wrapped(Cube)
    # outside the block the class is an ordinary Function again; apply itself
    # was never replaced (Note [Apply interception])
    assert torch.autograd.Function.apply.__func__ is func
    assert Cube.apply(x).grad_fn.name() == "CubeBackward"


def test_auto_leaves_unwrappable_functions_alone_with_a_warning():
    class TakesDict(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, cfg):
            return x * cfg["k"]

        @staticmethod
        def backward(ctx, g):
            return g * 2, None

    with torch_opaque.auto(), warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        out = TakesDict.apply(torch.ones(2), {"k": 2})
    torch.testing.assert_close(out, torch.full((2,), 2.0))
    assert any(
        "stays an ordinary autograd.Function" in str(m.message) and "argument 'cfg'" in str(m.message)
        for m in w
    )


def test_opcheck_passes_on_wrapped_ops():
    cls = _make("OpcheckMe")
    torch_opaque.wrap(cls)
    cls.apply(torch.ones(2))
    ov = torch_opaque.lookup(cls).overloads["Tensor"]
    for args in [(torch.randn(3, requires_grad=True),), (torch.randn(2, 3),)]:
        torch.library.opcheck(ov.op, args)
