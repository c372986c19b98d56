"""Resource quantities as the API server stores them (apimachinery's ``resource.Quantity``).

A real API server parses every quantity it is sent and stores its canonical form: the
largest suffix that keeps the number whole, in the suffix family it was written in
(``1024Mi`` -> ``1Gi``, ``0.5`` -> ``500m``, ``1`` -> ``"1"``, ``1e3`` stays ``1e3``),
with more precision than nano rounded up. The emulator applies :func:`canonical` to the
quantity fields of built-in kinds (:func:`canonicalize_quantities`), so an operator that
compares what it sent with what it reads back meets the same strings as on a cluster.

Test support only; the operator never imports it.
"""

from __future__ import annotations

import re
from decimal import ROUND_CEILING, ROUND_FLOOR, Decimal, localcontext
from enum import Enum
from typing import Any

_QUANTITY = re.compile(
    r"^(?P<sign>[+-]?)(?P<int>\d*)(?:\.(?P<frac>\d*))?"
    r"(?P<suffix>[eE][+-]?\d+|Ki|Mi|Gi|Ti|Pi|Ei|[numkMGTPE])?$"
)
_BINARY = {"Ki": 10, "Mi": 20, "Gi": 30, "Ti": 40, "Pi": 50, "Ei": 60}
_DECIMAL = {"n": -9, "u": -6, "m": -3, "": 0, "k": 3, "M": 6, "G": 9, "T": 12, "P": 15, "E": 18}
_DECIMAL_SUFFIX = {exponent: suffix for suffix, exponent in _DECIMAL.items()}
_NANO = Decimal("1e-9")


class Format(Enum):
    DECIMAL_SI = "DecimalSI"
    BINARY_SI = "BinarySI"
    DECIMAL_EXPONENT = "DecimalExponent"


class QuantityError(ValueError):
    """Not a quantity: the server answers 422 (``quantities must match the regular
    expression ...``)."""


def parse(value: object) -> tuple[Decimal, Format]:
    """The exact value (rounded up to nano, as the server does) and the suffix family."""
    if isinstance(value, bool) or not isinstance(value, str | int | float):
        raise QuantityError(f"{value!r} is not a quantity")
    text = repr(value) if isinstance(value, float) else str(value)
    found = _QUANTITY.match(text)
    if found is None or not (found["int"] or found["frac"]):
        raise QuantityError(f"{value!r} is not a quantity such as 500m, 4Gi or 1")
    with localcontext() as ctx:
        ctx.prec = 80
        number = Decimal(f"{found['int'] or '0'}.{found['frac'] or '0'}")
        suffix = found["suffix"] or ""
        if suffix in _BINARY:
            number *= Decimal(2) ** _BINARY[suffix]
            family = Format.BINARY_SI
        elif suffix[:1] in ("e", "E") and len(suffix) > 1:
            number *= Decimal(10) ** int(suffix[1:])
            family = Format.DECIMAL_EXPONENT
        else:
            number *= Decimal(10) ** _DECIMAL[suffix]
            family = Format.DECIMAL_SI
        if found["sign"] == "-":
            number = -number
        rounding = ROUND_CEILING if number >= 0 else ROUND_FLOOR  # away from zero
        number = number.quantize(_NANO, rounding=rounding)
    return number, family


def canonical(value: object) -> str:
    """The string the API server stores for ``value``."""
    number, family = parse(value)
    if number == 0:
        return "0"
    if family is Format.BINARY_SI and (abs(number) < 1024 or number != number.to_integral()):
        family = Format.DECIMAL_SI  # a whole multiple of 1024 or it reads as decimal
    if family is Format.BINARY_SI:
        whole = int(number)
        power = 0
        while power < 60 and whole % (1 << (power + 10)) == 0:
            power += 10
        suffix = {0: "", **{bits: name for name, bits in _BINARY.items()}}[power]
        return f"{whole >> power}{suffix}"
    exponent = -9
    mantissa = int(number.scaleb(9))
    while mantissa % 1000 == 0 and exponent < 18:
        mantissa //= 1000
        exponent += 3
    if family is Format.DECIMAL_EXPONENT:
        return f"{mantissa}" if exponent == 0 else f"{mantissa}e{exponent}"
    return f"{mantissa}{_DECIMAL_SUFFIX[exponent]}"


def canonicalize_quantities(obj: Any, path: tuple[str, ...] = ()) -> Any:
    """``obj`` with every quantity of a built-in kind in canonical form: container
    ``resources.requests``/``limits``, ``emptyDir.sizeLimit``, a claim's
    ``resources.requests``. Rewrites ``obj`` in place (and returns it); raises
    :class:`QuantityError` for a value that is not one."""
    if isinstance(obj, dict):
        for key, value in obj.items():
            if key == "sizeLimit" and value is not None:
                obj[key] = canonical(value)
            elif key in ("requests", "limits") and path and path[-1] == "resources":
                if isinstance(value, dict):
                    obj[key] = {k: canonical(v) for k, v in value.items()}
            elif isinstance(value, dict | list):
                canonicalize_quantities(value, (*path, str(key)))
    elif isinstance(obj, list):
        for item in obj:
            if isinstance(item, dict | list):
                canonicalize_quantities(item, path)
    return obj
