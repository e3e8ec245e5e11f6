"""``y.grad_fn`` of an op call shows the ctx as a stock Function's does (Note
[Backward node introspection] in csrc/autograd_kernel.h): saved_tensors, the
attributes forward set, needs_input_grad and _forward_cls, read-only."""

import enum

import numpy as np
import pytest
import torch

import torch_opaque


class Rounding(enum.Enum):
    NEAREST = "nearest"
    FLOOR = "floor"


class Quantize(torch.autograd.Function):
    """ctx holds what quantizers keep: an enum, a tuple, a numpy scalar, a tensor."""

    @staticmethod
    def forward(ctx, x, scale, bits: int = 8):
        ctx.mode = Rounding.NEAREST
        ctx.bounds = (-(2 ** (bits - 1)), 2 ** (bits - 1) - 1)
        ctx.step = np.float32(0.5)
        ctx.mask = x.abs() < 1
        ctx.save_for_backward(x, scale)
        return (x / scale).round().clamp(*ctx.bounds) * scale

    @staticmethod
    def backward(ctx, g):
        x, scale = ctx.saved_tensors
        return g * ctx.mask, None, None


def variants():
    wrapped = torch_opaque.wrap(type("Quantize", (Quantize,), {"__module__": "user_models"}))
    under_auto = type("Quantize", (Quantize,), {"__module__": "user_models"})
    return {"stock": (Quantize, False), "wrap": (wrapped, False), "auto": (under_auto, True)}


def node_of(cls, under_auto, x, scale):
    # (bits passed: stock's needs_input_grad has an entry per argument passed,
    # the op's one per schema argument, defaults included)
    if under_auto:
        with torch_opaque.auto():
            return cls.apply(x, scale, 8)
    return cls.apply(x, scale, 8)


@pytest.mark.parametrize("label", ["wrap", "auto"])
def test_grad_fn_shows_the_ctx_like_stock(label):
    views = {}
    for name, (cls, under_auto) in variants().items():
        if name not in ("stock", label):
            continue
        for step in range(2):  # the first eager call is special (Note [First call runs forward once])
            x = torch.tensor([0.3, -1.7, 2.2], requires_grad=True)
            scale = torch.tensor(0.5)
            y = node_of(cls, under_auto, x, scale)
            fn = y.grad_fn
            saved = fn.saved_tensors
            views[name] = dict(
                saved_is_inputs=(saved[0] is x, saved[1] is scale),
                mode=fn.mode,
                bounds=fn.bounds,
                step=(type(fn.step), float(fn.step)),
                mask=fn.mask.tolist(),
                needs=fn.needs_input_grad,
                cls_is=fn._forward_cls is cls,
            )
            assert fn.saved_tensors[0] is saved[0]  # a fresh tuple of the same tensors
    assert views[label] == views["stock"]
    assert views["stock"]["needs"] == (True, False, False)


@pytest.mark.parametrize("label", ["stock", "wrap"])
def test_after_backward_attributes_stay_and_saved_tensors_are_freed(label):
    cls, _ = variants()[label]
    for _ in range(2):
        x = torch.tensor([0.3, -1.7], requires_grad=True)
        y = cls.apply(x, torch.tensor(0.5))
        fn = y.grad_fn
        y.sum().backward()
        assert fn.mode is Rounding.NEAREST and fn.bounds == (-128, 127)
        with pytest.raises(RuntimeError, match="freed"):
            fn.saved_tensors


def test_a_missing_attribute_is_an_attribute_error():
    cls, _ = variants()["wrap"]
    for _ in range(2):
        y = cls.apply(torch.ones(2, requires_grad=True), torch.tensor(1.0))
        with pytest.raises(AttributeError, match="no attribute 'nope'"):
            y.grad_fn.nope
        assert not hasattr(y.grad_fn, "nope")
        assert getattr(y.grad_fn, "nope", 7) == 7


def test_the_view_is_read_only():
    """Changing the node's ctx would change what backward sees behind its back."""
    cls, _ = variants()["wrap"]
    y = cls.apply(torch.ones(2, requires_grad=True), torch.tensor(1.0))
    y = cls.apply(torch.ones(2, requires_grad=True), torch.tensor(1.0))
    with pytest.raises(AttributeError):
        y.grad_fn.mode = Rounding.FLOOR
    assert y.grad_fn.mode is Rounding.NEAREST


@pytest.mark.parametrize("label", ["stock", "wrap"])
def test_torch_node_api_still_works(label):
    """name(), next_functions, hooks: what torch gives every node."""
    cls, _ = variants()[label]
    x = torch.tensor([0.3, -1.7], requires_grad=True)
    y = cls.apply(x, torch.tensor(0.5))
    y = cls.apply(x, torch.tensor(0.5))
    fn = y.grad_fn
    assert fn.name().endswith("Backward")
    assert fn.next_functions[0][0].variable is x
    seen = []
    fn.register_hook(lambda grad_inputs, grad_outputs: seen.append(
        [None if g is None else g.tolist() for g in grad_inputs]))
    y.sum().backward()
    assert seen == [[[1.0, 0.0], None]]


def test_cpp_op_node(example_ops):
    """A C++ op's node: no Function class; needs_input_grad and saved tensors as recorded."""
    x = torch.randn(3, requires_grad=True)
    y = torch.ops.example.scaled_sin(x, 2.0)
    fn = y.grad_fn
    assert fn._forward_cls is None
    assert fn.needs_input_grad[0] is True
    assert all(t is None or isinstance(t, torch.Tensor) for t in fn.saved_tensors)


# ---- _raw_saved_tensors and register_hooks (Note [Raw saved tensors] in csrc/autograd_kernel.h) ----


class Square(torch.autograd.Function):
    """Saves its input and a tensor attribute (which stock does not list as saved)."""

    @staticmethod
    def forward(ctx, x, scale):
        ctx.save_for_backward(x)
        ctx.scale_t = scale * 1
        return x * x * scale

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return 2 * x * g * ctx.scale_t, None


def _square_variants():
    return {
        "stock": (Square, False),
        "wrap": (torch_opaque.wrap(type("Square", (Square,), {})), False),
        "auto": (type("Square", (Square,), {}), True),
    }


def _hooked_run(cls, under_auto):
    """What a user of saved-tensor hooks sees: the raw objects, the hooks'
    calls and the gradient the unpack hook's tensor gives, for two calls."""
    seen = []
    for step in range(2):  # the first eager call is special (Note [First call runs forward once])
        x = torch.tensor([0.5, -1.0, 2.0], requires_grad=True)
        if under_auto:
            with torch_opaque.auto():
                y = cls.apply(x, torch.tensor(3.0))
        else:
            y = cls.apply(x, torch.tensor(3.0))
        fn = y.grad_fn
        raw = fn._raw_saved_tensors
        seen.append([type(r) for r in raw])

        def pack(t):
            seen.append(("pack", t.tolist()))
            return t.detach().clone()

        def unpack(p):
            seen.append(("unpack", p.tolist()))
            return p * 2  # the backward sees the tensor the unpack hook gives

        raw[0].register_hooks(pack, unpack)
        with pytest.raises(RuntimeError, match="already been set"):
            raw[0].register_hooks(pack, unpack)
        seen.append(("saved", [t.tolist() for t in fn.saved_tensors]))
        y.sum().backward()
        seen.append(("grad", x.grad.tolist()))
        with pytest.raises(RuntimeError, match="freed"):
            fn._raw_saved_tensors
    return seen


@pytest.mark.parametrize("label", ["wrap", "auto"])
def test_raw_saved_tensors_take_hooks_like_stock(label):
    variants = _square_variants()
    expected = _hooked_run(*variants["stock"])
    assert expected[0] == [torch._C._autograd.SavedTensor]
    assert ("grad", [6.0, -12.0, 24.0]) in expected  # 2 * (2x) * 3, x = [0.5, -1, 2]
    assert _hooked_run(*variants[label]) == expected


def test_raw_saved_tensor_of_none_refuses_hooks_like_stock():
    class SavesNone(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(None, x)
            return x * 2

        @staticmethod
        def backward(ctx, g):
            return g * 2

    def message(cls):
        y = cls.apply(torch.ones(2, requires_grad=True))
        y = cls.apply(torch.ones(2, requires_grad=True))
        raw = y.grad_fn._raw_saved_tensors
        assert len(raw) == 2
        with pytest.raises(RuntimeError) as info:
            raw[0].register_hooks(lambda t: t, lambda t: t)
        return str(info.value).splitlines()[0]

    expected = message(SavesNone)
    assert message(torch_opaque.wrap(type("SavesNone", (SavesNone,), {}))) == expected
