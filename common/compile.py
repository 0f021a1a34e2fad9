"""Compiling stages: a per-shape cache for real launches, and compile-only reports that need no
GPU (fake tensors, any target arch), with counts of the instructions each stage is about."""

import dataclasses
import os
import re
import shutil
import subprocess
import tempfile
import time

import cutlass.cute as cute
import torch

from . import stages
from .arch import ARCH_OF_TRACK

_CACHE = {}


def cached_compile(key, kernel, *args):
    """cute.compile(kernel, *args) once per key (dtype, shape, tile config ...)."""
    fn = _CACHE.get(key)
    if fn is None:
        fn = cute.compile(kernel, *args)
        _CACHE[key] = fn
    return fn


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
        return {
            "error": text.strip().splitlines()[-1] if text.strip() else f"ptxas exit {p.returncode}"
        }
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


def compile_only(stage, track, dtype=torch.bfloat16, shape=None, scale=None, resources=True):
    """Compile stage `stage` of `track` for its arch (sm_90a / sm_100a) with fake tensors: no GPU
    needed. Returns a CompileReport with PTX, CUBIN and instruction counts."""
    if track not in ARCH_OF_TRACK:
        raise ValueError(f"track = {track!r}; allowed: {', '.join(ARCH_OF_TRACK)}")
    arch = ARCH_OF_TRACK[track]
    st = stages.stage(stage)
    shape = tuple(shape or st.compile_shape)
    mod = stages.track_module(stage, track)
    kernel, args = mod.compile_args(dtype, shape, scale)
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
