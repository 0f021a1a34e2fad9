def stage2(nb, setup, how_to_run, blackwell_intro):
    nb.md("""
        # Stage 2 - $QK^{\\top}$ only: the attention grid, rank-4 TMA, Q resident

        This notebook walks through `stages/stage2_qk/hopper.py` and `stages/stage2_qk/blackwell.py`:
        the GEMM of stage 1 turned into the first half of attention, $S = \\text{scale}\\cdot QK^{\\top}$
        for every (batch, head), written out in fp32. The notebook imports the stage files and displays
        them; it never pastes kernel code.
        """)
    nb.md(how_to_run)
    setup(nb, 2)
    nb.md("""
        ## 1. Objectives

        After this notebook you can:

        - lay out the attention grid: one CTA per (128-row Q tile, head, batch);
        - describe one TMA descriptor that serves every (head, batch) pair by viewing a (B, H, S, D)
          tensor as (S, D, H, B) - a rank-4 TMA;
        - explain operand reuse: the Q tile is loaded once and stays in shared memory while K tiles stream
          through a ring of `kv_slots`;
        - compute how much memory writing S costs, and why FlashAttention never writes it.

        ## 2. Previous stage recap

        Stage 1 computed $C = AB^{\\top}$ with both operands K-major: TMA loads into 128-byte-swizzled
        shared memory, `ab_buffers` buffers guarded by full/empty mbarriers, `wgmma` m64n256k16 issued by
        two warpgroups with the accumulator in registers (rows spread over quads of threads), and an
        epilogue through shared memory and a TMA store. On Blackwell the accumulator lived in TMEM and
        warps had roles (0-3 epilogue, 4 MMA, 5 TMA).

        ## 3. The math

        For each batch b and head h, with $Q_{b,h} \\in \\mathbb{R}^{S_q \\times D}$ and
        $K_{b,h} \\in \\mathbb{R}^{S_k \\times D}$:

        $$S_{b,h} = \\text{scale}\\cdot Q_{b,h} K_{b,h}^{\\top} \\in \\mathbb{R}^{S_q\\times S_k},
        \\qquad \\text{scale} = \\frac{1}{\\sqrt{D}} \\text{ unless given.}$$

        This is stage 1's GEMM with $A = Q$, $B = K$, $M = S_q$, $N = S_k$ and a reduction over only
        $K = D \\le 128$: a whole row of Q fits in one K tile, so there is no K loop any more. The loop
        runs over tiles of keys instead, and each step produces a finished $128 \\times 128$ tile of S.
        Work: $2\\,B H S_q S_k D$ operations. Output: $4\\,B H S_q S_k$ bytes of fp32. The cell below puts
        the two side by side.
        """)
    nb.code("""
        def qk_traffic(B, H, Sq, Sk, D):
            flops = 2 * B * H * Sq * Sk * D
            read = 2 * B * H * (Sq + Sk) * D  # bf16 Q and K, each read once if Q stays resident
            written = 4 * B * H * Sq * Sk     # fp32 S
            return flops, read, written

        for shape in [(4, 16, 1024, 1024, 128), (2, 16, 8192, 8192, 128)]:
            flops, read, written = qk_traffic(*shape)
            print(f"{shape}: {flops / 1e12:.2f} TFLOP, reads {read / 2**20:.0f} MiB, writes S = {written / 2**30:.2f} GiB "
                  f"-> {flops / (read + written):.0f} FLOP per byte of memory traffic")
        print("A GEMM of this size would be compute-bound; writing S makes QK^T memory-bound at D/2 FLOP per byte.")
        """)
    nb.md("""
        Writing S costs more than computing it: at $D = 128$ each fp32 score costs 4 bytes for 256
        operations, 64 operations per byte, while an H200 needs roughly 200 operations per byte of HBM
        traffic to keep its tensor cores busy (989 TFLOP/s datasheet dense bf16 over 4.8 TB/s datasheet
        HBM bandwidth). Stage 3 stops writing S: the softmax consumes it in registers.

        ## 4. What changes

        The stage file's docstring lists the changes with their numbers; the diff against stage 1 shows
        them in code (`make diff-2 TRACK=hopper`).
        """)
    nb.code("""
        nb.show_docstring(2, "hopper")
        """)
    nb.code("""
        nb.show_diff(2, "hopper")
        """)
    nb.md("""
        ## 5. Walkthrough

        ### 5.1 The attention grid

        One CTA per 128-row tile of Q of one head of one batch; each CTA produces the 128-row band of S
        for its rows, one 128-key tile at a time. `__init__` now takes the head dim: the K tile of the
        reduction is the whole row of Q, $b_K = D$.
        """)
    nb.code("""
        cfg = nb.show_config(2, "hopper")
        bM, bN, bK = cfg.get("cta_tile", (128, 128, 128))
        fig = plots.attention_grid(B=2, H=4, Sq=512, Sk=1024, D=bK, block_m=bM, block_n=bN, highlight=(1, 2, 1),
                                   grid_label="grid = (Sq / bM, H, B)")
        """)
    nb.md("""
        ### 5.2 One TMA descriptor for all heads: rank-4 views

        Q arrives as (B, H, Sq, D) with D contiguous. `__call__` *permutes the modes of the layout* - no
        data moves - to (Sq, D, H, B): a stack of (Sq, D) matrices indexed by (h, b). The TMA descriptor
        is built over this rank-4 view, and a CTA addresses its own matrix with the coordinates
        (row, 0, h, b). The same trick views S as (Sq, Sk, H, B).
        """)
    nb.code("""
        nb.show_source(2, "hopper", names=["Sm90Kernel.__call__"])
        """)
    nb.md("""
        ### 5.3 Q resident, K streaming

        Q is loaded once, on its own mbarrier, and every wgmma of the CTA reads it from shared memory. K
        tiles go through a ring of `kv_slots` slots - stage 1's `ab_buffers`, renamed because from stage 3
        on the ring carries K and V. Each step waits for its wgmmas (the whole S tile is needed before it
        can be stored), releases the K slot at once, and writes S through shared memory and TMA.
        """)
    nb.code("""
        D = bK
        kv_slots = cfg.get("kv_slots", 2)
        q_bytes, k_bytes, s_bytes = bM * D * 2, bN * D * 2, bM * bN * 4
        print(f"shared memory, D = {D}: Q {q_bytes // 1024} KB + {kv_slots} K slots x {k_bytes // 1024} KB "
              f"+ S staging {s_bytes // 1024} KB = {(q_bytes + kv_slots * k_bytes + s_bytes) // 1024} KB of 227 KB")
        nb.show_source(2, "hopper", section="# 2.")
        """)
    blackwell_intro(
        nb,
        4,
        "stage2_qk",
        """
        In stage 2 the MMA warp computes one S tile per K tile into TMEM (128 lanes x 128 fp32 columns) and
        waits until the softmax warps have read the previous S before overwriting it; the softmax warps
        `tcgen05.ld` their row, multiply by scale and store fp32 S. The Blackwell grid flattens (h, b)
        into one grid dimension.
        """,
    )
    nb.code("""
        fig = plots.blackwell_warp_roles(stage=2)
        fig = nb.show_tmem(2)
        """)
    nb.code("""
        nb.show_docstring(2, "blackwell")
        nb.show_diff(2, "blackwell")
        """)
    nb.code("""
        nb.show_cross_track_diff(2, max_lines=200)
        report = nb.compile_summary(2, "blackwell")
        """)
    nb.md("""
        ## 6. Run and verify

        S is written in fp32, so the only difference from the fp64 reference is the order of the fp32
        accumulation over D. **Expected:** a relative error around $10^{-7}$ to $10^{-6}$, far below the
        bound of $10^{-4}$. The output is poisoned with NaN before the launch, so an unwritten tile fails.
        """)
    nb.code("""
        result = nb.run_and_verify(2, (2, 4, 512, 512, 128))
        """)
    nb.code("""
        fig = nb.error_picture(2, result)
        """)
    nb.md("""
        ## 7. Measure

        TFLOP/s = $2BHS_qS_kD$ / time, against batched cuBLAS (`torch.matmul`) in the same run. Mind the
        difference: cuBLAS writes S in bf16 (2 bytes per score), stage 2 in fp32 (4 bytes). The project's
        anchors (H200, 2026-11-29) hold no $QK^{\\top}$ number; **expected:** both far below the GEMM
        numbers of stage 1 (682-779 TFLOP/s on the H200, 2026-11-29), their time dominated by writing S as
        computed in section 3. The more bytes per score, the lower: compare the two bars with that in
        mind. `make bench` measured 187 TFLOP/s for stage 2 against 407 for cuBLAS at
        (4, 16, 2048, 2048, 128) (H200, 2026-11-29; `docs/results/h200.md`).
        """)
    nb.code("""
        bench = nb.measure(2, [(4, 32, 2048, 2048, 64), (4, 16, 2048, 2048, 128)])
        """)
    nb.md("""
        ## 8. Exercises

        1. **Traffic.** For the FlashAttention paper shape (B = 2, H = 16, S = 8192, D = 128), how many
           GiB does S take in fp32? How long does writing it take at the H200's datasheet 4.8 TB/s, and how
           long does computing it take at 989 TFLOP/s?
        2. **Reuse.** How many times is each K tile read from global memory for one (b, h)? How many times
           would Q be read if it were streamed like K instead of kept resident?
        3. **Grid order.** The Hopper grid is (Q tiles, H, B) and CTAs are launched x-fastest. Which CTAs
           run at the same time, and which K tiles do they share in L2?
        4. **Head dim 64.** Recompute the shared-memory budget of 5.3 for D = 64. What else could the
           freed space hold?
        5. **Blackwell.** Why does the MMA warp have to wait for the softmax warps before it computes the
           next S tile, and what would a second S buffer in TMEM (`s_buffers = 2`) buy?
        """)
