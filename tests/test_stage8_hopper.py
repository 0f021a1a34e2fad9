"""Stage 8 (Hopper): warp specialisation - a TMA producer warpgroup that gives its registers away
(setmaxnreg) and two consumer warpgroups on their own rows, the ring running ahead.

- Compile-only (no GPU), bf16 and fp16, D = 64 and 128, batch and packed: 384 threads with a
  register cap at entry (.reqntid 384, .minnctapersm 1), setmaxnreg.dec 24 and .inc 240 and not
  ignored by ptxas; stage 7's loop body (the same wgmma and exp2 counts); a wait after every
  GEMM and no named barrier but the consumers' own; the ring of 6 (D = 128) or 13 (D = 64)
  slots next to Q, 225 KiB; no spills.
- CPU: a model of the CTA's barrier protocol (common/tools/barrier_protocol.py) built from the
  kernel object (its kv_slots, ring_state, q_full_parity, q_empty_parity and arrival counts):
  the producer and each consumer warpgroup as programs of mbarrier waits and arrives with the
  hardware's parity rule, the ring slots' contents tracked, every interleaving explored for
  walks of several work tiles and ranges that wrap the ring. It must find no hang, no wrong
  read, no overwrite of a slot still being read, and no arrive left over; and it must fail each
  near miss: a lost arrive, a skipped wait, an arrival count that does not match the arriving
  warps, an arrive on the wrong barrier, a read of Q without its wait.
- GPU: stage 7's numerical tests run here from tests/test_stage7.py, O and LSE bit for bit
  against stage 7 from tests/test_stage_chain.py.
"""

import cutlass
import pytest
from attention_cases import DTYPES, dtype_id
from test_stage11_hopper import check_no_spills, compile_stage, statements

from common.tools.barrier_protocol import (
    NEAR_MISSES,
    arrival_counts,
    cta_programs,
    explore_cta,
    plant_near_miss,
)
from stages.stage8_warp_specialized import hopper

# ---------------------------------------------------------------- compile-only


@pytest.mark.parametrize("varlen", [False, True], ids=["batch", "packed"])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_compiles_warp_specialized(dtype, D, varlen):
    kernel, ptx, counts, res = compile_stage(
        hopper, dtype, D, kv_heads=2, varlen=varlen, causal=True
    )
    assert (kernel.mma_warpgroups, kernel.cta_tile, kernel.threads) == (2, (128, 128, D), 384)
    # A register cap at entry (65,536 / 384 -> 168), so that setmaxnreg works: the producer
    # warpgroup down to 24, the consumers up to 240: 128 x 24 + 256 x 240 = 64,512.
    assert ".reqntid 384, 1, 1" in ptx and ".minnctapersm 1" in ptx
    assert 128 * kernel.load_registers + kernel.mma_threads * kernel.mma_registers == 64512
    assert statements(ptx, r"setmaxnreg\.dec\.sync\.aligned\.u32\s+24;") != []
    assert statements(ptx, r"setmaxnreg\.inc\.sync\.aligned\.u32\s+240;") != []
    assert len(statements(ptx, r"setmaxnreg")) == 2
    # Stage 7's loop body: the same wgmma and exp2 counts, each GEMM waited for (wait_group 0
    # after QK^T and after PV), no turn barriers (256-thread bar.sync / bar.arrive on a
    # register): only barrier 0 once and the consumers' barrier 1 (epilogue x 2, zero_rows).
    assert counts["wgmma.mma_async"] == D // 16 + 8
    assert counts["ex2.approx"] == 64 + 2
    assert len(statements(ptx, r"wgmma\.wait_group\.sync\.aligned\s+0;")) == 2
    assert statements(ptx, r"bar\.(sync|arrive)\s+%r\d+") == []
    assert len(statements(ptx, r"(bar|barrier)\.sync\s+0;")) == 1
    assert len(statements(ptx, r"bar\.sync\s+1, 256;")) == (3 if varlen else 2)
    # Loads by TMA (Q, K, V; D = 128 splits each box in two 64-column halves); O by threads.
    assert counts["cp.async.bulk.tensor (load)"] == (3 if D == 64 else 6)
    assert counts["cp.async.bulk.tensor (store)"] == 0
    # The ring: as many 128-key tiles as fit in 227 KiB next to Q and 1 KiB of barriers.
    assert kernel.kv_slots == {64: 13, 128: 6}[D]
    assert kernel.shared_memory_bytes == 1024 + 128 * D * 2 * (1 + kernel.kv_slots) == 230400
    assert counts["mbarrier.init"] == 2 * kernel.kv_slots + 2
    check_no_spills(kernel, ptx, res)


# ---------------------------------------------------------------- the barrier protocol (CPU)


def small_ring_kernel(kv_slots=2, module=hopper):
    """The kernel object at D = 128 with its ring cut to kv_slots slots: the same code paths
    (ring_state, parities, counts), a state space small enough to explore with many wraps."""
    kernel = module.Sm90Kernel(cutlass.BFloat16, 128)
    kernel.kv_slots = kv_slots
    return kernel


WALKS = [[0], [1], [3], [2, 0, 1], [1, 3], [0, 0]]


@pytest.mark.parametrize("tiles", WALKS, ids=str)
@pytest.mark.parametrize("kv_slots", [2, 3])
def test_barrier_protocol_has_no_hang_and_no_race(tiles, kv_slots):
    kernel = small_ring_kernel(kv_slots)
    assert explore_cta(cta_programs(kernel, tiles), arrival_counts(kernel)) == set()


def test_barrier_protocol_at_the_kernels_own_ring():
    # The real ring (6 slots at D = 128), one work tile of 4 KV tiles: 8 entries, one wrap.
    kernel = hopper.Sm90Kernel(cutlass.BFloat16, 128)
    assert kernel.kv_slots == 6
    assert explore_cta(cta_programs(kernel, [4]), arrival_counts(kernel)) == set()


@pytest.mark.parametrize("change", sorted(NEAR_MISSES))
def test_barrier_protocol_model_catches_near_misses(change):
    # The model (common/tools/barrier_protocol.py) is not vacuous: each near miss - a lost
    # arrive, a skipped wait, an arrival count that does not match the arriving warps, an arrive
    # on the wrong barrier, a read of Q without its wait - is reported.
    programs, counts, fill_barrier = plant_near_miss(small_ring_kernel(2), change, [3])
    assert explore_cta(programs, counts, fill_barrier) != set(), change
