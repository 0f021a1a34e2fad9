def stage5(nb, setup, how_to_run, blackwell_intro):
    nb.md("""
        # Stage 5 - online softmax: one pass, O rescaled, the log-sum-exp

        This notebook walks through `stages/stage5_online_softmax/hopper.py` and
        `stages/stage5_online_softmax/blackwell.py`: the FlashAttention-2 forward pass on the skeleton and
        the K/V ring of stage 4. Stage 4's statistics pass disappears; K is read once. The notebook
        imports the stage files and displays them; it never pastes kernel code.
        """)
    nb.md(how_to_run)
    setup(nb, 5)
    nb.md("""
        ## 1. Objectives

        After this notebook you can:

        - run the online softmax update by hand: running max $m$, rescale factor $\\alpha$, running sum
          $\\ell$, and the rescaled output $O$;
        - map the notation to the code once and for all: $m$ = `row_max`, $\\ell$ = `row_sum`,
          $\\alpha$ = `row_scale`;
        - say where the rescale happens: in registers on Hopper, in TMEM (load, multiply, store) on
          Blackwell;
        - produce the log-sum-exp per row, and say what it is for;
        - measure the speed-up over stage 4.

        ## 2. Previous stage recap

        Stage 4 handled any key length with one shared-memory ring in which $V_j$ overwrites $K_j$ (after
        the MMA reading $K_j$ has completed and released the slot). Its softmax was exact in two passes:
        pass 1 swept the K tiles for the row max and row sum (already with the online update of $m$ and
        $\\ell$, on two scalars per row), pass 2 swept K and V again and accumulated final probabilities
        into O. The price was a second $QK^{\\top}$: 1.5x the matrix work.

        ## 3. The math, step by step

        Process the KV tiles once. For one row, with $x = \\text{scale}\\cdot S$ and tile $j$:

        $$m_j = \\max\\big(m_{j-1},\\ \\max_{k\\in j} x_k\\big), \\qquad
        \\alpha_j = e^{\\,m_{j-1} - m_j},$$
        $$\\ell_j = \\alpha_j\\,\\ell_{j-1} + \\sum_{k\\in j} e^{\\,x_k - m_j}, \\qquad
        O_j = \\alpha_j\\,O_{j-1} + \\sum_{k\\in j} e^{\\,x_k - m_j}\\,V_k,$$

        starting from $m_{-1} = -\\infty$, $\\ell_{-1} = 0$, $O_{-1} = 0$ (so $\\alpha_0 = 0$). At the end
        $O = O_{n-1} / \\ell_{n-1}$ and $\\text{LSE} = m_{n-1} + \\ln \\ell_{n-1}$. Every term of $O_j$ and
        $\\ell_j$ is relative to the current max $m_j$: whenever a tile raises the max, everything
        accumulated so far is multiplied by $\\alpha_j < 1$ to move it to the new reference. The kernel
        does the same with powers of two: $\\alpha = 2^{(M_{\\text{old}} - M_{\\text{new}})\\,s_2}$ on the
        unscaled max $M$, $s_2 = \\text{scale}\\cdot\\log_2 e$.

        A small example on the CPU: 2 rows, 12 keys in tiles of 4, a head dim of 2. The table shows each
        step for row 0.
        """)
    nb.code("""
        torch.manual_seed(1)
        rows, Sk, D, tile = 2, 12, 2, 4
        x = torch.randn(rows, Sk, dtype=torch.float64) * 1.5   # x = scale * Q K^T, already scaled
        x[0, 4:8] += 2.0                                       # tile 1 raises row 0's max
        v = torch.randn(Sk, D, dtype=torch.float64)

        m = torch.full((rows,), -torch.inf, dtype=torch.float64)   # row_max
        l = torch.zeros(rows, dtype=torch.float64)                 # row_sum
        o = torch.zeros(rows, D, dtype=torch.float64)
        print(f"{'tile':>4} | {'m_old':>7} {'m_new':>7} {'alpha':>7} | {'l':>8} | O (row 0, unnormalised)")
        for j, j0 in enumerate(range(0, Sk, tile)):
            xj = x[:, j0:j0 + tile]
            m_new = torch.maximum(m, xj.amax(-1))
            alpha = torch.exp(m - m_new)                           # row_scale; 0 on the first tile
            p = torch.exp(xj - m_new[:, None])                     # not divided
            l = alpha * l + p.sum(-1)
            o = alpha[:, None] * o + p @ v[j0:j0 + tile]
            print(f"{j:>4} | {m[0]:7.3f} {m_new[0]:7.3f} {alpha[0]:7.4f} | {l[0]:8.4f} | "
                  + ", ".join(f"{val:+.4f}" for val in o[0].tolist()))
            m = m_new
        out, lse = o / l[:, None], m + torch.log(l)

        ref = torch.softmax(x, -1) @ v
        print(f"max |O / l - softmax(x) V| = {(out - ref).abs().max():.2e}, "
              f"max |LSE - logsumexp(x)| = {(lse - torch.logsumexp(x, -1)).abs().max():.2e}")
        """)
    nb.code("""
        fig = plots.online_softmax_trace(x[0].tolist(), tile=tile)
        """)
    nb.md("""
        ## 4. What changes

        The docstring gives the changes with their numbers; then the kernel diff against stage 4
        (`make diff-5 TRACK=hopper`): pass 1 disappears, `softmax` with final statistics gives way to
        `online_softmax` plus a rescale of O, the division moves to the epilogue, and LSE is written.
        """)
    nb.code("""
        nb.show_docstring(5, "hopper")
        """)
    nb.code("""
        nb.show_diff(5, "hopper")
        """)
    nb.md("""
        ## 5. Walkthrough

        ### 5.1 One pass through the ring

        Same ring as stage 4 (step t uses slot t % `kv_slots`, $K_j$ then $V_j$ in the same slot), but
        each K tile is loaded once. The model timeline, next to stage 4's:
        """)
    nb.code("""
        cfg = nb.show_config(5, "hopper")
        kv_slots = cfg.get("kv_slots", 2)
        fig = plots.kv_slot_timeline(kv_tiles=4, kv_slots=kv_slots, two_pass=False)
        fig = plots.kv_slot_timeline(kv_tiles=4, kv_slots=kv_slots, two_pass=True)
        """)
    nb.md("""
        ### 5.2 The update in registers

        `online_softmax` (shared with stage 4's pass 1) folds an S tile into `row_max` and `row_sum` and
        returns `row_scale`; the main loop multiplies the O accumulator by it before adding $P_jV_j$.
        Since a thread holds 2 rows of O, that is one multiply per O register ($D/2$ per row per thread)
        and one `exp2` per row per tile. The row max is reduced across the quad at once (all 4 threads
        must subtract the same max); the row sum stays a per-thread partial sum until the epilogue,
        because the rescale factor is the same for the 4 threads of a row.
        """)
    nb.code("""
        nb.show_source(5, "hopper", names=["Sm90Kernel.online_softmax"])
        """)
    nb.code("""
        nb.show_source(5, "hopper", section="# 2.")
        """)
    nb.md("""
        ### 5.3 The epilogue: O / l and the log-sum-exp

        $O / \\ell$ once per output element, then the LSE per row:
        $\\ln\\ell + m\\cdot\\text{scale} = (m\\,s_2 + \\log_2\\ell)\\ln 2$. The LSE is what a backward pass needs to recompute P without
        storing it, and what lets partial results over key ranges be combined (exercise 3).
        """)
    nb.code("""
        nb.show_source(5, "hopper", section="# 3.")
        """)
    blackwell_intro(
        nb,
        4,
        "stage5_online_softmax",
        """
        In stage 5 the difference is **where O is rescaled**: O lives in TMEM, so the softmax warps
        `tcgen05.ld` their row of O (32 columns at a time), multiply it by `row_scale` and `tcgen05.st`
        it back, between $PV_{j-1}$ completing and $PV_j$ starting - mbarriers order the three parties.
        Faster Blackwell kernels (FA4) hand this job to a separate *correction* warp group and skip the
        rescale when the max barely moves; this stage keeps it in the softmax warps. The ring is one
        entry per load, as in stage 4's Blackwell file.
        """,
    )
    nb.code("""
        bw = nb.kernel_config(5, "blackwell")
        fig = plots.kv_slot_timeline(kv_tiles=4, kv_slots=bw.get("kv_slots", 2), two_pass=False, slot_per="entry")
        fig = plots.blackwell_warp_roles(stage=5)
        fig = nb.show_tmem(5, head_dim=128, block_n=128)
        """)
    nb.code("""
        nb.show_docstring(5, "blackwell")
        nb.show_diff(5, "blackwell")
        """)
    nb.code("""
        nb.show_cross_track_diff(5, max_lines=200)
        report = nb.compile_summary(5, "blackwell")
        """)
    nb.md("""
        ## 6. Run and verify

        **Expected:** O within 3x PyTorch's own bf16 attention error against the fp64 reference (a few
        $10^{-3}$ relative), and the LSE (fp32, natural log) within $10^{-4}$ relative of
        `torch.logsumexp` in fp64 - it comes from fp32 statistics, so its error is around $10^{-6}$; a
        wrong base ($\\log_2$ instead of $\\ln$) or a missing scale would be off by far more.
        """)
    nb.code("""
        result = nb.run_and_verify(5, (2, 4, 512, 1024, 128))
        """)
    nb.code("""
        fig = nb.error_picture(5, result)
        """)
    nb.md("""
        ## 7. Measure

        Stage 5 against stage 4 and the baselines, the same shapes and inputs, timed in the same run.
        **Expected:** per KV tile stage 5 runs 2 MMA batches and 1 `exp2` per score where stage 4 ran 3
        and 2, so the ideal speed-up at $S_q = S_k$ is 1.5x. For scale, the project's anchors measured
        on the H200 on 2026-11-29 (D = 128, non-causal, S = 1k / 4k / 8k): SDPA flash (FA2) 325 / 337 /
        347 TFLOP/s, SDPA cuDNN 561 / 605 / 599, FA4 529 / 644 / 661. Stage 5 is FA2's algorithm without
        FA3's scheduling tricks (warp specialisation, ping-pong warpgroups, softmax overlapped with the
        next $QK^{\\top}$). Measured with `make bench` on the H200 on 2026-11-29
        (`docs/results/h200.md`): 435 / 491 / 524 TFLOP/s at S = 1k / 4k / 8k, 1.43x stage 4 at 8k,
        above SDPA flash (336 / 347 / 345) and below cuDNN and FA4 (608-673, 589-711) in the same run.
        """)
    nb.code("""
        bench = nb.measure(5, [(16, 16, 1024, 1024, 128), (4, 16, 4096, 4096, 128), (2, 16, 8192, 8192, 128)],
                           also_stages=(4,))
        """)
    nb.md("""
        ## 8. Exercises

        1. **Forget alpha.** In the CPU example of section 3, drop the rescale of O (or of $\\ell$). Which
           rows go wrong, and by how much? When would the mistake be invisible?
        2. **First tile.** $\\alpha_0 = e^{-\\infty} = 0$ multiplies an O that is still zero. Why does the
           kernel not need a special case, and what happens if O is uninitialised memory instead of 0?
        3. **Combining with the LSE.** Split the keys into two halves, run the online softmax on each to
           get $(O_a, \\text{LSE}_a)$ and $(O_b, \\text{LSE}_b)$, and combine them with weights
           $e^{\\text{LSE}_a - \\text{LSE}}$, $e^{\\text{LSE}_b - \\text{LSE}}$ where
           $\\text{LSE} = \\text{logaddexp}(\\text{LSE}_a, \\text{LSE}_b)$. The cell below checks it.
        4. **Instruction counts.** Compare `ex2.approx` and `wgmma.mma_async` in the compile summaries of
           stages 4 and 5 (`nb.compile_summary(4, "hopper")`). Which difference explains the speed-up?
        5. **Blackwell.** The Blackwell rescale reads and writes all of O in TMEM on every tile. FA4 skips
           it unless the max grew by more than a threshold. Why is that still exact at the end?
        """)
    nb.code("""
        # Exercise 3: combine two halves of the keys with their log-sum-exps (row-wise, fp64 on the CPU).
        def attend(x, v):
            lse = torch.logsumexp(x, -1)
            return torch.exp(x - lse[:, None]) @ v, lse

        o_a, lse_a = attend(x[:, :6], v[:6])
        o_b, lse_b = attend(x[:, 6:], v[6:])
        lse_ab = torch.logaddexp(lse_a, lse_b)
        o_ab = torch.exp(lse_a - lse_ab)[:, None] * o_a + torch.exp(lse_b - lse_ab)[:, None] * o_b
        print(f"max |combined - full| = {(o_ab - torch.softmax(x, -1) @ v).abs().max():.2e}")
        """)
