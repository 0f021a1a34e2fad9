"""What the sm_100a PTX checks of the Blackwell stage tests share (a helper module: pytest collects
no tests here)."""

import re

# tcgen05.mma with A and B as shared-memory descriptors (QK) / with A in TMEM (PV)
QK_MMA = re.compile(r"tcgen05\.mma\.cta_group::1\.kind::f16\S*\s+\[%r\d+\],\s*%rd\d+,\s*%rd\d+,")
PV_MMA = re.compile(r"tcgen05\.mma\.cta_group::1\.kind::f16\S*\s+\[%r\d+\],\s*\[%r\d+\],\s*%rd\d+,")


def global_stores(ptx):
    """The st.global statements of the PTX, their opcode only (st.global.v4.b32, ...)."""
    return [ln.split()[0] for ln in ptx.splitlines() if ln.strip().startswith("st.global")]


def assert_tmem_freed_after_fence(ptx):
    """tcgen05.dealloc comes after tcgen05.fence::before_thread_sync and the softmax warps'
    named barrier (bar.sync 1, 128), and the fence after every tcgen05.ld and tcgen05.st."""
    lines = ptx.splitlines()

    def where(pattern):
        return [i for i, ln in enumerate(lines) if re.search(pattern, ln)]

    (fence,) = where(r"tcgen05\.fence::before_thread_sync")
    (dealloc,) = where(r"tcgen05\.dealloc")
    assert max(where(r"tcgen05\.(ld|st)\.")) < fence < dealloc
    assert any(re.search(r"\bbar(rier)?\.sync\s+1,\s*128;", ln) for ln in lines[fence:dealloc])
