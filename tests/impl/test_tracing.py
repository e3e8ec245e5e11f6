"""torch_opaque._impl.tracing: sizes for symbolic dimensions, real-shaped
stand-ins, and copies of outputs that alias inputs."""

import torch
from torch._dynamo.source import ConstantSource
from torch.fx.experimental.symbolic_shapes import ShapeEnv

from torch_opaque._impl.tracing import FALLBACK_SIZE_HINT, real_shaped, size_hint, unalias


def test_size_hint_of_ints_and_backed_symbols():
    env = ShapeEnv()
    s = env.create_symintnode(env.create_symbol(6, source=ConstantSource("s")), hint=6)
    assert size_hint(5) == 5
    assert size_hint(s) == 6
    assert size_hint(s * 2 + 1) == 13


def test_size_hint_of_an_unbacked_symbol_respects_its_range():
    env = ShapeEnv()
    u = env.create_unbacked_symint()
    assert size_hint(u) >= 2
    torch._check(u >= 9)
    assert size_hint(u) >= 9
    assert FALLBACK_SIZE_HINT not in (0, 1)


def test_real_shaped_replaces_symbols_everywhere():
    env = ShapeEnv()
    s = env.create_symintnode(env.create_symbol(3, source=ConstantSource("s")), hint=3)
    assert real_shaped(s) == 3 and type(real_shaped(s)) is int
    assert real_shaped(torch.Size([2])) == torch.Size([2])
    assert real_shaped([1, (s, 2)]) == [1, (3, 2)]
    t = real_shaped(torch.empty(4, 2).t())
    assert t.shape == (2, 4) and t.stride() == (1, 2)
    assert real_shaped("x") == "x"


def test_unalias_copies_outputs_sharing_storage_with_inputs_or_earlier_outputs():
    x = torch.randn(4, 3)
    a, b, c, d = x[:2], x.exp(), x, None
    e = b.view(-1)
    outs = unalias((a, b, c, d, e), [x])
    assert outs[1] is b and outs[3] is None
    for k in (0, 2, 4):
        assert not torch._C._is_alias_of(outs[k], x) and not torch._C._is_alias_of(outs[k], b)
    torch.testing.assert_close(outs[0], a)
    torch.testing.assert_close(outs[4], e)
    same = (x.exp(),)
    assert unalias(same, [x])[0] is same[0]
