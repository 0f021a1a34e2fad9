"""The checker: relative error against a high-precision reference, the worst element's
coordinates, NaN/Inf never pass, outputs poisoned before every launch, and a deadline on the GPU
so that a deadlocked kernel fails instead of hanging the suite."""
import contextlib
import dataclasses
import time

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


@dataclasses.dataclass
class CheckResult:
    name: str
    rel_err: float
    max_abs_err: float
    mean_abs_err: float
    worst_index: tuple
    worst_out: float
    worst_ref: float
    nonfinite: int
    bound: float
    torch_rel_err: float | None
    passed: bool

    def __str__(self):
        s = (f"{self.name}: rel err {self.rel_err:.3e} (bound {self.bound:.3e}"
             + (f", PyTorch low-precision rel err {self.torch_rel_err:.3e}" if self.torch_rel_err is not None else "")
             + f"), max abs err {self.max_abs_err:.3e}, mean abs err {self.mean_abs_err:.3e}, "
             f"worst element at {self.worst_index}: out {self.worst_out:.6g} vs ref {self.worst_ref:.6g}")
        if self.nonfinite:
            s += f"; {self.nonfinite} non-finite output element(s) (NaN = unwritten or overflow)"
        return s


def rel_err(out, ref):
    ref64 = ref.to(torch.float64)
    return (torch.linalg.vector_norm(out.to(torch.float64) - ref64) / torch.linalg.vector_norm(ref64)).item()


def compare(name, out, ref, *, rtol, torch_lowp=None, torch_factor=3.0):
    """Measure `out` against `ref` (same shape). Passes when every element is finite,
    ||out - ref|| / ||ref|| <= rtol, and, when PyTorch's own low-precision result `torch_lowp`
    is given, the error is at most `torch_factor` times PyTorch's error (plus 1e-6 of slack for
    references so exact that PyTorch's error is zero)."""
    if out.shape != ref.shape:
        raise AssertionError(f"{name}: output shape {tuple(out.shape)} != reference shape {tuple(ref.shape)}")
    out64 = out.detach().to(torch.float64)
    ref64 = ref.detach().to(torch.float64)
    finite = torch.isfinite(out64)
    nonfinite = int((~finite).sum().item())
    diff = (out64 - ref64).abs()
    diff = torch.where(finite, diff, torch.full_like(diff, float("inf")))
    flat = int(torch.argmax(diff).item())
    idx = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), out.shape))
    err = rel_err(out64.nan_to_num(nan=0.0, posinf=0.0, neginf=0.0), ref64) if nonfinite else rel_err(out64, ref64)
    bound = rtol
    terr = None
    if torch_lowp is not None:
        terr = rel_err(torch_lowp, ref64)
        bound = min(rtol, torch_factor * terr + 1e-6)
    passed = nonfinite == 0 and err <= bound
    return CheckResult(name, err, float(diff[finite].max().item()) if finite.any() else float("inf"),
                       float(diff[finite].mean().item()) if finite.any() else float("inf"),
                       idx, float(out64.flatten()[flat].item()), float(ref64.flatten()[flat].item()),
                       nonfinite, bound, terr, passed)


def check_close(name, out, ref, *, rtol, torch_lowp=None, torch_factor=3.0):
    """compare(), raising AssertionError with the full report when it fails; returns the result."""
    r = compare(name, out, ref, rtol=rtol, torch_lowp=torch_lowp, torch_factor=torch_factor)
    if not r.passed:
        raise AssertionError(str(r))
    return r


def run_with_deadline(fn, seconds=60.0, what="kernel"):
    """Run fn() (which launches GPU work and returns its outputs), then wait for the GPU with a
    deadline. A kernel that deadlocks (a barrier that never flips) raises TimeoutError instead of
    hanging the test suite. Compilation inside fn() happens before the launch and is not timed."""
    out = fn()
    ev = torch.cuda.Event()
    ev.record()
    t0 = time.monotonic()
    while not ev.query():
        if time.monotonic() - t0 > seconds:
            raise TimeoutError(
                f"{what} did not finish within {seconds:.0f} s of its launch: most likely a deadlock "
                "(an mbarrier wait whose phase never completes). The GPU context is now unusable; "
                "restart the process."
            )
        time.sleep(0.001)
    torch.cuda.synchronize()
    return out
