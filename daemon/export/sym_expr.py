"""Shape expressions of an uploaded program, checked before torch `sympify`s them.

torch writes a size expression with `sympy.srepr`:
`Mul(Integer(2), Symbol('s77', positive=True, integer=True))`. `sympify` runs
such text through Python's `eval`, and sympy evaluates numbers eagerly, so
`Pow(Integer(10), Pow(Integer(10), Integer(8)))` costs minutes of CPU while
holding the GIL. `why_not` parses the text with `ast` (which evaluates
nothing) and accepts only calls of sympy's and torch's size functions, size
symbols, numbers, arithmetic and comparisons, with a bound on the value's
size: every sub-expression is given an upper bound on its bit length (a
symbol counts as 64 bits), exponents must be small integer literals, and a
bound over `_MAX_BITS` is refused. Evaluating what passes is cheap.
"""

from __future__ import annotations

import ast
import re
from typing import Any

from .. import pyast

_MAX_LEN = 10_000
_MAX_BITS = 4096
_MAX_EXPONENT = 64
_SYMBOL_BITS = 64
_SYMBOL = re.compile(r"[a-z]{1,4}[0-9]{1,9}")
_INTEGER = re.compile(r"[-+]?[0-9]{1,40}")
_NUMBER = re.compile(r"[-+]?[0-9]{1,30}(\.[0-9]{1,30})?(e[-+]?[0-9]{1,3})?")

# Functions whose value is no larger than their largest argument (division, remainders, choices, truth).
_SHRINKING = {
    "FloorDiv",
    "ModularIndexing",
    "Where",
    "PythonMod",
    "Mod",
    "CleanDiv",
    "CeilDiv",
    "IntTrueDiv",
    "FloatTrueDiv",
    "RShift",
    "IsNonOverlappingAndDenseIndicator",
    "TruncToFloat",
    "TruncToInt",
    "RoundToInt",
    "RoundDecimal",
    "ToFloat",
    "CeilToInt",
    "FloorToInt",
    "Identity",
    "Max",
    "Min",
    "Abs",
    "Eq",
    "Ne",
    "Lt",
    "Le",
    "Gt",
    "Ge",
    "And",
    "Or",
    "Not",
    "Equality",
    "Unequality",
    "StrictLessThan",
    "StrictGreaterThan",
    "LessThan",
    "GreaterThan",
    "Rational",
}
_POWERS = {"Pow", "PowByNatural", "FloatPow"}
_CONSTANTS = {"BooleanTrue", "BooleanFalse", "Infinity", "NegativeInfinity", "IntInfinity", "NegativeIntInfinity"}
_KEYWORDS = {
    "positive",
    "negative",
    "nonnegative",
    "nonpositive",
    "integer",
    "real",
    "finite",
    "extended_real",
    "zero",
    "nonzero",
    "commutative",
    "precision",
}
_NAMES = {"True", "False", "oo"}


class _Refused(Exception):
    pass


def why_not(text: Any) -> str:
    """'' when `text` is a bounded size expression, else why it is refused."""
    if not isinstance(text, str) or len(text) > _MAX_LEN:
        return f"is not a string of at most {_MAX_LEN} characters"
    try:
        tree = pyast.parse_expression(text.strip())
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        return f"{text[:80]!r} is not an expression"
    try:
        _bits(tree.body, 0)
    except _Refused as exc:
        return f"{text[:80]!r} {exc}"
    except RecursionError:
        return f"{text[:80]!r} nests too deeply"
    return ""


def _small_int(node: ast.expr) -> int | None:
    """The value of an integer literal (2, -2, Integer(2)) of at most _MAX_EXPONENT, else None."""
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        inner = _small_int(node.operand)
        return None if inner is None else (-inner if isinstance(node.op, ast.USub) else inner)
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "Integer":
        if len(node.args) == 1 and not node.keywords:
            return _small_int(node.args[0])
        return None
    if isinstance(node, ast.Constant) and type(node.value) is int and abs(node.value) <= _MAX_EXPONENT:
        return node.value
    return None


def _bits(node: ast.expr, depth: int) -> int:
    """An upper bound on the bit length of the value of `node` (refusing anything else)."""
    if depth > 100:
        raise _Refused("nests too deeply")
    out = _bits_of(node, depth + 1)
    if out > _MAX_BITS:
        raise _Refused(f"may grow past {_MAX_BITS} bits")
    return out


def _bits_of(node: ast.expr, depth: int) -> int:
    if isinstance(node, ast.Constant):
        value = node.value
        if type(value) is int:
            return value.bit_length()
        if type(value) is float:
            return 64
        raise _Refused(f"holds the constant {str(value)[:40]!r}")
    if isinstance(node, ast.Name):
        if _SYMBOL.fullmatch(node.id):
            return _SYMBOL_BITS
        if node.id in _NAMES:
            return 1
        raise _Refused(f"names {node.id[:40]!r}")
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd, ast.Not, ast.Invert)):
        return _bits(node.operand, depth)
    if isinstance(node, ast.BinOp):
        if isinstance(node.op, ast.Pow):
            return _power(node.left, node.right, depth)
        left, right = _bits(node.left, depth), _bits(node.right, depth)
        if isinstance(node.op, (ast.Add, ast.Sub)):
            return max(left, right) + 1
        if isinstance(node.op, ast.Mult):
            return left + right
        if isinstance(node.op, (ast.FloorDiv, ast.Div, ast.Mod, ast.RShift, ast.BitAnd, ast.BitOr, ast.BitXor)):
            return max(left, right)
        raise _Refused(f"uses the operator {type(node.op).__name__}")
    if isinstance(node, ast.BoolOp):
        return max(_bits(v, depth) for v in node.values)
    if isinstance(node, ast.Compare):
        for part in (node.left, *node.comparators):
            _bits(part, depth)
        return 1
    if isinstance(node, ast.Call):
        return _call(node, depth)
    raise _Refused(f"holds {type(node).__name__}, not sizes and arithmetic")


def _power(base: ast.expr, exponent: ast.expr, depth: int) -> int:
    k = _small_int(exponent)
    if k is None:
        raise _Refused(f"raises to a power that is not an integer literal of at most {_MAX_EXPONENT}")
    return _bits(base, depth) * max(abs(k), 1)


def _call(node: ast.Call, depth: int) -> int:
    if not isinstance(node.func, ast.Name):
        raise _Refused("calls something that is not a size function")
    name = node.func.id
    for kw in node.keywords:
        if kw.arg not in _KEYWORDS:
            raise _Refused(f"passes the keyword {str(kw.arg)[:40]!r}")
        if not (isinstance(kw.value, ast.Constant) and type(kw.value.value) in (bool, int)):
            raise _Refused(f"passes {kw.arg} a value that is not a flag")
        if type(kw.value.value) is int and not 0 < kw.value.value <= 1024:
            raise _Refused(f"passes {kw.arg}={kw.value.value}")
    args = node.args
    if name in ("Symbol", "Dummy"):
        if len(args) != 1 or not (isinstance(args[0], ast.Constant) and isinstance(args[0].value, str)):
            raise _Refused(f"{name} takes one quoted name")
        if not _SYMBOL.fullmatch(args[0].value):
            raise _Refused(f"quotes {args[0].value[:40]!r}, not a size symbol")
        return _SYMBOL_BITS
    if name in ("Integer", "Float"):
        if len(args) != 1:
            raise _Refused(f"{name} takes one number")
        arg = args[0]
        if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
            if not (_NUMBER if name == "Float" else _INTEGER).fullmatch(arg.value):
                raise _Refused(f"quotes {arg.value[:40]!r}, not a number")
            return 64 if name == "Float" else int(arg.value).bit_length()
        return _bits(arg, depth)
    if name in _CONSTANTS:
        if args:
            raise _Refused(f"{name} takes no argument")
        return 1
    if name in _POWERS:
        if len(args) != 2:
            raise _Refused(f"{name} takes a base and an exponent")
        return _power(args[0], args[1], depth)
    if name not in _SHRINKING and name not in ("Add", "Mul", "LShift"):
        raise _Refused(f"calls {name[:40]!r}, not a size function")
    bits = [_bits(a, depth) for a in args]
    if not bits:
        raise _Refused(f"calls {name[:40]!r} without arguments")
    if name == "Add":
        return max(bits) + len(bits).bit_length()
    if name == "Mul":
        return sum(bits)
    if name == "LShift":
        k = _small_int(args[1]) if len(args) == 2 else None
        if k is None or k < 0:
            raise _Refused(f"shifts by something other than an integer literal of at most {_MAX_EXPONENT}")
        return bits[0] + k
    return max(bits)  # _SHRINKING
