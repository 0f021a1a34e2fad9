def stage3(nb, setup, how_to_run, blackwell_intro):
    nb.md("""
        # Stage 3 - softmax over one KV tile: row reductions in the accumulator layout, P in registers

        This notebook walks through `stages/stage3_softmax/hopper.py` and
        `stages/stage3_softmax/blackwell.py`: full attention
        $O = \\text{softmax}(\\text{scale}\\cdot QK^{\\top})V$ for a key length that fits in one KV
        tile ($S_k \\le 128$). It imports the stage files and displays them; it never pastes kernel
        code.
        """)
    nb.md(how_to_run)
    setup(nb, 3)
    nb.md("""
        ## 1. Objectives

        After this notebook you can:

        - compute a row max and a row sum over the `wgmma` accumulator layout, where a row is spread over
          the 4 threads of a quad (2 butterfly shuffles);
        - replace `exp` by `exp2` with $\\log_2 e$ folded into the scale (one FFMA and one `ex2.approx`
          per score);
        - explain why P never leaves the registers on Hopper: the accumulator fragment of $S$ *is* the A
          operand fragment of the next `wgmma`;
        - say what the Blackwell kernel does instead: one thread per row reads S from TMEM, writes P back
          over S in TMEM, and the MMA reads P from TMEM.

        ## 2. Previous stage recap

        Stage 2 computed $S = \\text{scale}\\cdot QK^{\\top}$ per (batch, head) with one CTA per 128-row Q
        tile: Q loaded once and resident in shared memory, K tiles streaming through `kv_slots` slots,
        S written to global memory in fp32 - and we saw that writing S makes the kernel memory-bound.
        Stage 3 keeps S on chip and consumes it.

        ## 3. The math

        For one row i of one (batch, head), with $x_j = \\text{scale}\\cdot S_{ij}$:

        $$m_i = \\max_j x_j, \\qquad \\ell_i = \\sum_j e^{x_j - m_i}, \\qquad
        P_{ij} = \\frac{e^{x_j - m_i}}{\\ell_i}, \\qquad O_i = \\sum_j P_{ij} V_j.$$

        Subtracting $m_i$ changes nothing mathematically ($\\text{softmax}(x) = \\text{softmax}(x - c)$)
        but keeps every exponent $\\le 0$, so nothing overflows. In code, $m$ is `row_max` and $\\ell$ is
        `row_sum`. The exponential is computed as a power of two, with the scale and $\\log_2 e$ folded
        into one constant $s_2 = \\text{scale}\\cdot\\log_2 e$ (`scale_log2`):

        $$e^{\\text{scale}(S_{ij} - M_i)} = 2^{\\,S_{ij} s_2 - M_i s_2}, \\qquad M_i = \\max_j S_{ij},$$

        one fused multiply-add and one `ex2.approx` per score. The max can be taken on the unscaled S
        because scale > 0. Finally the division by $\\ell_i$ is done once per output element at the end
        ($D$ divisions per row) instead of once per probability ($S_k$ per row).
        """)
    nb.code("""
        # The identities above, on the CPU in fp32.
        import math

        torch.manual_seed(0)
        D = 128
        scale = D ** -0.5
        scale_log2 = scale * math.log2(math.e)
        S = torch.randn(4, 128) * 1000                     # logits of a few hundred after scaling, on purpose
        naive = torch.exp(scale * S) / torch.exp(scale * S).sum(-1, keepdim=True)
        M = S.amax(-1, keepdim=True)
        P = torch.exp2(S * scale_log2 - M * scale_log2)     # what the kernel computes
        stable = P / P.sum(-1, keepdim=True)
        ref = torch.softmax(scale * S.double(), -1)
        print(f"max |stable - softmax| = {(stable - ref).abs().max():.2e}")
        print(f"exp(scale * S) overflows in fp32 for scale * S > 88.7: here max(scale * S) = {(scale * S).max():.1f}, "
              f"naive has {int((~torch.isfinite(naive)).sum())} non-finite entries")
        """)
    nb.md("""
        ## 4. What changes

        The stage file's docstring gives the changes with their numbers; the diff is
        `make diff-3 TRACK=hopper`.
        """)
    nb.code("""
        nb.show_docstring(3, "hopper")
        """)
    nb.code("""
        nb.show_diff(3, "hopper")
        """)
    nb.md("""
        ## 5. Walkthrough

        ### 5.1 A row lives in a quad: the row max and row sum

        Each warpgroup owns 64 rows of the 128 x 128 S tile as a 64 x 128 `wgmma` accumulator: thread t
        of warp w holds rows $16w + \\lfloor t/4\\rfloor$ and that $+8$, 32 columns of each (pairs of
        neighbours every 8 columns). The 4 threads of a quad (lanes $4r \\ldots 4r+3$) hold one row
        between them. So the row max is a max over the thread's own 32 values, then two butterfly
        shuffles inside the quad: exchange with lane XOR 2, then with lane XOR 1 (the order of
        `cute.arch.warp_reduction`). After that all four lanes hold the row's max; no shared memory,
        no barrier. The row sum is reduced the same way.
        """)
    nb.code("""
        fig = plots.wgmma_accumulator_layout(n=32, thread=5)
        fig = plots.quad_reduction(op="max")
        """)
    nb.md("""
        The softmax in the stage file: `rows_view` regroups the accumulator registers as (rows,
        columns) of this thread, and `warp_reduction_max(..., threads_in_group=4)` is the pair of
        shuffles.
        """)
    nb.code("""
        nb.show_source(3, "hopper", names=["Sm90Kernel.rows_view", "Sm90Kernel.softmax"])
        """)
    nb.md("""
        ### 5.2 P stays in registers

        The second GEMM is $O = PV$ with P as the A operand. `wgmma` can take A from registers, in a
        fixed fragment layout: for a 64 x 16 block of A, thread t holds rows $\\lfloor t/4\\rfloor$ and
        $+8$, columns $2(t \\bmod 4) + \\{0,1,8,9\\}$. That is exactly where the same thread's
        accumulator values of S sit for those 16 keys. So no data moves between threads: the kernel
        rounds P to bf16 and *views* the accumulator as the A operand (`acc_as_operand_a`). The picture
        shows one thread's values in both roles.
        """)
    nb.code("""
        fig = plots.p_register_path(n=64, thread=5)

        # The two fragments agree for every thread and every 16-key block (CuTe's atom layouts).
        n = 128
        for t in range(128):
            c_frag = {(r, c): v for v, r, c in plots.wgmma_c_coords(t, n)}
            for j in range(n // 16):
                for v, r, k in plots.wgmma_a_coords(t):
                    assert c_frag[(r, 16 * j + k)] == 8 * j + v
        print("for all 128 threads: A value v of k-block j is accumulator register 8 j + v")
        nb.show_source(3, "hopper", names=["Sm90Kernel.acc_as_operand_a"])
        """)
    nb.md("""
        ### 5.3 The main loop, masking and the epilogue

        One KV tile: wait for Q and K, $S = QK^{\\top}$, mask keys beyond $S_k$ with $-\\infty$ (they get
        weight $2^{-\\infty} = 0$), softmax, wait for V, $O = PV$, then $O / \\ell$ in the epilogue.
        """)
    nb.code("""
        nb.show_source(3, "hopper", section="# 2.")
        nb.show_source(3, "hopper", names=["Sm90Kernel.mask_keys"])
        """)
    nb.code("""
        nb.show_source(3, "hopper", section="# 3.")
        """)
    blackwell_intro(
        nb,
        4,
        "stage3_softmax",
        """
        In stage 3 the difference is at its largest. **S and P live in TMEM, O too.** Thread t of softmax
        warp w owns row $32w + t$: `tcgen05.ld.32x32b` brings its whole row of S into 128 registers, so
        the row max and sum are per-thread loops - no shuffles. P is written back into TMEM *over S*
        with `tcgen05.st` (two bf16 per 32-bit column, so 64 columns), and the MMA warp issues
        `tcgen05.mma` with A = P from TMEM and B = V from shared memory, accumulating O in TMEM. The
        hand-overs S ready -> P ready -> O ready are mbarriers. The picture of TMEM below takes its
        column offsets from the stage file's `Sm100Kernel` when it exposes them.
        """,
    )
    nb.code("""
        fig = plots.blackwell_warp_roles(stage=3)
        fig = nb.show_tmem(3, head_dim=128, block_n=128)
        """)
    nb.code("""
        nb.show_docstring(3, "blackwell")
        nb.show_diff(3, "blackwell")
        """)
    nb.code("""
        nb.show_cross_track_diff(3, max_lines=200)
        report = nb.compile_summary(3, "blackwell")
        """)
    nb.md("""
        ## 6. Run and verify

        P is rounded to bf16 before the second GEMM and O is rounded to bf16 at the end, like PyTorch's
        own bf16 attention. **Expected:** a relative error of a few $10^{-3}$, at most 3x the error of
        PyTorch's bf16 SDPA (math backend) against the same fp64 reference, and below $10^{-2}$. Without
        a GPU, the error map shows PyTorch's bf16 attention on the CPU: the yardstick.
        """)
    nb.code("""
        result = nb.run_and_verify(3, (2, 4, 512, 128, 128))
        """)
    nb.code("""
        fig = nb.error_picture(3, result)
        """)
    nb.md("""
        ## 7. Measure

        Attention FLOPs are $4BHS_qS_kD$ (two GEMMs). With $S_k = 128$ each CTA does a single KV tile,
        so the kernel is dominated by reading Q and writing O, not by the tensor cores; torch SDPA (flash
        and cuDNN backends) is timed on the same inputs in the same run. The project's anchors (H200,
        2026-11-29) have no $S_k = 128$ shape; **expected:** a few hundred TFLOP/s at most for every
        kernel here, far below the 600+ TFLOP/s that cuDNN and FA4 reach at long sequences (anchors,
        H200, 2026-11-29) - the point of this stage is correctness, stages 4 and 5 bring long
        sequences. `make bench` measured 367 TFLOP/s at (16, 16, 4096, 128, 128)
        against SDPA flash 239 and cuDNN 398 in the same run (H200, 2026-11-29).
        """)
    nb.code("""
        bench = nb.measure(3, [(16, 32, 4096, 128, 64), (16, 16, 4096, 128, 128)])
        """)
    nb.md("""
        ## 8. Exercises

        1. **Shuffles.** In `quad_reduction`, which lanes exchange values in the first and in the second
           shuffle? Why would the other order (XOR 1 first, then XOR 2) give the same result? Find the
           `shfl.sync.bfly` instructions in the compile summary of section 6 (no GPU) or with
           `nb.compile_summary(3, "hopper")`.
        2. **exp vs exp2.** Find the `ex2.approx` instructions in the compile summary (section 6 without a
           GPU). How many per thread per KV tile would you expect, and how many FFMAs would plain `exp`
           add?
        3. **Too long.** Call the entry with $S_k = 129$ on a GPU: what does the error message say, and
           why is refusing better than computing a wrong answer?
        4. **Registers.** The docstring counts S 64 + O 64 + P 32 fp32-sized registers per thread at
           D = 128. Compare with the registers/thread in the compile summary. What would a 256-key tile
           cost?
        5. **Blackwell.** Why does the Blackwell softmax need no shuffles? What does it pay instead
           (registers per thread for one row of 128 scores)?
        """)
