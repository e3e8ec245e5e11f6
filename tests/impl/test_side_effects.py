"""What the side-effect check of torch_opaque/_impl/side_effects.py sees in a
forward (Note [Forward side effects]); what torch.compile then does is in
tests/hooks/test_compile_side_effects.py."""

import functools
import math
import types
import weakref

import pytest
import torch

import torch_opaque
from torch_opaque._impl import function as _function
from torch_opaque._impl import overload as _overload
from torch_opaque._impl import side_effect_scan, side_effects

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
    assert side_effect_scan.static(_fn(forward)) == effect


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
    assert side_effect_scan.static(fn) is None
    assert side_effect_scan.on_arguments(fn, [torch.ones(2), [2]]) is None


def test_mutator_on_an_argument_counts_only_for_a_container():
    def forward(ctx, x, out):
        out.append(x)
        x.add(1)
        return x * 2

    fn = _fn(forward)
    assert side_effect_scan.static(fn) is None
    assert side_effect_scan.on_arguments(fn, [torch.ones(1), []]) == (
        "calls .append() on its argument 'out' (a list)"
    )
    assert side_effect_scan.on_arguments(fn, [torch.ones(1), torch.ones(1)]) is None


def test_setup_context_counts_and_its_ctx_does_not():
    def forward(x):
        return x * 2

    def setup_context(ctx, inputs, output):
        ctx.n = 1
        output.source = inputs[0]

    fn = _fn(forward, setup_context)
    assert side_effect_scan.static(fn) == "sets the attribute .source of its argument 'output'"


def test_a_decorated_forward_is_scanned_through_its_wrapper():
    def deco(f):
        @functools.wraps(f)
        def wrapper(*a):
            return f(*a)

        return wrapper

    fn = _fn(deco(_global_rebound))
    assert side_effect_scan.static(fn) == "assigns the global 'SCALE'"


def test_class_counters_are_counted():
    """``Cls.calls += 1`` is state outside the call (Note [Every store form]):
    eager calls count as stock; the eager first call's watch sees it too."""

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
    assert side_effect_scan.static(fn) == "sets the class attribute .calls of the closure variable 'Counted'"
    Counted.apply(torch.ones(2))
    Counted.apply(torch.ones(2))
    assert Counted.calls == 2
    assert fn.side_effects == "sets a class attribute of the closure variable 'Counted'"


def _augmented_item(ctx, x):
    CACHE["n"] = CACHE.get("n", 0)
    CACHE["n"] += 1
    return x * 2


def _computed_key(ctx, x):
    CACHE[x.shape[0]] = x
    return x * 2


def _deleted_item(ctx, x):
    del CACHE["gone"]
    return x * 2


def _bump_state():
    STATE.calls += 1


def _through_a_helper(ctx, x):
    _bump_state()
    return x * 2


def _module_attribute(ctx, x):
    math.tau_seen = True
    return x * 2


def _reads_a_global_list(ctx, x):
    box = _BOXES
    return x * len(box)


_BOXES = [1]


@pytest.mark.parametrize(
    "forward, effect",
    [
        (_augmented_item, "sets an item of the global 'CACHE'"),
        (_computed_key, "sets an item of the global 'CACHE'"),
        (_deleted_item, "deletes an item of the global 'CACHE'"),
        (_through_a_helper, "calls _bump_state(), which sets the attribute .calls of the global 'STATE'"),
        (_module_attribute, "sets the module attribute .tau_seen of the global 'math'"),
        (_reads_a_global_list, None),  # read only
    ],
)
def test_bytecode_shows_every_store_form(forward, effect):
    assert side_effect_scan.static(_fn(forward)) == effect


def test_an_item_set_in_an_argument_counts_only_for_a_container():
    def forward(ctx, x, table):
        table["last"] = 1
        x[x < 0] = 0  # a tensor's own item
        return x * 2

    fn = _fn(forward)
    assert side_effect_scan.static(fn) is None
    assert side_effect_scan.on_arguments(fn, [torch.ones(1), {}]) == "sets an item of its argument 'table' (a dict)"
    assert side_effect_scan.on_arguments(fn, [torch.ones(1), torch.ones(1)]) is None


# ---- quiet runs put back what they changed (Note [Fake runs leave no trace]) ----------------


def test_a_quiet_run_puts_back_every_kind_of_state():
    class Counter:
        calls = 0

    arg_list, arg_obj = [1], types.SimpleNamespace(v=1)
    holder = {"n": 0}

    def forward(ctx, x, items, obj):
        nonlocal holder
        global SCALE
        CACHE["k"] = "v"
        LOG.append(x)
        STATE.calls += 1
        Counter.calls += 1
        SCALE = 5.0
        items.append(2)
        obj.v = 2
        holder = None
        return x

    CACHE.clear()
    LOG.clear()
    before = (dict(CACHE), list(LOG), STATE.calls, Counter.calls, SCALE)
    fn = _fn(forward)
    with side_effects.quiet(fn, [torch.ones(1), arg_list, arg_obj]) as watch:
        forward(None, torch.ones(1), arg_list, arg_obj)
    assert watch.effect is not None
    assert (dict(CACHE), list(LOG), STATE.calls, Counter.calls, SCALE) == before
    assert arg_list == [1] and arg_obj.v == 1 and holder == {"n": 0}


def test_an_inner_quiet_run_reports_to_the_outer_one():
    def forward(ctx, x):
        LOG.append(1)
        return x

    fn = _fn(forward)
    LOG.clear()
    with side_effects.quiet(fn, []) as outer:
        with side_effects.quiet(fn, []) as inner:
            forward(None, None)
        assert LOG == []
    assert inner.effect == outer.effect == "changes the global 'LOG' (a list)"


# ---- the watch around an eager first call --------------------------------------------


def test_eager_first_call_sees_what_the_bytecode_cannot():
    def tag(t, v):
        setattr(t, "_unquantize", v)

    def forward(ctx, x):
        y = x.round()
        tag(y, x)
        return y

    fn = _fn(forward)
    assert side_effect_scan.static(fn) is None
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


def test_torch_opaques_own_wrappers_are_not_watched_but_what_they_wrap_is():
    """auto()'s guarded backward holds the user's backward in a closure: its
    registries are torch_opaque's, never put back; the user's function is watched."""

    def user_backward(ctx, g):
        LOG.append(g)
        return g

    guarded = _overload._guard_backward(user_backward, weakref.ref(torch.autograd.Function))
    assert [f for f, _ in side_effects.functions_of(guarded)] == [user_backward]
