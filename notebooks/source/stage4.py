def stage4(nb, setup, how_to_run, blackwell_intro):
    nb.md("""
        # Stage 4 - KV-tile interleaving: V overwrites K in one shared-memory ring, exact two-pass softmax

        This notebook walks through `stages/stage4_kv_interleave/hopper.py` and
        `stages/stage4_kv_interleave/blackwell.py`: attention for any key length, with K and V tiles
        sharing one ring of shared-memory slots, and the synchronisation hazard that comes with it. It
        imports the stage files and displays them; it never pastes kernel code.
        """)
    nb.md(how_to_run)
    setup(nb, 4)
    nb.md("""
        ## 1. Objectives

        After this notebook you can:

        - stream K and V tiles of any length through one ring of `kv_slots` shared-memory slots, a slot
          receiving $K_j$ and then $V_j$;
        - state the hazard and its fix: TMA may write $V_j$ over $K_j$ only after every MMA reading
          $K_j$ has *completed* - issuing, even committing, a `wgmma` does not mean it has read its
          operands;
        - keep the phase bits of barriers whose slots are used unevenly (once per tile in pass 1, twice in
          pass 2);
        - compute an exact softmax over many KV tiles in two passes, and say what the second pass costs;
        - recognise the defects of the seed draft of the Blackwell kernel in a timeline.

        ## 2. Previous stage recap

        Stage 3 computed $O = \\text{softmax}(\\text{scale}\\cdot QK^{\\top})V$ when all keys fit in one
        128-key tile: row max and row sum over quads of threads with two shuffles, `exp2` with
        $\\log_2 e$ folded into the scale, P reused in registers as the A operand of $PV$ (Hopper) or
        written over S in TMEM (Blackwell), and one division by the row sum at the end. K and V each had
        their own slot. Longer sequences were refused.

        ## 3. The math

        With $S_k$ keys split into tiles $j = 0 \\ldots n-1$ of 128, a row's softmax needs the max and
        the sum over *all* tiles before any probability is final. Stage 4 gets them first, then uses them
        (for one row; $x = \\text{scale}\\cdot S$):

        **Pass 1** (K only), tile by tile:
        $$m \\leftarrow \\max\\big(m, \\max_{k \\in j} x_k\\big), \\qquad
        \\ell \\leftarrow \\ell\\, e^{m_{\\text{old}} - m} + \\sum_{k \\in j} e^{x_k - m}$$
        (two scalars per row; when the max grows, the sum so far is rescaled).

        **Pass 2** (K and V), tile by tile, with the final $m$ and $\\ell$:
        $$P_{jk} = \\frac{e^{x_k - m}}{\\ell}, \\qquad O \\leftarrow O + P_j V_j .$$

        Every P is final when it is computed, so O needs no rescaling and no division at the end. The
        price: $QK^{\\top}$ is computed twice, so the matrix work is $6BHS_qS_kD$ instead of $4BHS_qS_kD$
        (1.5x), and K is read twice. The CPU check below runs both passes on random data.
        """)
    nb.code("""
        # Two-pass exact softmax over KV tiles, one (batch, head), on the CPU in fp64.
        torch.manual_seed(0)
        Sq, Sk, D, tile = 4, 10, 3, 4
        q, k, v = torch.randn(Sq, D, dtype=torch.float64), torch.randn(Sk, D, dtype=torch.float64), torch.randn(Sk, D, dtype=torch.float64)
        scale = D ** -0.5
        m = torch.full((Sq,), -torch.inf, dtype=torch.float64)
        l = torch.zeros(Sq, dtype=torch.float64)
        for j0 in range(0, Sk, tile):                                  # pass 1: K only
            x = scale * q @ k[j0:j0 + tile].T
            m_new = torch.maximum(m, x.amax(-1))
            l = l * torch.exp(m - m_new) + torch.exp(x - m_new[:, None]).sum(-1)
            m = m_new
        o = torch.zeros(Sq, D, dtype=torch.float64)
        for j0 in range(0, Sk, tile):                                  # pass 2: K and V
            x = scale * q @ k[j0:j0 + tile].T
            o += torch.exp(x - m[:, None]) / l[:, None] @ v[j0:j0 + tile]
        ref = torch.softmax(scale * q @ k.T, -1) @ v
        print(f"tiles of {tile} keys over Sk = {Sk} (the last one partial): max |O - softmax(QK^T)V| = {(o - ref).abs().max():.2e}")
        """)
    nb.md("""
        ## 4. What changes

        The docstring lists the changes with their numbers; the diff is `make diff-4 TRACK=hopper`.
        """)
    nb.code("""
        nb.show_docstring(4, "hopper")
        """)
    nb.code("""
        nb.show_diff(4, "hopper")
        """)
    nb.md("""
        ## 5. Walkthrough

        ### 5.1 One ring for K and V

        In stage 3, Q, K and V each had a slot. For long sequences, separate K and V rings of
        `kv_slots` tiles each would cost Q + 2 x `kv_slots` tiles of shared memory. Stage 4 keeps one
        ring: step t of the ring uses slot t % `kv_slots` - in pass 2 twice: $K_j$ lands, $S = QK_j^{\\top}$
        reads it, the slot is released, $V_j$ lands in the same slot, $O \\mathrel{+}= PV_j$ reads it, the
        slot is released and refilled with the K tile `kv_slots` steps ahead.
        """)
    nb.code("""
        cfg = nb.show_config(4, "hopper")
        bM, bN, D = cfg.get("cta_tile", (128, 128, 128))
        kv_slots = cfg.get("kv_slots", 2)
        tile_kb = bN * D * 2 // 1024
        print(f"D = {D}: Q {bM * D * 2 // 1024} KB + {kv_slots} slots x {tile_kb} KB = {bM * D * 2 // 1024 + kv_slots * tile_kb} KB; "
              f"separate K and V rings of {kv_slots}: {bM * D * 2 // 1024 + 2 * kv_slots * tile_kb} KB; "
              f"K and V of Sk = 1024 resident: {bM * D * 2 // 1024 + 2 * 1024 * D * 2 // 1024} KB (of 227 KB)")
        """)
    nb.md("""
        The timeline of one CTA, as a model (durations illustrative, not measured): pass 1 streams the K
        tiles, pass 2 streams $K_j'$ (the same tiles again) and $V_j$. Watch slot 0 or 1 in pass 2: it
        receives a K tile (orange), is released (▲) after the QK MMA, then receives the V tile (green)
        of the same step. Note also the wait of the MMA lane before each PV: $V_j$ can only start
        loading once $QK_j$ is done, and only the softmax is there to hide its latency.
        """)
    nb.code("""
        fig = plots.kv_slot_timeline(kv_tiles=3, kv_slots=kv_slots, two_pass=True)
        """)
    nb.md("""
        ### 5.2 The hazard: release after the MMA completes, load V after the release

        `wgmma` is asynchronous: `commit_group` closes a batch of issued MMAs, it does not wait for them.
        The tensor cores may still be reading $K_j$ from shared memory when the warp moves on. So the
        order in pass 2 is: issue the QK wgmmas, `wgmma.wait_group 0` (they have completed, $K_j$ is no
        longer needed), *then* release the slot (an arrive per warp on its empty barrier), and the
        producer waits for all those arrives before it announces $V_j$'s bytes and starts the TMA load.
        Skip the wait or the release and TMA silently overwrites $K_j$ under the tensor cores - this is
        what the seed draft of the Blackwell kernel did (it loaded $V_j$ under $K_j$'s barrier). The
        same model with the V load not waiting for the release shows the race:
        """)
    nb.code("""
        fig = plots.kv_slot_timeline(kv_tiles=2, kv_slots=kv_slots, two_pass=True, v_waits_for_release=False)
        """)
    nb.md("""
        Phase bookkeeping: a barrier completes one phase per use of its slot, and waiters wait for a phase
        parity. In pass 2 a slot is used twice per step, so the usual `PipelineState` (one flip per lap of
        the ring) no longer matches; the stage keeps one parity bit per slot (`slot_phase`) and builds the
        state of each use with `slot_state`. The producer step and the main loop:
        """)
    nb.code("""
        nb.show_source(4, "hopper", names=["Sm90Kernel.slot_state", "Sm90Kernel.load_tiles"])
        """)
    nb.code("""
        nb.show_source(4, "hopper", section="# 2.")
        """)
    nb.md("""
        ### 5.3 The statistics of pass 1

        Pass 1 folds each S tile into `row_max` and `row_sum` (m and $\\ell$) with `online_softmax` - the
        same update stage 5 will use for O as well. Pass 2 uses stage 3's `softmax` with the final
        statistics, dividing by `row_sum` inside P.
        """)
    nb.code("""
        nb.show_source(4, "hopper", names=["Sm90Kernel.online_softmax"])
        """)
    blackwell_intro(
        nb,
        4,
        "stage4_kv_interleave",
        """
        In stage 4 the Blackwell file finishes the user's seed draft (warp roles 0-3 / 4 / 5, Q loaded
        once, a 2-slot K/V ring with V viewed over K's shared memory, S, P and O in TMEM) and fixes its
        defects, listed in its docstring: V loaded into K's slot under K's barrier before the QK MMA had
        read K; producer and consumer disagreeing on ring entries per tile; the ring's byte count
        including Q's bytes; S accumulated across KV tiles; one CTA. Its ring differs from Hopper's:
        every load is its own ring entry (entry e in slot e % `kv_slots`), so $V_j$ goes to the slot
        *after* $K_j$'s, and a slot is released by `tcgen05.commit` when the MMA that read it completes.
        """,
    )
    nb.code("""
        bw = nb.kernel_config(4, "blackwell")
        print("ring entries per KV tile, producer (pass 1, pass 2):", bw.get("kv_producer_entries"),
              "| consumer:", bw.get("kv_consumer_entries"))
        fig = plots.kv_slot_timeline(kv_tiles=3, kv_slots=bw.get("kv_slots", 2), two_pass=True, slot_per="entry")
        """)
    nb.code("""
        fig = plots.blackwell_warp_roles(stage=4)
        fig = nb.show_tmem(4, head_dim=128, block_n=128)
        """)
    nb.code("""
        nb.show_docstring(4, "blackwell")
        nb.show_diff(4, "blackwell")
        """)
    nb.code("""
        nb.show_cross_track_diff(4, max_lines=200)
        report = nb.compile_summary(4, "blackwell")
        """)
    nb.md("""
        ## 6. Run and verify

        **Expected:** like stage 3, a relative error of a few $10^{-3}$ (bf16 P and bf16 O), within 3x
        PyTorch's own bf16 attention error against the fp64 reference. With $S_k = 1024$ there are 8 KV
        tiles, so a slot is reused many times: a phase bookkeeping error shows up as a wrong result or a
        hang (the check has a deadline, a hang fails after 60 s instead of blocking). Run
        `make sanitize` on a GPU for compute-sanitizer's race and synchronisation checks.
        """)
    nb.code("""
        result = nb.run_and_verify(4, (2, 4, 512, 1024, 128))
        """)
    nb.code("""
        fig = nb.error_picture(4, result)
        """)
    nb.md("""
        ## 7. Measure

        Attention FLOPs count the useful work, $4BHS_qS_kD$; stage 4 performs 1.5x that. Shapes as in the
        FlashAttention papers (B·S = 16k tokens, H·D = 2048). **Expected, from the project's anchors
        measured on the H200 on 2026-11-29 (D = 128, non-causal, S = 1k / 4k / 8k):** SDPA flash (FA2)
        325 / 337 / 347 TFLOP/s, SDPA cuDNN 561 / 605 / 599, FA4 529 / 644 / 661. Stage 4 does 1.5x the
        matrix work and waits for every V load (5.1), with no warp specialisation. Measured with
        `make bench` on the H200 on 2026-11-29 (`docs/results/h200.md`): 321 / 361 / 366 TFLOP/s at
        S = 1k / 4k / 8k, about FA2's level (SDPA flash 336 / 347 / 345 in the same run). The
        baselines are timed again in the same run below; compare with those.
        """)
    nb.code("""
        bench = nb.measure(4, [(16, 16, 1024, 1024, 128), (4, 16, 4096, 4096, 128), (2, 16, 8192, 8192, 128)])
        """)
    nb.md("""
        ## 8. Exercises

        1. **Slots.** Re-draw 5.1 with `kv_slots=1` and `kv_slots=3`. Does the Hopper scheme deadlock with
           one slot? How much shared memory does each setting need at D = 128, and what does a third slot
           buy in the model?
        2. **The race.** In the racy timeline, which MMA reads a slot while TMA writes into it? Which
           single line of the stage file's pass 2 prevents it, and what happens if you move
           `consumer_release` above `wait_group(0)`? (Try it on a GPU under `make sanitize`.)
        3. **Hopper vs Blackwell rings.** Compare the two timelines: why does the Blackwell ring's $V_j$
           start loading before $QK_j$ has finished, and what does it need instead to stay correct?
        4. **Cost of exactness.** Count the `wgmma.mma_async` and `ex2.approx` instructions in the
           compile summary of stage 4 and of stage 3. Which ones come from pass 1?
        5. **Phases.** With `kv_slots = 2` and 3 KV tiles, list for each use of slot 0 (pass 1 and pass 2)
           the parity the consumer waits for on the full barrier.
        """)
