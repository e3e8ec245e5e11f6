"""What the side-effect check of torch_opaque/_impl/side_effects.py sees in a
forward (Note [Forward side effects]); what torch.compile then does is in
tests/hooks/test_compile_side_effects.py."""

import functools
import math
import types

import pytest
import torch

import torch_opaque
from torch_opaque._impl import function as _function
from torch_opaque._impl import side_effects

STATE = types.SimpleNamespace(calls=0)
CACHE = {}
LOG = []
SCALE = 2.0


def _fn(forward, setup_context=None):
    """The OpaqueFunction of a fresh Function class with this forward."""
    body = {"forward": staticmethod(forward), "backward": staticmethod(lambda ctx, *g: g)}
    if setup_context is not None:
        body["setup_context"] = staticmethod(setup_context)
    cls = torch_opaque.wrap(type("F", (torch.autograd.Function,), body))
    return _function.lookup(cls)


def _global_item(ctx, x):
    CACHE["last"] = x
    return x * 2


def _global_attr_augmented(ctx, x):
    STATE.calls += 1
    return x * 2


def _global_rebound(ctx, x):
    global SCALE
    SCALE = 3.0
    return x * 2


def _output_in_tuple(ctx, x):
    y = x * 2
    z = x * 3
    y.tag = "y"
    return y, z


def _in_comprehension(ctx, x):
    return sum([LOG.append(t) or t for t in (x, x)])


def _argument_tensor_attr(ctx, x):
    x.seen = True
    return x * 2


@pytest.mark.parametrize(
    "forward, effect",
    [
        (_global_item, "sets an item of the global 'CACHE'"),
        (_global_attr_augmented, "sets the attribute .calls of the global 'STATE'"),
        (_global_rebound, "assigns the global 'SCALE'"),
        (_output_in_tuple, "sets the Python attribute .tag on its output 'y'"),
        (_in_comprehension, "calls .append() on the global 'LOG'"),
        (_argument_tensor_attr, "sets the attribute .seen of its argument 'x'"),
    ],
)
def test_bytecode_shows(forward, effect):
    assert side_effects.static(_fn(forward)) == effect


def _clean(ctx, x, sizes):
    parts = []
    parts.append(torch.add(x, SCALE))  # a module function named like a set's .add
    seen = {}
    seen["x"] = x
    ctx.n = len(sizes)
    ctx.k = math.sqrt(SCALE)
    helper = lambda t: t * ctx.k  # noqa: E731  (a local captured: STORE_DEREF of a cell)
    ctx.save_for_backward(x)
    y = helper(sum(parts))
    y.add(1.0)  # a tensor's own .add
    out = y.reshape(sizes)
    out.requires_grad = False  # a Tensor property, no Python attribute
    return out


def test_bytecode_of_a_clean_forward_shows_nothing():
    fn = _fn(_clean)
    assert side_effects.static(fn) is None
    assert side_effects.on_arguments(fn, [torch.ones(2), [2]]) is None


def test_mutator_on_an_argument_counts_only_for_a_container():
    def forward(ctx, x, out):
        out.append(x)
        x.add(1)
        return x * 2

    fn = _fn(forward)
    assert side_effects.static(fn) is None
    assert side_effects.on_arguments(fn, [torch.ones(1), []]) == (
        "calls .append() on its argument 'out' (a list)"
    )
    assert side_effects.on_arguments(fn, [torch.ones(1), torch.ones(1)]) is None


def test_setup_context_counts_and_its_ctx_does_not():
    def forward(x):
        return x * 2

    def setup_context(ctx, inputs, output):
        ctx.n = 1
        output.source = inputs[0]

    fn = _fn(forward, setup_context)
    assert side_effects.static(fn) == "sets the attribute .source of its argument 'output'"


def test_a_decorated_forward_is_scanned_through_its_wrapper():
    def deco(f):
        @functools.wraps(f)
        def wrapper(*a):
            return f(*a)

        return wrapper

    fn = _fn(deco(_global_rebound))
    assert side_effects.static(fn) == "assigns the global 'SCALE'"


def test_class_counters_are_not_counted():
    """``Cls.calls += 1`` (instrumentation) is no side effect to this check."""

    class Counted(torch.autograd.Function):
        calls = 0

        @staticmethod
        def forward(ctx, x):
            Counted.calls += 1
            return x * 2

        @staticmethod
        def backward(ctx, g):
            return g * 2

    fn = _function.lookup(torch_opaque.wrap(Counted))
    assert side_effects.static(fn) is None
    Counted.apply(torch.ones(2))
    assert Counted.calls == 1 and fn.side_effects is None


# ---- the watch around an eager first call --------------------------------------------


def test_eager_first_call_sees_what_the_bytecode_cannot():
    def tag(t, v):
        setattr(t, "_unquantize", v)

    def forward(ctx, x):
        y = x.round()
        tag(y, x)
        return y

    fn = _fn(forward)
    assert side_effects.static(fn) is None
    y = fn.cls.apply(torch.tensor([0.4, 0.6]))
    assert y._unquantize is not None  # eager: as stock
    assert fn.side_effects == "sets a Python attribute on its output (._unquantize)"


def test_eager_first_call_sees_a_changed_global_through_an_alias():
    def forward(ctx, x):
        log = LOG
        log.append(x)
        return x * 2

    LOG.clear()
    fn = _fn(forward)
    fn.cls.apply(torch.ones(2))
    assert len(LOG) == 1
    assert fn.side_effects == "changes the global 'LOG' (a list)"


def test_eager_first_call_sees_an_attribute_on_an_argument_tensor():
    def forward(ctx, x):
        setattr(x, "seen", True)
        return x * 2

    fn = _fn(forward)
    x = torch.ones(2)
    fn.cls.apply(x)
    assert x.seen and fn.side_effects == "sets a Python attribute on its argument tensor 'x'"


def test_eager_first_call_of_a_clean_forward_sees_nothing():
    fn = _fn(_clean)
    fn.cls.apply(torch.ones(2, requires_grad=True), [2])
    assert fn.side_effects is None
