"""Reading compiled code without a GPU: compile any stage for sm_90a or sm_100a against fake
tensors, count the PTX instructions each stage is about, ask ptxas for registers and spills."""

import copy
import dataclasses
import os
import re
import shutil
import subprocess
import tempfile
import time

import cutlass.cute as cute
import torch

from common.arch import ARCH_OF_TRACK
from common.tools import stage_table

# Instruction families counted in the PTX; the regex matches at the start of a statement.
PTX_PATTERNS = {
    "wgmma.mma_async": r"wgmma\.mma_async",
    "wgmma.fence": r"wgmma\.fence",
    "wgmma.commit_group": r"wgmma\.commit_group",
    "wgmma.wait_group": r"wgmma\.wait_group",
    "tcgen05.mma": r"tcgen05\.mma",
    "tcgen05.ld": r"tcgen05\.ld",
    "tcgen05.st": r"tcgen05\.st",
    "tcgen05.alloc": r"tcgen05\.alloc",
    "tcgen05.dealloc": r"tcgen05\.dealloc",
    "tcgen05.commit": r"tcgen05\.commit",
    "cp.async.bulk.tensor (load)": r"cp\.async\.bulk\.tensor\.\dd\.shared::(?:cta|cluster)\.global",
    "cp.async.bulk.tensor (store)": r"cp\.async\.bulk\.tensor\.\dd\.global\.shared",
    "mbarrier.init": r"mbarrier\.init",
    "mbarrier.arrive": r"mbarrier\.arrive",
    "mbarrier.try_wait": r"mbarrier\.try_wait",
    "shfl.sync": r"shfl\.sync",
    "ex2.approx": r"ex2\.approx",
    "bar.sync": r"(?:bar|barrier)\.sync",
}


def count_ptx(ptx):
    """{family: number of statements} over the PTX text."""
    stmts = [ln.strip() for ln in ptx.splitlines()]
    stmts = [re.sub(r"^@!?%p\d+\s+", "", s) for s in stmts if s and not s.startswith("//")]
    counts = {}
    for name, pat in PTX_PATTERNS.items():
        rx = re.compile(pat)
        counts[name] = sum(1 for s in stmts if rx.match(s))
    return counts


def expect_tx_immediates(ptx):
    """The byte count armed by each mbarrier.arrive.expect_tx, in PTX order. The PTX moves the
    count into a register first (`mov.b32 %r7, 32768;`); a count that is not such an immediate
    is None."""
    out = []
    for reg in re.findall(
        r"mbarrier\.arrive\.expect_tx\.shared\.b64\s+\S+,\s*\[[^\]]+\],\s*(%r\d+);", ptx
    ):
        m = re.search(r"mov\.[bus]32\s+" + re.escape(reg) + r",\s*(\d+);", ptx)
        out.append(int(m.group(1)) if m else None)
    return out


def ptx_lines(ptx, pattern, limit=8):
    """Up to `limit` PTX statements matching `pattern` (for notebooks and test messages)."""
    rx = re.compile(pattern)
    return [ln.strip() for ln in ptx.splitlines() if rx.search(ln)][:limit]


# A tcgen05.mma with A from shared memory (a descriptor: QK) or from TMEM (an address: PV).
TCGEN05_QK = re.compile(
    r"tcgen05\.mma\.cta_group::1\.kind::f16\S*\s+\[%r\d+\],\s*%rd\d+,\s*%rd\d+,"
)
TCGEN05_PV = re.compile(
    r"tcgen05\.mma\.cta_group::1\.kind::f16\S*\s+\[%r\d+\],\s*\[%r\d+\],\s*%rd\d+,"
)


def tcgen05_mma_order(ptx):
    """The tcgen05.mma of a Blackwell attention kernel in program order: "Q" for an instruction
    of S = Q K^T (A from shared memory), "P" for one of O += P V (A = P from TMEM)."""
    out = []
    for ln in ptx.splitlines():
        if TCGEN05_QK.search(ln):
            out.append("Q")
        elif TCGEN05_PV.search(ln):
            out.append("P")
    return "".join(out)


def ptxas_resources(ptx, arch):
    """Registers, spills and static shared memory per kernel from `ptxas -v`, or None when ptxas
    is not installed. Dynamic shared memory (what the CuTe kernels use) is reported separately
    by the kernel object."""
    exe = shutil.which("ptxas")
    if exe is None:
        return None
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        p = subprocess.run(
            [exe, f"-arch={arch}", "-v", "-o", os.path.join(d, "k.cubin"), src],
            capture_output=True,
            text=True,
            timeout=300,
        )
    text = p.stdout + p.stderr
    if p.returncode != 0:
        lines = text.strip().splitlines()
        too_old = next((ln for ln in lines if "Unsupported .version" in ln), None)
        if too_old:
            # A ptxas older than the PTX ISA the DSL writes (CUDA 13.0's ptxas reads up to ISA
            # 9.0; the DSL's cu13 build writes 9.4): not an error of the kernel.
            return {
                "error": f"{exe} cannot assemble this PTX ({too_old.split(':', 2)[-1].strip()})",
                "ptxas_too_old": True,
            }
        return {"error": lines[-1] if lines else f"ptxas exit {p.returncode}"}
    res = {}
    m = re.search(r"Used (\d+) registers", text)
    if m:
        res["registers"] = int(m.group(1))
    m = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", text)
    if m:
        res["spill_stores"], res["spill_loads"] = int(m.group(1)), int(m.group(2))
    m = re.search(r"(\d+) bytes stack frame", text)
    if m:
        res["stack_frame"] = int(m.group(1))
    return res


@dataclasses.dataclass
class CompileReport:
    stage: int
    track: str
    arch: str
    dtype: str
    shape: tuple
    seconds: float
    ptx: str
    cubin: bytes
    counts: dict
    resources: dict | None
    shared_memory_bytes: int | None

    def summary(self):
        keys = [k for k, v in self.counts.items() if v]
        parts = [f"{k} x{self.counts[k]}" for k in keys]
        res = ""
        if self.resources and "registers" in self.resources:
            r = self.resources
            res = f"; {r['registers']} regs, spills {r.get('spill_stores', 0)}/{r.get('spill_loads', 0)} B"
        smem = f"; smem {self.shared_memory_bytes} B" if self.shared_memory_bytes else ""
        return (
            f"stage {self.stage} {self.track} ({self.arch}, {self.seconds:.1f} s){smem}{res}: "
            + ", ".join(parts)
        )


class _ArchOverride:
    """Point CuTe DSL at a target arch for one compile, then restore what it had."""

    def __init__(self, arch):
        from cutlass.cutlass_dsl import CuTeDSL

        self.envar = CuTeDSL._get_dsl().envar
        self.arch = arch

    def __enter__(self):
        self.old = self.envar._arch
        self.envar.arch = self.arch

    def __exit__(self, *exc):
        self.envar._arch = self.old


def compile_for_arch(kernel, args, arch):
    """cute.compile(kernel, *args) for `arch` ('sm_90a' or 'sm_100a'), no GPU needed when args are
    fake tensors; returns (ptx text, cubin bytes). The kernel object keeps what tracing set on it."""
    with tempfile.TemporaryDirectory() as dump, _ArchOverride(arch):
        compiled = cute.compile(
            kernel, *args, options=f"--gpu-arch {arch} --keep-ptx --keep-cubin --dump-dir {dump}"
        )
        return compiled.artifacts.PTX, compiled.artifacts.CUBIN


def compile_only(
    stage, track, dtype=torch.bfloat16, shape=None, scale=None, resources=True, **options
):
    """Compile stage `stage` of `track` for its arch (sm_90a / sm_100a) with fake tensors: no GPU
    needed. Returns a CompileReport with PTX, CUBIN and instruction counts. `options` go to the
    stage's compile_args by keyword (a later stage's causal=..., window=..., head counts)."""
    if track not in ARCH_OF_TRACK:
        raise ValueError(f"track = {track!r}; allowed: {', '.join(ARCH_OF_TRACK)}")
    arch = ARCH_OF_TRACK[track]
    st = stage_table.stage(stage)
    shape = tuple(shape or st.compile_shape)
    mod = stage_table.track_module(stage, track)
    kernel, args = mod.compile_args(dtype, shape, scale, **options)
    t0 = time.perf_counter()
    ptx, cubin = compile_for_arch(kernel, args, arch)
    seconds = time.perf_counter() - t0
    return CompileReport(
        stage,
        track,
        arch,
        str(dtype).replace("torch.", ""),
        shape,
        seconds,
        ptx,
        cubin,
        count_ptx(ptx),
        ptxas_resources(ptx, arch) if resources else None,
        getattr(kernel, "shared_memory_bytes", None),
    )


def compile_ffi_for_arch(kernel, args, arch):
    """What cached_compile_ffi compiles, for `arch` and without a GPU (args: CPU torch tensors
    with the layouts of a launch, None and scalars): the TVM-FFI function object. The compile-only
    check of the launch path on both tracks (tests/test_compile_cache.py)."""
    from common.cute_interop import fake_like, fake_stream

    fakes = [fake_like(a) if isinstance(a, torch.Tensor) else a for a in args]
    with _ArchOverride(arch):
        return cute.compile(
            copy.deepcopy(kernel),  # traced on a copy, as cached_compile_ffi does
            *fakes,
            fake_stream(env=True),
            options=f"--enable-tvm-ffi --gpu-arch {arch}",
        )


def code_only(ptx):
    """The PTX without its comment lines and with every entry's name (which carries the module's
    and the kernel class's names) replaced by K: two kernels built from different classes compare
    equal here exactly when their code is the same."""
    lines = (ln for ln in ptx.splitlines() if not ln.strip().startswith("//"))
    return re.sub(r"kernel_cutlass_kernel_\w+", "K", "\n".join(lines))
