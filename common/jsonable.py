"""Values as JSON can hold them, and text as a line of a message shows it."""

import math
import numbers
import re


def utf8_text(value: str) -> str:
    """``value`` as UTF-8 can hold it. Linux allows any bytes in a file name but / and NUL, and Python hands the ones
    that are not UTF-8 over as lone surrogates, which JSON writes as escapes that other readers refuse (serde_json,
    pyarrow) or replace (jq) and Parquet's strings cannot hold at all. Those bytes become ``\\xNN``, as Python shows
    them; a surrogate no file name makes (a JSON "\\ud800") is escaped as it is."""
    if value.isascii():
        return value
    try:
        return value.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
    except UnicodeEncodeError:
        return value.encode("utf-8", "backslashreplace").decode("utf-8")


def plain_number(value):
    """A number of another library (numpy's ``float32``, ``int64``: ``np.linspace``, a DataFrame's ``max()``) as
    Python's own ``int`` or ``float``; anything else as it is. The Python API's numbers are checked as Python's
    (``isinstance(x, (int, float))``), which refused ``speed=np.float32(0.5)`` as "not a number" (an outside pass),
    and a numpy value kept in a result's parameters is not JSON. ``bool`` stays a bool (refused where a number is
    asked for)."""
    if isinstance(value, bool) or type(value) in (int, float):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    return value


def finite(value):
    """``value`` (dicts, lists and tuples of numbers, strings, ...) with every float that is not finite as None: JSON
    has no infinity or NaN, and Python's ``json.dumps`` writes them as ``Infinity`` and ``NaN``, which strict readers
    (jq, browsers' ``JSON.parse``) refuse; Starlette refuses to write them at all, a 500. A parameter or metric that
    is infinite says "no bound" (``glimpse ask --json`` printed an ST3 tau of ``Infinity``; an outside pass). Strings
    are made ``utf8_text`` (``ask --json`` wrote a file name's byte that is not UTF-8 as "\\udcff": an outside pass)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, str):
        return utf8_text(value)
    if isinstance(value, dict):
        return {key: finite(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(item) for item in value]
    return value


def one_line(text: str) -> str:
    """``text`` (a message naming files) as one line of a terminal or log shows it: ``utf8_text``, and control
    characters, which a file name may hold, as ``\\xNN`` too. A name holding a newline split a "failed ..." line in
    two (a grep for them missed the rest), a NUL showed as nothing, and an escape sequence could rewrite the
    terminal (an outside pass)."""
    return re.sub(r"[\x00-\x1f\x7f]", lambda match: f"\\x{ord(match.group()):02x}", utf8_text(text))
