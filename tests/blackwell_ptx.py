"""What the sm_100a PTX checks of the Blackwell stage tests share (a helper module: pytest collects
no tests here)."""

import dataclasses
import re

import pytest
from ptxas_checks import ptxas_ran

from common.tools.ptx import compile_only

# tcgen05.mma with A and B as shared-memory descriptors (QK) / with A in TMEM (PV)
QK_MMA = re.compile(r"tcgen05\.mma\.cta_group::1\.kind::f16\S*\s+\[%r\d+\],\s*%rd\d+,\s*%rd\d+,")
PV_MMA = re.compile(r"tcgen05\.mma\.cta_group::1\.kind::f16\S*\s+\[%r\d+\],\s*\[%r\d+\],\s*%rd\d+,")

FENCE_BEFORE = re.compile(r"tcgen05\.fence::before_thread_sync\b")
FENCE_AFTER = re.compile(r"tcgen05\.fence::after_thread_sync\b")


def global_stores(ptx):
    """The st.global statements of the PTX, their opcode only (st.global.v4.b32, ...)."""
    return [ln.split()[0] for ln in ptx.splitlines() if ln.strip().startswith("st.global")]


def tcgen05_fences(ptx):
    """(before, after): how many tcgen05.fence::before_thread_sync and
    tcgen05.fence::after_thread_sync statements the PTX holds."""
    lines = [ln.split("//", 1)[0] for ln in ptx.splitlines()]
    return (
        sum(1 for ln in lines if FENCE_BEFORE.search(ln)),
        sum(1 for ln in lines if FENCE_AFTER.search(ln)),
    )


def assert_tmem_freed_after_fence(ptx):
    """tcgen05.dealloc comes after a tcgen05.fence::before_thread_sync and the softmax warps' named
    barrier (bar.sync 1, 128), that fence after every tcgen05.ld and tcgen05.st."""
    lines = ptx.splitlines()

    def where(pattern):
        return [i for i, ln in enumerate(lines) if re.search(pattern, ln)]

    # the last fence: the per-tile ones (common/tmem.py) come before it
    fence = max(where(FENCE_BEFORE.pattern))
    (dealloc,) = where(r"tcgen05\.dealloc")
    assert max(where(r"tcgen05\.(ld|st)\.")) < fence < dealloc
    assert any(re.search(r"\bbar(rier)?\.sync\s+1,\s*128;", ln) for ln in lines[fence:dealloc])


# ---------------------------------------------------------------- tcgen05 fences along every path

# A statement's kind for the fence check; the first pattern that matches the statement (its
# predicate guard removed) decides.
_FENCE_CHECK_KINDS = (
    ("wait", re.compile(r"mbarrier\.(try_wait|test_wait)\b")),
    ("fence_after", FENCE_AFTER),
    ("fence_before", FENCE_BEFORE),
    ("tcgen05 op", re.compile(r"tcgen05\.(mma|ld|st)\.")),
    ("tcgen05 wait", re.compile(r"tcgen05\.wait::(ld|st)\b")),
    # a thread synchronisation that signals: an mbarrier arrive, a named barrier
    ("arrive", re.compile(r"(mbarrier\.arrive|(bar|barrier)(\.cta)?\.(sync|arrive|red))\b")),
)
_LABEL = re.compile(r"^(\$?[A-Za-z_][\w$]*):")
_GUARD = re.compile(r"^@!?%?\w+\s+")
# A branch between basic blocks. The branches to an inline-asm block's own labels (the retry loop
# of an mbarrier wait: LAB_WAIT, DONE) stay inside the one statement that block is here.
_BRANCH = re.compile(r"^bra(\.uni)?\s+(\$L__\w+)\s*;")


@dataclasses.dataclass(frozen=True)
class FenceGap:
    line: int  # 1-based, in the PTX text
    statement: str  # the tcgen05 op or the arrive
    missing: str  # "tcgen05.fence::after_thread_sync" or "tcgen05.fence::before_thread_sync"
    since: tuple  # the lines of the mbarrier wait / tcgen05.wait it follows without the fence

    def __str__(self):
        return (
            f"line {self.line}: {self.statement} without {self.missing} since line(s) {self.since}"
        )


def _fence_check_program(ptx):
    """The statements the fence check looks at, in PTX order: (line, kind, text or label)."""
    out = []
    for n, raw in enumerate(ptx.splitlines(), 1):
        text = raw.split("//", 1)[0].strip()
        if not text or text in ("{", "}"):
            continue
        m = _LABEL.match(text)
        if m:
            out.append((n, "label", m.group(1)))
            text = text[m.end() :].strip()
            if not text:
                continue
        guarded = bool(_GUARD.match(text))
        body = _GUARD.sub("", text)
        b = _BRANCH.match(body)
        if b:
            out.append((n, "branch if" if guarded else "branch", b.group(2)))
        elif re.match(r"(ret|exit)\s*;", body) and not guarded:
            out.append((n, "end", None))
        else:
            kind = next((k for k, rx in _FENCE_CHECK_KINDS if rx.match(body)), None)
            if kind:
                out.append((n, kind, body.rstrip(";").split()[0]))
    return out


def tcgen05_fence_gaps(ptx):
    """The places where the PTX misses a tcgen05 fence at a thread synchronisation
    (common/tmem.py), along every path of its control-flow graph (basic blocks from the labels
    and branches; loops and both sides of every branch followed to a fixed point):
    - a tcgen05.mma, tcgen05.ld or tcgen05.st that an mbarrier wait precedes on some path with no
      tcgen05.fence::after_thread_sync between them;
    - an mbarrier arrive or a named barrier that a tcgen05.wait::ld or tcgen05.wait::st precedes
      on some path with no tcgen05.fence::before_thread_sync between them.
    The paths run through every warp role's branch (the graph does not know which warp takes
    which), so a role's own waits and fences must do; a fence placed under a condition other
    than the access's shows up as a gap. A list of FenceGap, empty when every path is fenced."""
    stmts = _fence_check_program(ptx)
    if not stmts:
        return []
    labels = {arg: i for i, (_, kind, arg) in enumerate(stmts) if kind == "label"}

    def successors(i):
        _, kind, arg = stmts[i]
        fall = [i + 1] if i + 1 < len(stmts) else []
        if kind == "end":
            return []
        if kind == "branch":
            return [labels.get(arg)]
        if kind == "branch if":
            return [labels.get(arg)] + fall
        return fall

    # Per statement, on entry: the mbarrier waits and the tcgen05.wait::ld/st not yet followed
    # by their fence on some path to it (sets of PTX lines; union where paths meet).
    state = {0: (frozenset(), frozenset())}
    work, gaps = [0], set()
    while work:
        i = work.pop()
        waits, tc_waits = state[i]
        line, kind, text = stmts[i]
        if kind == "wait":
            waits = frozenset((line,))
        elif kind == "fence_after":
            waits = frozenset()
        elif kind == "tcgen05 op" and waits:
            gaps.add(FenceGap(line, text, "tcgen05.fence::after_thread_sync", tuple(sorted(waits))))
        elif kind == "tcgen05 wait":
            tc_waits = frozenset((line,))
        elif kind == "fence_before":
            tc_waits = frozenset()
        elif kind == "arrive" and tc_waits:
            gaps.add(
                FenceGap(line, text, "tcgen05.fence::before_thread_sync", tuple(sorted(tc_waits)))
            )
        for j in successors(i):
            assert j is not None, f"line {line}: a branch to a label the PTX does not hold"
            old = state.get(j)
            new = (waits, tc_waits) if old is None else (old[0] | waits, old[1] | tc_waits)
            if new != old:
                state[j] = new
                work.append(j)
    return sorted(gaps, key=lambda g: g.line)


def assert_tcgen05_fences(ptx, before, after):
    """The PTX holds exactly `before` tcgen05.fence::before_thread_sync and `after`
    tcgen05.fence::after_thread_sync, and tcgen05_fence_gaps finds no path without its fence."""
    assert tcgen05_fences(ptx) == (before, after)
    gaps = tcgen05_fence_gaps(ptx)
    assert gaps == [], "\n".join(map(str, gaps))


def fence_deletions_not_caught(ptx):
    """The tcgen05 fences of the PTX whose deletion (one at a time, from the PTX text)
    tcgen05_fence_gaps does not notice: (line, the statement after the fence) each."""
    lines = ptx.splitlines()
    base = len(tcgen05_fence_gaps(ptx))
    out = []
    for i, ln in enumerate(lines):
        if FENCE_BEFORE.search(ln.split("//", 1)[0]) or FENCE_AFTER.search(ln.split("//", 1)[0]):
            if len(tcgen05_fence_gaps("\n".join(lines[:i] + lines[i + 1 :]))) <= base:
                nxt = next(s.strip() for s in lines[i + 1 :] if s.strip() and "//" not in s)
                out.append((i + 1, nxt))
    return out


# ---------------------------------------------------------------- no spill, every configuration

# The configurations the no-spill tests of stages 9-12 compile, at B = 2, H = 8, Sk = 1024,
# Sq = 512 (pack-GQA: Sq = 16, decode-like, G = 4 heads per tile), bf16 and fp16, D = 64 and 128
SPILL_CONFIGS = {
    "no mask": {},
    "causal": {"causal": True, "kv_heads": 2},
    "window": {"window": (128, 0)},
    "packed": {"varlen": True, "causal": True, "kv_heads": 2},
    "pack-GQA": {"kv_heads": 2, "pack_gqa": True, "causal": True},
    "packed pack-GQA": {"varlen": True, "kv_heads": 2, "pack_gqa": True},
}


def assert_no_spill_in(stage, dtype, D, config):
    """Fails unless ptxas reports no spill store or load for Blackwell stage `stage` in
    configuration `config` (a key of SPILL_CONFIGS); skips where ptxas gives no result."""
    options = SPILL_CONFIGS[config]
    Sq = 16 if options.get("pack_gqa") else 512  # pack-GQA: decode-like, G = 4 heads per tile
    report = compile_only(stage, "blackwell", dtype=dtype, shape=(2, 8, Sq, 1024, D), **options)
    if not ptxas_ran(report.resources, "sm_100a"):
        pytest.skip(f"no ptxas result: {report.resources}")
    assert_no_spill(report)


def assert_no_spill(report, registers=None):
    """ptxas's report of a compile (report.resources) shows no spill store or load, and
    `registers` registers a thread at launch where given."""
    if registers is not None:
        assert report.resources["registers"] == registers, report.summary()
    assert report.resources["spill_stores"] == 0, report.summary()
    assert report.resources["spill_loads"] == 0, report.summary()
