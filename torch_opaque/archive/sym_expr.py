"""Symbolic size expressions read from a file: a closed grammar of our own,
parsed into sympy objects without sympy's parser.

torch.export writes each symbolic size as ``sympy.srepr`` text
(``Mul(Integer(2), Symbol('s0', integer=True, positive=True))``) and its
deserializer hands that text to ``sympy.sympify``, which evaluates Python.
torch_opaque never gives a string from a file to sympy: :func:`parse_sym_expr`
reads the srepr grammar itself and builds the expression by calling the
constructors of a fixed table, so the deserializer receives finished sympy
objects (Note [Expressions are parsed, never evaluated]).

Example::

    >>> from torch_opaque.archive.sym_expr import parse_sym_expr, SymExprError
    >>> parse_sym_expr("Mul(Integer(2), Symbol('s0', integer=True, positive=True))")
    2*s0
    >>> try:
    ...     parse_sym_expr("S('__import__(1)')")
    ... except SymExprError as e:
    ...     print(e)
    unknown name 'S' at offset 0

Note [Expressions are parsed, never evaluated]
The grammar (what ``srepr`` prints for the expressions torch builds)::

    expr    := call | constant | '-' constant
    call    := FUNC '(' [arg (',' arg)*] ')'
    arg     := expr | INT | STRING | KEYWORD '=' (True | False | INT)
    constant:= oo | zoo | nan | true | false | int_oo | E | pi

FUNC is one of the names of ``_FUNCTIONS`` (sympy's arithmetic, relations and
logic, torch.utils._sympy.functions); ``Symbol`` takes a size-symbol name
(``s0``, ``u3``, ``zuf1``) and assumption keywords; ``Integer``, ``Rational``
and ``Float`` take literals. Anything else is a :class:`SymExprError` naming the
offset. Bounds keep a small file from costing much: the text is at most
``MAX_LENGTH`` characters, nesting at most ``MAX_DEPTH`` calls deep, integer
literals at most ``MAX_DIGITS`` digits, every integer the expression evaluates
to at most ``MAX_BITS`` bits, and a power or shift whose exponent is a number
(``Pow(Integer(9), Integer(387420489))``) takes exponents of at most
``MAX_EXPONENT`` only, before sympy computes anything.

Note [Symbolic work]
Bounded text is not bounded CPU: sympy compares the arguments of ``Max``,
``Min`` and the logic calls pairwise, with assumption queries, so one ``Max`` of
120 symbols costs about 28 CPU-s. Before such a call is built, its arguments
are counted against ``ArchiveLimits.sym_args`` (16: a ``Max`` of 16 sums of
symbols costs about 0.3 CPU-s), the distinct symbols of the expression against
``sym_symbols`` (32), and the pairs a pairwise call compares (n * (n - 1) / 2)
are charged to a :class:`SymBudget` of ``sym_work`` pairs (1024, about 2.3 ms
of CPU each at worst with 16 arguments, so about 2.5 CPU-s) shared by every
expression of one program. torch writes ``Max``/``Min`` of two or three arguments (a few pairs
per expression), so real programs stay far below these.
"""

from __future__ import annotations

import re
from typing import Callable, Optional

# sympy is imported on first use: `import torch_opaque` must not load it (0.25 s).

MAX_LENGTH = 20_000
MAX_DEPTH = 64
MAX_DIGITS = 40
MAX_BITS = 512
MAX_EXPONENT = 64


class SymExprError(ValueError):
    """Text that is not a symbolic size expression of the grammar."""


# calls whose arguments sympy compares pairwise (Note [Symbolic work])
_PAIRWISE = frozenset({"Max", "Min", "And", "Or", "Xor", "Piecewise"})


class SymBudget:
    """The bounds of Note [Symbolic work], and the pairwise comparisons charged
    so far (one budget per program)."""

    def __init__(self, args: int = 16, symbols: int = 32, work: int = 1024):
        self.args, self.symbols, self.work = args, symbols, work
        self.used = 0

    @classmethod
    def of(cls, limits) -> "SymBudget":
        return cls(limits.sym_args, limits.sym_symbols, limits.sym_work)

    def charge(self, name: str, n: int, parser: "_Parser", at: int) -> None:
        if name not in _PAIRWISE:
            return  # (Add, Mul, ...: linear, bounded by the text's length)
        if n > self.args:
            parser.fail(
                f"{name} of {n} arguments (at most {self.args}: raise "
                f"ArchiveLimits(sym_args=...) if you trust the file)", at
            )
        if n > 1:
            self.used += n * (n - 1) // 2
            if self.used > self.work:
                parser.fail(
                    f"the program's symbolic expressions compare more than {self.work} pairs of "
                    f"arguments (raise ArchiveLimits(sym_work=...) if you trust the file)", at
                )


_TOKEN = re.compile(
    r"\s*(?:(?P<name>[A-Za-z_][A-Za-z0-9_]*)|(?P<int>[0-9]+)|(?P<str>'[^'\\]{0,80}')|(?P<punct>[-(),=]))"
)
SYMBOL_RE = re.compile(r"^[a-z]{1,8}[0-9]{1,9}$")  # s0, u3, zuf0, ps1
_FLOAT_RE = re.compile(r"^-?([0-9]{1,40}(\.[0-9]{0,40})?|\.[0-9]{1,40})([eE][-+]?[0-9]{1,4})?$")
_ASSUMPTIONS = frozenset(
    "positive negative nonnegative nonpositive integer real finite infinite commutative nonzero "
    "zero even odd rational extended_real extended_positive extended_negative extended_nonnegative "
    "extended_nonpositive extended_nonzero".split()
)


def _torch_functions() -> dict:
    from torch.utils._sympy import functions as f

    names = (
        "FloorDiv ModularIndexing Where PythonMod Mod CleanDiv CeilToInt FloorToInt CeilDiv "
        "LShift RShift PowByNatural FloatPow FloatTrueDiv IntTrueDiv "
        "IsNonOverlappingAndDenseIndicator TruncToFloat TruncToInt RoundToInt RoundDecimal "
        "ToFloat Identity"
    ).split()
    return {n: getattr(f, n) for n in names if hasattr(f, n)}


def _constants() -> dict:
    import sympy
    from torch.utils._sympy.numbers import int_oo

    return {
        "oo": sympy.oo, "zoo": sympy.zoo, "nan": sympy.nan, "true": sympy.true,
        "false": sympy.false, "int_oo": int_oo, "E": sympy.E, "pi": sympy.pi,
    }  # fmt: skip


# Their second argument is an exponent or a shift: bounded when it is a number.
_POWERS = frozenset({"Pow", "PowByNatural", "FloatPow", "LShift"})

_tables: Optional[tuple] = None


def _sympy_functions() -> dict:
    import sympy

    return {
        "Add": sympy.Add, "Mul": sympy.Mul, "Pow": sympy.Pow, "Abs": sympy.Abs, "Max": sympy.Max,
        "Min": sympy.Min, "floor": sympy.floor, "ceiling": sympy.ceiling, "Equality": sympy.Eq,
        "Unequality": sympy.Ne, "StrictLessThan": sympy.StrictLessThan, "LessThan": sympy.LessThan,
        "StrictGreaterThan": sympy.StrictGreaterThan, "GreaterThan": sympy.GreaterThan,
        "And": sympy.And, "Or": sympy.Or, "Not": sympy.Not, "Xor": sympy.Xor,
        "Piecewise": sympy.Piecewise, "ExprCondPair": sympy.functions.elementary.piecewise.ExprCondPair,
    }  # fmt: skip


def _table() -> tuple:
    global _tables
    if _tables is None:
        _tables = ({**_sympy_functions(), **_torch_functions()}, _constants())
    return _tables


class _Parser:
    def __init__(self, text: str, budget: Optional[SymBudget] = None):
        self.text = text
        self.budget = budget or SymBudget()
        self.symbols: set = set()
        self.pos = 0
        self.tok: Optional[tuple] = None
        self.advance()

    def fail(self, why: str, at: Optional[int] = None):
        raise SymExprError(f"{why} at offset {self.start if at is None else at}")

    def advance(self) -> None:
        self.start = self.pos
        if self.pos >= len(self.text) or not self.text[self.pos :].strip():
            self.tok = None
            self.pos = len(self.text)
            return
        m = _TOKEN.match(self.text, self.pos)
        if m is None:
            self.fail(f"unexpected {self.text[self.pos:self.pos + 10]!r}", self.pos)
        self.start = m.start(m.lastgroup)
        self.tok = (m.lastgroup, m.group(m.lastgroup))
        self.pos = m.end()

    def expect(self, punct: str) -> None:
        if self.tok != ("punct", punct):
            self.fail(f"expected {punct!r}")
        self.advance()

    def expr(self, depth: int):
        if depth > MAX_DEPTH:
            self.fail(f"nested more than {MAX_DEPTH} deep")
        if self.tok == ("punct", "-"):
            self.advance()
            return -self.constant()
        if self.tok is None or self.tok[0] != "name":
            self.fail("expected an expression")
        name, at = self.tok[1], self.start
        functions, constants = _table()
        self.advance()
        if self.tok != ("punct", "("):
            if name in constants:
                return constants[name]
            self.fail(f"unknown name {name!r}", at)
        if name == "Symbol":
            return self.symbol()
        if name in ("Integer", "Rational", "Float"):
            return self.number(name)
        if name not in functions:
            self.fail(f"unknown name {name!r}", at)
        self.advance()
        args = []
        while self.tok != ("punct", ")"):
            if args:
                self.expect(",")
            args.append(self.expr(depth + 1))
            if len(args) > self.budget.args:
                self.budget.charge(name, len(args), self, at)
        self.advance()
        self.budget.charge(name, len(args), self, at)
        return _build(name, functions[name], args, self, at)

    def constant(self):
        if self.tok is None or self.tok[0] != "name" or self.tok[1] not in ("oo", "int_oo"):
            self.fail("'-' stands only before oo or int_oo")
        value = _table()[1][self.tok[1]]
        self.advance()
        return value

    def literal_int(self) -> int:
        negative = self.tok == ("punct", "-")
        if negative:
            self.advance()
        if self.tok is None or self.tok[0] != "int":
            self.fail("expected an integer")
        digits = self.tok[1]
        if len(digits) > MAX_DIGITS:
            self.fail(f"an integer of more than {MAX_DIGITS} digits")
        self.advance()
        return -int(digits) if negative else int(digits)

    def literal_str(self) -> str:
        if self.tok is None or self.tok[0] != "str":
            self.fail("expected a quoted name")
        s = self.tok[1][1:-1]
        self.advance()
        return s

    def number(self, kind: str):
        import sympy

        self.advance()  # '('
        if kind == "Integer":
            value = sympy.Integer(self.literal_int())
        elif kind == "Rational":
            p = self.literal_int()
            self.expect(",")
            q = self.literal_int()
            if q == 0:
                self.fail("a Rational with denominator 0")
            value = sympy.Rational(p, q)
        else:
            text = self.literal_str()
            if not _FLOAT_RE.match(text):
                self.fail(f"{text!r} is not a decimal number")
            precision = 53
            if self.tok == ("punct", ","):
                self.advance()
                if self.tok != ("name", "precision"):
                    self.fail("Float takes only precision=")
                self.advance()
                self.expect("=")
                precision = self.literal_int()
                if not 1 <= precision <= 256:
                    self.fail(f"a Float precision of {precision} bits")
            value = sympy.Float(text, precision=precision)
        self.expect(")")
        return value

    def symbol(self):
        import sympy

        self.advance()  # '('
        name = self.literal_str()
        if not SYMBOL_RE.match(name):
            self.fail(f"{name!r} is not a size symbol name (s0, u1, ...)")
        self.symbols.add(name)
        if len(self.symbols) > self.budget.symbols:
            self.fail(
                f"more than {self.budget.symbols} distinct symbols in one expression (raise "
                f"ArchiveLimits(sym_symbols=...) if you trust the file)"
            )
        assumptions = {}
        while self.tok == ("punct", ","):
            self.advance()
            if self.tok is None or self.tok[0] != "name" or self.tok[1] not in _ASSUMPTIONS:
                self.fail("unknown symbol assumption")
            key = self.tok[1]
            self.advance()
            self.expect("=")
            if self.tok not in (("name", "True"), ("name", "False")):
                self.fail(f"assumption {key} must be True or False")
            assumptions[key] = self.tok[1] == "True"
            self.advance()
        self.expect(")")
        return sympy.Symbol(name, **assumptions)


def _build(name: str, fn: Callable, args: list, parser: _Parser, at: int):
    import sympy

    if name in _POWERS and len(args) == 2 and args[1].is_number:
        e = args[1]
        if not (e.is_finite and abs(e) <= MAX_EXPONENT) and not (
            name != "LShift" and args[0].is_number and abs(args[0]) <= 1
        ):
            parser.fail(f"{name} with an exponent of {str(e)[:20]} (at most {MAX_EXPONENT})", at)
    try:
        out = fn(*args)
    except (TypeError, ValueError, ZeroDivisionError, AttributeError, ArithmeticError) as e:
        parser.fail(f"{name} of these arguments is invalid ({type(e).__name__})", at)
    if isinstance(out, sympy.Integer) and int(out).bit_length() > MAX_BITS:
        parser.fail(f"{name} evaluates to an integer of more than {MAX_BITS} bits", at)
    if not isinstance(out, sympy.Basic):
        parser.fail(f"{name} did not give an expression", at)
    return out


def parse_sym_expr(text: str, budget: Optional[SymBudget] = None):
    """The sympy expression that srepr text stands for, built by our own parser
    (Note [Expressions are parsed, never evaluated]) within ``budget`` (Note
    [Symbolic work]; a fresh default one if None); SymExprError otherwise."""
    if not isinstance(text, str):
        raise SymExprError(f"it is a {type(text).__name__}, not text")
    if len(text) > MAX_LENGTH:
        raise SymExprError(f"it is longer than {MAX_LENGTH} characters")
    p = _Parser(text, budget)
    out = p.expr(0)
    if p.tok is not None:
        p.fail("unexpected text after the expression")
    return out
