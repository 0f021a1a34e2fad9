"""How every entry point allocates its outputs: torch.empty filled with NaN, so that an element
a kernel fails to write can never pass a check; benchmarks turn the fill off (no_poison)."""

import contextlib

import torch

_POISON = True


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


def empty_output(shape, dtype, device):
    """What every entry point allocates its outputs with: torch.empty, poisoned with NaN unless
    a benchmark turned poisoning off."""
    t = torch.empty(shape, dtype=dtype, device=device)
    return poison(t) if _POISON else t
