"""The checker: relative error against a high-precision reference, the worst element's
coordinates, NaN/Inf never pass, outputs poisoned before every launch, and a deadline on the GPU
so that a deadlocked kernel fails instead of hanging the suite."""

import dataclasses
import time

import torch

from common.outputs import empty_output, no_poison, poison  # noqa: F401
from common.tools import reference


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
        s = (
            f"{self.name}: rel err {self.rel_err:.3e} (bound {self.bound:.3e}"
            + (
                f", PyTorch low-precision rel err {self.torch_rel_err:.3e}"
                if self.torch_rel_err is not None
                else ""
            )
            + f"), max abs err {self.max_abs_err:.3e}, mean abs err {self.mean_abs_err:.3e}, "
            f"worst element at {self.worst_index}: out {self.worst_out:.6g} vs ref {self.worst_ref:.6g}"
        )
        if self.nonfinite:
            s += f"; {self.nonfinite} non-finite output element(s) (NaN = unwritten or overflow)"
        return s


def rel_err(out, ref):
    ref64 = ref.to(torch.float64)
    return (
        torch.linalg.vector_norm(out.to(torch.float64) - ref64) / torch.linalg.vector_norm(ref64)
    ).item()


def compare(name, out, ref, *, rtol, torch_lowp=None, torch_factor=3.0):
    """Measure `out` against `ref` (same shape). Passes when every element is finite,
    ||out - ref|| / ||ref|| <= rtol, and, when PyTorch's own low-precision result `torch_lowp`
    is given, the error is at most `torch_factor` times PyTorch's error (plus 1e-6 of slack for
    references so exact that PyTorch's error is zero). Where PyTorch's result holds a NaN (its
    math path on a row that sees no key) its error is NaN and the bound stays rtol: the
    PyTorch-relative bound applies only when PyTorch's whole result is finite."""
    if out.shape != ref.shape:
        raise AssertionError(
            f"{name}: output shape {tuple(out.shape)} != reference shape {tuple(ref.shape)}"
        )
    out64 = out.detach().to(torch.float64)
    ref64 = ref.detach().to(torch.float64)
    finite = torch.isfinite(out64)
    nonfinite = int((~finite).sum().item())
    diff = (out64 - ref64).abs()
    diff = torch.where(finite, diff, torch.full_like(diff, float("inf")))
    flat = int(torch.argmax(diff).item())
    idx = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), out.shape))
    err = (
        rel_err(out64.nan_to_num(nan=0.0, posinf=0.0, neginf=0.0), ref64)
        if nonfinite
        else rel_err(out64, ref64)
    )
    bound = rtol
    terr = None
    if torch_lowp is not None:
        terr = rel_err(torch_lowp, ref64)
        bound = min(rtol, torch_factor * terr + 1e-6)
    passed = nonfinite == 0 and err <= bound
    return CheckResult(
        name,
        err,
        float(diff[finite].max().item()) if finite.any() else float("inf"),
        float(diff[finite].mean().item()) if finite.any() else float("inf"),
        idx,
        float(out64.flatten()[flat].item()),
        float(ref64.flatten()[flat].item()),
        nonfinite,
        bound,
        terr,
        passed,
    )


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


def unit_roundoff(dtype):
    """The relative error of one rounding to `dtype`: 2^-8 (bf16), 2^-11 (fp16), 2^-24 (fp32)."""
    return torch.finfo(dtype).eps / 2


def check_close_floor(name, out, ref, *, rtol, torch_lowp, torch_factor=3.0, floor=0.0):
    """check_close() with PyTorch's yardstick, whose bound torch_factor x PyTorch's error is raised
    to at least `floor` (and never above rtol). The floor is for inputs whose answer PyTorch's
    low-precision result reproduces almost exactly (one dominant key: O is a row of V), where a
    correct kernel that rounds differently would otherwise be held to ~0."""
    r = compare(name, out, ref, rtol=rtol, torch_lowp=torch_lowp, torch_factor=torch_factor)
    bound = min(rtol, max(r.bound, floor))
    r = dataclasses.replace(r, bound=bound, passed=r.nonfinite == 0 and r.rel_err <= bound)
    if not r.passed:
        raise AssertionError(str(r))
    return r


def check_attention(
    name,
    o,
    q,
    k,
    v,
    scale=None,
    lse=None,
    *,
    rtol=1e-2,
    torch_factor=3.0,
    floor=None,
    lse_rtol=1e-4,
    mask=None,
):
    """O = softmax(scale * Q K^T) V (and LSE, when given) against the fp64 reference computed from
    the same q, k, v; raises AssertionError with the full report. Returns (O's CheckResult, LSE's
    or None).

    O: the kernels keep S, row_max and row_sum in fp32 but round P to the input dtype before
    P @ V and O once at the end (unit roundoff u = 2^-8 in bf16, 2^-11 in fp16). The bound is
    torch_factor x the error of PyTorch's own attention in the input dtype (SDPA math backend,
    same inputs, same reference), never above rtol, and never below `floor`, by default one
    rounding, u: PyTorch's error is ~0 when the answer is a row of V (a single key, one dominant
    key), yet a correct kernel may still carry the rounding of P. (The kernels' roundings emulated
    in PyTorch on the tests' inputs, on CPU, 2026-11-29: 1.3-1.5x PyTorch's error, 0 where it is 0.)

    LSE (fp32, natural log, (B, H, Sq)): scale * row_max + log(row_sum) from fp32 scores (exact
    bf16/fp16 products summed in fp32) and fp32 sums, through ex2/lg2.approx (~2^-22 relative):
    about 1e-6 relative. lse_rtol = 1e-4 leaves margin yet fails a log2 in place of the natural
    log (x1.44), a missing max term or a row_sum left unrescaled. PyTorch's logsumexp of logits
    rounded to bf16 is off by ~1e-3, so it is no yardstick here."""
    if o.shape != q.shape or o.dtype != q.dtype:
        raise AssertionError(
            f"{name}: got shape {tuple(o.shape)} {o.dtype}, expected {tuple(q.shape)} {q.dtype}"
        )
    o_ref, lse_ref = reference.attention_ref(q, k, v, scale, mask=mask)
    if floor is None:
        floor = unit_roundoff(q.dtype)
    if lse is not None and (lse.shape != q.shape[:3] or lse.dtype != torch.float32):
        raise AssertionError(
            f"LSE of {name}: got shape {tuple(lse.shape)} {lse.dtype}, expected {tuple(q.shape[:3])} float32"
        )
    # Rows that see no key (a mask): O must be exactly 0 there and LSE exactly -inf, never NaN.
    empty = ~torch.isfinite(lse_ref)
    if empty.any():
        bad = (o[empty] != 0).any(-1)
        if bad.any():
            where = tuple(int(x) for x in empty.nonzero()[int(bad.nonzero()[0])])
            raise AssertionError(
                f"{name}: {int(bad.sum())} row(s) that see no key have O != 0 (first at (b, h, "
                f"row) = {where}: {o[where][:4].tolist()} ...)"
            )
        if lse is not None and not (lse[empty] == float("-inf")).all():
            where = tuple(
                int(x) for x in empty.nonzero()[int((lse[empty] != float("-inf")).nonzero()[0])]
            )
            raise AssertionError(
                f"LSE of {name}: rows that see no key must have LSE = -inf; at (b, h, row) = "
                f"{where} got {lse[where].item()}"
            )
        if empty.all():
            return None, None
    o_result = check_close_floor(
        name,
        o,
        o_ref,
        rtol=rtol,
        torch_lowp=reference.attention_lowp(q, k, v, scale, mask=mask),
        torch_factor=torch_factor,
        floor=floor,
    )
    if lse is None:
        return o_result, None
    seen = ~empty
    return o_result, check_close(f"LSE of {name}", lse[seen], lse_ref[seen], rtol=lse_rtol)
