"""How every entry point allocates its outputs: torch.empty, filled with NaN under test, so that
an element a kernel fails to write can never pass a check. The tests turn the fill on
(tests/conftest.py), as does POISON_OUTPUTS=1 in the environment; elsewhere it is off, since each
fill is one more kernel launch on every call (a decode step's host work is measured in
microseconds: docs/notes/stage13.md). Benchmarks also turn it off inside a test run (no_poison)."""

import contextlib
import os

import torch

_POISON = os.environ.get("POISON_OUTPUTS", "0") == "1"


def set_poison(on):
    """Turn the NaN fill of fresh outputs on or off (the tests turn it on)."""
    global _POISON
    _POISON = bool(on)


@contextlib.contextmanager
def no_poison():
    """Benchmarks skip the NaN fill of fresh outputs (it would be timed as part of the launch)."""
    global _POISON
    old, _POISON = _POISON, False
    try:
        yield
    finally:
        _POISON = old


def poison(t):
    """Fill with NaN (floats) so any element the kernel fails to write fails the check."""
    if t.is_floating_point():
        t.fill_(float("nan"))
    else:
        t.fill_(-1)
    return t


def empty_output(shape, dtype, device, stride=None):
    """What every entry point allocates its outputs with: torch.empty (torch.empty_strided when
    given a stride), poisoned with NaN unless a benchmark turned poisoning off."""
    if stride is None:
        t = torch.empty(shape, dtype=dtype, device=device)
    else:
        t = torch.empty_strided(shape, stride, dtype=dtype, device=device)
    return poison(t) if _POISON else t
