"""The symbolic-expression grammar (torch_opaque/archive/sym_expr.py): what
torch writes parses to the same sympy object sympy's own parser would give;
everything else is refused before sympy computes anything."""

import resource

import pytest
import sympy
import torch
from torch.utils._sympy import functions as F
from torch.utils._sympy.numbers import int_oo

from torch_opaque.archive.sym_expr import MAX_BITS, SymExprError, parse_sym_expr

s0 = sympy.Symbol("s0", integer=True, positive=True)
u1 = sympy.Symbol("u1", integer=True)
zf2 = sympy.Symbol("zf2", real=True)

# What torch builds for sizes, guards and ranges, printed as torch.export writes it (srepr).
EXPRESSIONS = [
    s0, 2 * s0, s0**2 + 3 * s0 * u1 - 7, F.FloorDiv(s0, 2), F.PythonMod(s0, 3), F.CleanDiv(s0, 2),
    F.ModularIndexing(s0, 2, 4), F.CeilDiv(s0, 8), sympy.Max(s0, 2), sympy.Min(s0, u1), sympy.Eq(s0, 3),
    sympy.Ne(s0, 1), s0 < 4, s0 >= 2, sympy.And(s0 > 2, s0 < 5), sympy.Or(sympy.Eq(u1, 0), s0 <= u1),
    sympy.Not(s0 > 2), sympy.Piecewise((s0, s0 > 2), (1, True)), F.ToFloat(s0), F.IntTrueDiv(s0, 2),
    F.FloatTrueDiv(zf2, 2.5), F.TruncToInt(zf2), sympy.Float(1.5), sympy.Rational(1, 2), sympy.Integer(-3),
    sympy.oo, -sympy.oo, int_oo, -int_oo, sympy.true, sympy.false, s0 / 3, 2**63 - 1 + s0,
    F.PowByNatural(s0, 3), F.Mod(s0, 4), F.Where(s0 > 1, s0, 1),
]  # fmt: skip


# the table torch's deserializer gives sympify (torch/_export/serde/serialize.py)
DESERIALIZER_LOCALS = {
    n: getattr(F, n)
    for n in (
        "FloorDiv ModularIndexing Where PythonMod Mod CleanDiv CeilToInt FloorToInt CeilDiv LShift RShift "
        "PowByNatural FloatPow FloatTrueDiv IntTrueDiv IsNonOverlappingAndDenseIndicator TruncToFloat "
        "TruncToInt RoundToInt RoundDecimal ToFloat Identity"
    ).split()
} | {"int_oo": int_oo}


@pytest.mark.parametrize("expr", EXPRESSIONS, ids=[sympy.srepr(e)[:50] for e in EXPRESSIONS])
def test_what_torch_writes_parses_to_what_sympy_gives(expr):
    text = sympy.srepr(expr)
    got = parse_sym_expr(text)
    # the reference: sympy's own parser, on text this test made (never on a file's)
    want = sympy.sympify(text, locals=DESERIALIZER_LOCALS)
    assert got == want == expr
    assert sympy.srepr(got) == text
    assert type(got) is type(expr)


def test_program_expressions_of_a_dynamic_export_parse():
    """Every expression of a real dynamic-shape export parses back to what torch built."""
    from torch._export.serde import serialize

    class M(torch.nn.Module):
        def forward(self, x, y):
            return torch.cat([x, y]).reshape(-1, 2)[: x.shape[0] // 2]

    d = torch.export.Dim("d", min=2)
    ep = torch.export.export(M(), (torch.randn(8, 2), torch.randn(6, 2)),
                             dynamic_shapes=({0: d * 2}, {0: torch.export.Dim.AUTO}))  # fmt: skip
    found = []

    def walk(o):
        if isinstance(o, dict):
            if isinstance(o.get("expr_str"), str):
                found.append(o["expr_str"])
            for v in o.values():
                walk(v)
        elif isinstance(o, list):
            for v in o:
                walk(v)

    import json

    walk(json.loads(serialize.serialize(ep).exported_program))
    assert found
    for text in found:
        assert sympy.srepr(parse_sym_expr(text)) == text


@pytest.mark.parametrize(
    "text, why",
    [
        ("S('__import__(\"os\").system(\"x\")')", "unknown name 'S' at offset 0"),
        ("Symbol('s0').__class__", "unexpected '.__class__'"),
        ("__import__('os')", "unknown name '__import__'"),
        ("Integer(1).__class__.__mro__", "unexpected '.__class__"),
        ("Symbol('a b')", "'a b' is not a size symbol name"),
        ('Symbol("s0")', "unexpected"),
        ("Symbol('__globals__')", "is not a size symbol name"),
        ("Symbol('s0', evaluate=True)", "unknown symbol assumption"),
        ("Symbol('s0', integer=1)", "must be True or False"),
        ("Function('f')(Symbol('s0'))", "unknown name 'Function'"),
        ("Lambda(Symbol('s0'), Integer(1))", "unknown name 'Lambda'"),
        ("s0*s1 + 3", "unexpected '*s1 + 3' at offset 2"),
        ("s0", "unknown name 's0'"),
        ("lambda: 1", "unexpected ': 1'"),
        ("[s0 for s0 in ()]", "unexpected '[s0"),
        ("Pow(Integer(9), Pow(Integer(9), Integer(9)))", "Pow with an exponent of 387420489"),
        ("PowByNatural(Symbol('s0'), Integer(1000000000))", "PowByNatural with an exponent of 1000000000"),
        ("LShift(Integer(1), Integer(100000000))", "LShift with an exponent"),
        ("Integer(" + "9" * 5000 + ")", "more than 40 digits"),
        ("Mul(" + ", ".join(["Integer(9999999999999999999)"] * 40) + ")", f"more than {MAX_BITS} bits"),
        ("Add(" * 200 + "Integer(1)" + ")" * 200, "nested more than 64 deep"),
        ("Float('nan')", "is not a decimal number"),
        ("Float('1.0', precision=100000)", "precision of 100000 bits"),
        ("Rational(1, 0)", "denominator 0"),
        ("Integer(1) Integer(2)", "unexpected text after the expression"),
        ("Integer(1)" + " " * 30_000, "longer than"),
        ("", "expected an expression"),
        ("-Integer(1)", "'-' stands only before oo or int_oo"),
    ],
)
def test_everything_else_is_refused(text, why):
    cpu = resource.getrusage(resource.RUSAGE_SELF).ru_utime
    with pytest.raises(SymExprError) as e:
        parse_sym_expr(text)
    assert why in str(e.value), str(e.value)
    # refused before computing: far below a second of CPU (9**9**9 alone takes minutes)
    assert resource.getrusage(resource.RUSAGE_SELF).ru_utime - cpu < 5


def test_non_text_is_refused():
    with pytest.raises(SymExprError, match="it is a int, not text"):
        parse_sym_expr(3)
