def stage1(nb, setup, how_to_run, blackwell_intro):
    nb.md("""
        # Stage 1 - GEMM: TMA, a swizzled shared-memory tile, an mbarrier pipeline, the matrix instruction

        This notebook walks through `stages/stage1_gemm/hopper.py` and its Blackwell twin
        `stages/stage1_gemm/blackwell.py`. It imports the stage files and displays them; no kernel code
        is pasted here, so what you read is what runs.
        """)
    nb.md(how_to_run)
    setup(nb, 1)
    nb.md("""
        ## 1. Objectives

        After this notebook you can:

        - read the parts every kernel of this repository has: the host side `__call__` (layouts, TMA
          descriptors, grid, launch) and the device side `kernel` with its numbered sections
          `# 1. Prepare`, `# 2. Main loop`, `# 3. Epilogue`;
        - explain why operand tiles sit in shared memory in the 128-byte swizzle, and where each 16-byte
          chunk of a row lands;
        - follow an `ab_buffers`-deep pipeline of *full* and *empty* mbarriers: who waits for what, and
          what the phase bit is for;
        - say which thread of a warpgroup holds which element of a `wgmma` accumulator;
        - find the matrix instructions in the PTX and count them per K tile;
        - say what changes on Blackwell: the accumulator in tensor memory (TMEM), one thread issuing
          `tcgen05.mma`, warps with fixed roles.

        ## 2. Previous stage recap

        Stage 1 is the first stage; there is no earlier kernel. It assumes:

        - a GEMM computed tile by tile (each block of threads owns one tile of C);
        - CuTe layouts: a shape and a stride that map a coordinate to an offset, and tensors = pointer +
          layout (the CUTLASS notebooks `tensor.ipynb` and `cute_layout_algebra.ipynb` introduce them);
        - a warp is 32 threads, a warpgroup 4 consecutive warps (128 threads): `wgmma` is issued by a
          whole warpgroup.

        Every later stage keeps this file's skeleton (same class, same method names, same section
        banners), so that `make diff-N` shows only what stage N adds.

        ## 3. The math

        $$C_{mn} = \\sum_{k=0}^{K-1} A_{mk}\\,B_{nk}, \\qquad C = A B^{\\top}, \\qquad
        A \\in \\mathbb{R}^{M\\times K},\\ B \\in \\mathbb{R}^{N\\times K}.$$

        Both operands are *K-major* (K is the contiguous dimension), which is the shape of $QK^{\\top}$ in
        attention: stage 2 will call A `Q` and B `K`. Inputs are bf16 or fp16, the accumulation is fp32,
        C is rounded to the input type. The work is $2MNK$ floating-point operations.

        A CTA owns one $b_M \\times b_N$ tile of C and sweeps K in tiles of $b_K$:

        $$C_{[i,j]} = \\sum_{t=0}^{\\lceil K / b_K \\rceil - 1} A_{[i,t]}\\,B_{[j,t]}^{\\top},$$

        where $A_{[i,t]}$ is rows $i b_M \\ldots (i+1) b_M - 1$, columns $t b_K \\ldots (t+1) b_K - 1$ of A.
        Per K tile the CTA loads $(b_M + b_N)\\,b_K$ elements (2 bytes each) and performs
        $2\\,b_M b_N b_K$ operations, so it does $\\frac{b_M b_N}{b_M + b_N}$ operations per byte loaded:
        the bigger the tile, the less memory traffic per operation. The cell below evaluates this for
        the tile the stage file uses.
        """)
    nb.code("""
        cfg = nb.kernel_config(1, "hopper")
        bM, bN, bK = cfg.get("cta_tile", (128, 256, 64))
        per_tile_bytes = (bM + bN) * bK * 2
        per_tile_flops = 2 * bM * bN * bK
        print(f"CTA tile {bM} x {bN} x {bK}: {per_tile_bytes // 1024} KB loaded per K tile, "
              f"{per_tile_flops / per_tile_bytes:.0f} FLOP per byte loaded into shared memory")
        print(f"a {bM} x {bM} tile would give {bM * bM / (2 * bM):.0f} FLOP per byte: "
              f"{(bM * bN / (bM + bN)) / (bM / 2):.2f}x more traffic per FLOP")
        """)
    nb.md("""
        ## 4. What changes

        Stage 1 has no predecessor, so instead of a diff here is the file's opening docstring (each design
        choice with the numbers behind it) and its outline: the skeleton every later Hopper stage keeps.
        """)
    nb.code("""
        nb.show_docstring(1, "hopper")
        for name, kind in nb.outline(1, "hopper"):
            print(f"{kind:8s} {name}")
        """)
    nb.md("""
        ## 5. Walkthrough

        ### 5.1 The grid: one CTA per tile of C

        `__init__` fixes every tile size and pipeline depth; `__call__` (host side, traced once per
        compile) builds the shared-memory layouts, one TMA descriptor per operand and the grid, then
        launches `kernel`. The table lists what `__init__` sets.
        """)
    nb.code("""
        cfg = nb.show_config(1, "hopper")
        fig = plots.gemm_tiling(M=1024, N=1024, K=512, tile=cfg.get("cta_tile", (128, 256, 64)), highlight=(2, 1))
        """)
    nb.md("""
        Each CTA reads a row panel of A and a row panel of B (drawn transposed, on top) one K tile at a
        time. The real kernel walks the tiles in a *rasterised* order (`raster_m` M-tiles per band) so
        that the CTAs resident at the same moment share panels in L2; the docstring above gives the
        numbers. Here is the host side:
        """)
    nb.code("""
        nb.show_source(1, "hopper", names=["Sm90Kernel.__call__"])
        """)
    nb.md("""
        ### 5.2 Shared memory: TMA and the 128-byte swizzle

        One thread issues a TMA load (`cp.async.bulk.tensor`) per operand tile; the copy engine writes the
        tile into shared memory and counts the bytes on an mbarrier. A K tile row of 64 bf16 is exactly
        128 bytes = eight 16-byte chunks. Shared memory has 32 banks of 4 bytes, so a plain row-major tile
        puts chunk 0 of every row in banks 0-3: when the tensor cores read the same chunk from 8 rows,
        they hit the same 4 banks 8 times. The 128-byte swizzle (CuTe's `Swizzle<3,4,3>` applied to byte
        addresses, TMA's `SWIZZLE_128B`) stores logical chunk c of row r at chunk c XOR (r mod 8): the same
        8 reads now touch all 32 banks. TMA writes in this pattern and `wgmma` reads in it, so nobody
        pays for it, and it is why the tiles are 1024-byte aligned (`smem_align`).
        """)
    nb.code("""
        fig = plots.swizzle_128b(rows=8)

        # Where does element (row 5, k = 20) of a bf16 K tile live?
        row, k = 5, 20
        chunk = k * 2 // 16
        byte = plots.swizzle(row * 128 + k * 2)
        print(f"element (row {row}, k {k}) is in logical chunk {chunk}, stored in chunk "
              f"{plots.swizzle_128b_chunk(row, chunk)} of its row: byte {byte} of the 1 KB swizzle atom "
              f"(row-major would be byte {row * 128 + k * 2})")
        """)
    nb.md("""
        ### 5.3 The pipeline: full and empty barriers

        `ab_buffers` shared-memory buffers each hold one K tile of A and B. Every buffer has two
        mbarriers:

        - **full[i]** completes when TMA has written the buffer: the producer announces the byte count
          with `arrive.expect_tx`, the copy engine counts the bytes down;
        - **empty[i]** completes when every consumer warp has arrived after its MMAs finished reading.

        An mbarrier completes a *phase* each time its count reaches zero, and a waiter waits for a given
        parity of the phase. The r-th use of buffer i waits for phase parity r % 2, which is why the
        `PipelineState` objects carry `(index, phase)` and `advance()` flips the phase every time the
        index wraps around. The picture is a model schedule (durations illustrative, not measured): TMA
        runs `ab_buffers` tiles ahead; a slot is refilled only after its release. Re-run it with
        `ab_buffers=2` to see the tensor cores wait.
        """)
    nb.code("""
        fig = plots.gemm_pipeline_timeline(ab_buffers=cfg.get("ab_buffers", 4), k_tiles=10, load_time=3.0, mma_time=1.0)
        """)
    nb.md("""
        The main loop in the stage file. Note the order inside an iteration: issue this K tile's 4
        `wgmma` (m64n256k16: 4 x 16 = 64 = $b_K$), commit them as a group, `wait_group(1)` = wait until
        only the group just issued is still running, *then* release the previous buffer and refill it.
        Releasing before the wait would let TMA overwrite operands the tensor cores are still reading.
        """)
    nb.code("""
        nb.show_source(1, "hopper", section="# 2.")
        nb.show_source(1, "hopper", names=["Sm90Kernel.load_tiles"])
        """)
    nb.md("""
        ### 5.4 The accumulator: which thread holds what

        `wgmma.mma_async.m64nNk16` multiplies a 64 x 16 tile of A by a 16 x N tile of B into a 64 x N fp32
        accumulator spread over the 128 threads of the warpgroup. The PTX ISA fixes the layout: thread t
        of warp w holds rows $16w + \\lfloor t/4 \\rfloor$ and $16w + \\lfloor t/4 \\rfloor + 8$, columns
        $2(t \\bmod 4) + 8i + \\{0, 1\\}$ for $i = 0 \\ldots N/8 - 1$: N/2 registers per thread, and each
        row spread over the 4 threads of a *quad*. With two warpgroups stacked along M and N = 256 that is
        128 fp32 registers per thread for C. This layout matters from stage 3 on, when the softmax
        reduces rows.
        """)
    nb.code("""
        fig = plots.wgmma_accumulator_layout(n=32, thread=5)

        # The picture is drawn from CuTe's thread-value layout of the atom; check it against the rule above.
        n = cfg.get("cta_tile", (128, 256, 64))[1]
        for t in range(128):
            w, lane = divmod(t, 32)
            for v, r, c in plots.wgmma_c_coords(t, n):
                i, j = divmod(v, 4)  # register v = 4 i + j
                assert r == 16 * w + lane // 4 + 8 * (j // 2) and c == 2 * (lane % 4) + 8 * i + j % 2
        print(f"64 x {n} accumulator ({plots.layout_str(*plots.wgmma_c_tv(n))}): "
              f"{len(plots.wgmma_c_coords(0, n))} fp32 registers per thread, the rule holds for all 128 threads")
        """)
    nb.md("""
        ### 5.5 The epilogue

        After the last `wgmma` has completed, the accumulator is rounded to bf16, written to shared memory
        with `stmatrix` (reusing the A buffers, idle by then) and stored by one TMA store per tile, which
        also clips rows and columns that fall outside C.
        """)
    nb.code("""
        nb.show_source(1, "hopper", section="# 3.")
        """)
    blackwell_intro(
        nb,
        6,
        "stage1_gemm",
        """
        In stage 1 the softmax warps only run the epilogue: `tcgen05.ld` brings each thread's row of the
        128 x 128 fp32 accumulator from TMEM into registers, 32 columns at a time, and they write C.
        The accumulator takes 128 of the 512 TMEM columns.
        """,
    )
    nb.code("""
        fig = plots.blackwell_warp_roles(stage=1)
        fig = nb.show_tmem(1)
        """)
    nb.code("""
        nb.show_docstring(1, "blackwell")
        nb.show_source(1, "blackwell", section="# 2.")
        """)
    nb.md("""
        The whole Blackwell file against the Hopper file of the same stage (long: the two machines share
        the algorithm, TMA and the mbarrier pipeline, not the MMA, its operands or its accumulator):
        """)
    nb.code("""
        nb.show_cross_track_diff(1, max_lines=200)
        """)
    nb.code("""
        report = nb.compile_summary(1, "blackwell")
        """)
    nb.md("""
        ## 6. Run and verify

        The check (`common.checker`): C is computed from seeded random bf16 inputs, the output is filled
        with NaN before the launch (an element the kernel forgets to write fails), and the result is
        compared with an fp64 reference computed from the same bf16 inputs. **Expected:** a relative error
        (norm of the difference over norm of the reference) around $10^{-3}$, the rounding of C to bf16,
        within 3x PyTorch's own bf16 GEMM error and below the hard bound $10^{-2}$. Without a GPU the cell
        shows the compile summary of the Hopper kernel instead, and the error map below is PyTorch's own
        bf16 GEMM on the CPU: the yardstick the kernel is held to.
        """)
    nb.code("""
        result = nb.run_and_verify(1, (1024, 1024, 1024))
        """)
    nb.code("""
        fig = nb.error_picture(1, result)
        """)
    nb.md("""
        ## 7. Measure

        TFLOP/s = $2MNK$ / time, medians of CUDA-event timings after warm-up, inputs rotated so that they
        do not stay in L2, cuBLAS (`torch.matmul`) timed in the same run. **Expected, from the
        project's anchors measured on the H200 on 2026-11-29:** cuBLAS reached 779 TFLOP/s at $4096^3$
        and 682 at $8192^3$ (bf16); CUTLASS's CuTe DSL Hopper `dense_gemm` example (fp16, 128 x 256 tile,
        warp-specialised) reached 837 at $8192^3$. Stage 1 uses the same tile without warp
        specialisation: expect it in the range of those numbers, about 700-800 TFLOP/s at $8192^3$ on
        an H200 (the H100/H200 datasheet peak for dense bf16 is 989). `make bench` measured 784
        TFLOP/s against cuBLAS's 690 in the same run (H200, 2026-11-29; `docs/results/h200.md`). Numbers drift between runs and
        machines: compare with the cuBLAS bar of the same run.
        """)
    nb.code("""
        bench = nb.measure(1, [(4096, 4096, 4096), (8192, 8192, 8192)])
        """)
    nb.md("""
        ## 8. Exercises

        1. **Pipeline depth.** In the model of 5.3, try `ab_buffers=2` and `3`. Show that the MMAs never
           wait once `load_time <= (ab_buffers - 1) * mma_time`. How many 48 KB buffers fit in the 227 KB
           a CTA may use on an H200, and what does the epilogue's reuse of the A buffers save? On a GPU,
           change `self.ab_buffers` in `hopper.py` and re-run section 7.
        2. **Who holds C[37, 100]?** With two warpgroups stacked along M and N = 256, find the thread of
           the CTA and the register that hold element (37, 100) of the 128 x 256 tile. Check your answer
           with the cell below.
        3. **Swizzle.** Where does element (row 13, k = 41) of a bf16 K tile land? Why must the buffers be
           1024-byte aligned rather than 128-byte aligned?
        4. **PTX.** In the compile summary, find the `wgmma.mma_async` instructions. Which m/n/k shape do
           they have, and why are there 4 in the PTX although the kernel runs one per 16-wide K step of
           every K tile?
        5. **Blackwell.** The Blackwell file uses a 128 x 128 tile and `tcgen05.ld` in slices of 32
           columns. How many TMEM columns would a 128 x 256 fp32 accumulator take, and how many registers
           per thread would one `tcgen05.ld` of all of it need?
        """)
    nb.code("""
        # Exercise 2: every (thread, register) of warpgroup 0 holding row 37, column 100 of its 64 x 256 accumulator.
        hits = [(t, v) for t in range(128) for v, r, c in plots.wgmma_c_coords(t, 256) if (r, c) == (37, 100)]
        print("(thread, register d<v>):", hits)
        """)
