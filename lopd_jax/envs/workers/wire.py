"""Plain-data wire format between the code sandbox and the trusted grader.

Standard library only and free of ``from __future__`` imports: the sandbox harness
prepends this file's source to the program it runs, so both sides use exactly this code.
:func:`wire_encode` maps ``None``, ``bool``, ``int``, ``float`` (with NaN and infinities),
``str`` and ``list`` to themselves and ``tuple``, ``set``, ``frozenset``, ``dict``,
``complex`` and ``bytes`` to one-key objects. Only these exact types are accepted (a
subclass raises ``TypeError``), so nothing :func:`wire_decode` returns can carry a custom
``__eq__``, ``__hash__`` or ``__repr__``. The decoder rejects anything the encoder would
not produce and limits nesting (``WIRE_MAX_DEPTH``) and integer size
(``WIRE_MAX_INT_DIGITS``); docs/sandbox.md.
"""

WIRE_MAX_DEPTH = 100
WIRE_MAX_INT_DIGITS = 4000


def _wire_scalar(value, depth, max_bits):
    """The first step of both directions: the nesting check, then ``(True, value)`` for a
    value that passes through unchanged (None, bool, str, float, an int of at most
    ``max_bits`` bits), else ``(False, None)``."""
    if depth > WIRE_MAX_DEPTH:
        raise ValueError("value nested deeper than %d levels" % WIRE_MAX_DEPTH)
    t = type(value)
    if value is None or t is bool or t is str or t is float:
        return True, value
    if t is int:
        if value.bit_length() > max_bits:
            raise ValueError("integer with more than %d digits" % WIRE_MAX_INT_DIGITS)
        return True, value
    return False, None


def wire_encode(value, _depth=0):
    """JSON-compatible data for a plain value; TypeError / ValueError for anything else."""
    done, out = _wire_scalar(value, _depth, WIRE_MAX_INT_DIGITS * 3.32)
    if done:
        return out
    t = type(value)
    d = _depth + 1
    if t is list:
        return [wire_encode(x, d) for x in value]
    if t is tuple:
        return {"t": [wire_encode(x, d) for x in value]}
    if t is dict:
        return {"d": [[wire_encode(k, d), wire_encode(v, d)] for k, v in value.items()]}
    if t is set:
        return {"s": [wire_encode(x, d) for x in value]}
    if t is frozenset:
        return {"fs": [wire_encode(x, d) for x in value]}
    if t is complex:
        return {"c": [value.real, value.imag]}
    if t is bytes:
        return {"b": value.hex()}
    raise TypeError("unsupported value type %s (only None, bool, int, float, complex, str, "
                    "bytes, list, tuple, dict, set, frozenset)" % t.__name__)


def wire_decode(data, _depth=0):
    """The value :func:`wire_encode` produced ``data`` from; ValueError if malformed."""
    done, out = _wire_scalar(data, _depth, WIRE_MAX_INT_DIGITS * 3.33)
    if done:
        return out
    t = type(data)
    d = _depth + 1
    if t is list:
        return [wire_decode(x, d) for x in data]
    if t is not dict or len(data) != 1:
        raise ValueError("malformed wire value of type %s" % t.__name__)
    (tag, body), = data.items()
    if tag == "c" and type(body) is list and len(body) == 2 and all(
            type(x) in (int, float) for x in body):
        return complex(body[0], body[1])
    if tag == "b" and type(body) is str:
        return bytes.fromhex(body)
    if type(body) is not list:
        raise ValueError("malformed wire value with tag %r" % (tag,))
    if tag == "t":
        return tuple(wire_decode(x, d) for x in body)
    if tag == "s":
        return set(wire_decode(x, d) for x in body)
    if tag == "fs":
        return frozenset(wire_decode(x, d) for x in body)
    if tag == "d":
        out = {}
        for pair in body:
            if type(pair) is not list or len(pair) != 2:
                raise ValueError("malformed wire dict entry")
            out[wire_decode(pair[0], d)] = wire_decode(pair[1], d)
        return out
    raise ValueError("unknown wire tag %r" % (tag,))
