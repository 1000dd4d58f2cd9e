"""Values as JSON can hold them."""

import math


def finite(value):
    """``value`` (dicts, lists and tuples of numbers, strings, ...) with every float that is not finite as None: JSON
    has no infinity or NaN, and Python's ``json.dumps`` writes them as ``Infinity`` and ``NaN``, which strict readers
    (jq, browsers' ``JSON.parse``) refuse; Starlette refuses to write them at all, a 500. A parameter or metric that
    is infinite says "no bound" (``glimpse ask --json`` printed an ST3 tau of ``Infinity``; an outside pass)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: finite(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(item) for item in value]
    return value
