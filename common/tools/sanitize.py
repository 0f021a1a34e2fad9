"""`make sanitize`: compute-sanitizer racecheck and synccheck on the pipelined stages (4-14) at
small shapes that reuse every ring slot; stages 6-12 run causal, so the tile range starts past 0
for some Q tiles. Each (tool, stage) runs in its own process under the sanitizer; any reported
hazard fails. `python -m common.tools.sanitize --stages 6,8` picks stages."""

import itertools
import re
import shutil
import subprocess
import sys

SHAPES = {n: (1, 2, 256, 768, 64) for n in (6, 7)}
SHAPES.update({4: (1, 2, 128, 512, 64), 5: (1, 2, 128, 512, 64)})
# Stages 8-12 have rings of 11-13 slots at D = 64: 768 keys give 12 K and V entries, so use more
# keys there (2048: 32 entries, every slot used more than once).
SHAPES.update({n: (1, 2, 256, 2048, 64) for n in (8, 9, 10, 11, 12, 13, 14)})
# Stage 12 also on its two-warpgroup tile of D = 64 (a causal mask over 1024 keys:
# launch_options) with its 12 slots: 8 KV tiles, 16 entries.
SHORT_MASK_12 = (1, 2, 256, 1024, 64)
PERSISTENT = (11, 12)  # the stages with persistent CTAs


def target(n):
    """What runs under the sanitizer: one launch of stage n on a small shape, checked. On Hopper
    stage 12 also runs on its two-warpgroup tile of D = 64 (a short mask), and stages 11 and 12 with
    their persistent grid capped at 2 CTAs, so that each CTA walks 2 tiles and hands Q and the ring's
    slots from one to the next: non-causal (a fixed share of tiles) and causal (tiles drawn from
    the atomic counter), and packed sequences (drawn from the counter, the empty tiles
    skipped)."""
    import torch

    from common.arch import track
    from common.tools.verify import check_close, run_with_deadline
    from common.tools.workloads import make_case

    c = make_case(n, track(), SHAPES[n], causal=n >= 6)
    out = run_with_deadline(c.run, 600, f"stage {n}")
    out = out[0] if isinstance(out, tuple) else out
    r = check_close(f"stage {n}", out, c.ref(), rtol=c.rtol)
    torch.cuda.synchronize()
    print(f"stage {n} under the sanitizer: {r}")
    if n == 12 and track() == "hopper":
        c = make_case(n, "hopper", SHORT_MASK_12, causal=True)
        out = run_with_deadline(c.run, 600, "stage 12, two consumer warpgroups")
        out = out[0] if isinstance(out, tuple) else out
        r = check_close("stage 12, two consumer warpgroups", out, c.ref(), rtol=c.rtol)
        torch.cuda.synchronize()
        print(
            f"stage 12 (two consumer warpgroups, D = 64, causal over 1024 keys) under the sanitizer: {r}"
        )
    if n >= 13:
        # Split-KV (4 splits of 16 KV tiles; the combine kernel after it) on a decode step with
        # seqused_k; stage 14 also on paged caches of 16 keys per page (8 TMA boxes per slot)
        # and of 128.
        from common.tools import inputs, stage_table

        mod = stage_table.track_module(n, track())
        g = torch.Generator(device="cuda").manual_seed(3)
        q = torch.randn(2, 8, 1, 64, generator=g, device="cuda").bfloat16()
        _, k, v = inputs.attention_inputs(2, 2, 1, 2048, 64, seed=4)
        used = torch.tensor([2048, 1000], dtype=torch.int32, device="cuda")
        ref = reference_decode(q, k, v, [2048, 1000])
        runs = {"split": lambda: mod.attention(q, k, v, num_splits=4, seqused_k=used)}
        if n >= 14:
            from common.tools.bench import paged_copy

            for page in (16, 128):
                kc, vc, table, _ = paged_copy(k, v, page, seed=page)
                runs[f"paged {page}"] = lambda kc=kc, vc=vc, table=table: mod.attention_paged(
                    q, kc, vc, table, used, num_splits=4
                )
        for label, fn in runs.items():
            out = run_with_deadline(fn, 600, f"stage {n}, {label}")
            r = check_close(f"stage {n}, {label}", out, ref, rtol=0.02)
            torch.cuda.synchronize()
            print(f"stage {n} ({label} decode, 4 splits) under the sanitizer: {r}")
    if n in PERSISTENT and track() == "hopper":
        from common import attention_host
        from common.tools import stage_table

        hopper = stage_table.track_module(n, "hopper")
        earlier = stage_table.track_module(n - 1, "hopper")  # the same bits (the stages' own tests)

        class capped(hopper.Sm90Kernel):  # the grid capped at 2 CTAs: 2 tiles each
            def __init__(self, dtype, d, pack, **options):
                super().__init__(dtype, d, pack, sm_count=2, **options)

        # 2 Q tiles (192 rows at D = 64) x 2 heads; non-causal: the tiles in a fixed order,
        # causal: handed out at run time (the atomic tile counter, the tile number with Q).
        for causal, order in ((False, "fixed order"), (True, "dynamic")):
            c = make_case(n, "hopper", SHAPES[n], causal=causal)
            q, k, v = c.args
            run = lambda: attention_host.attention(capped, q, k, v, None, causal, None, False, None)  # noqa: E731
            out = run_with_deadline(run, 600, f"stage {n}, persistent, {order}")
            r = check_close(f"stage {n}, persistent, {order}", out, c.ref(), rtol=c.rtol)
            torch.cuda.synchronize()
            print(f"stage {n} (persistent, 2 CTAs x 2 tiles, {order}) under the sanitizer: {r}")
        # Packed sequences on the same capped grid: tiles drawn from the counter, the empty ones
        # (past the shorter sequences' ends) skipped by the producer; bit for bit against the
        # stage before (its own tests check it against the reference). Stage 11 has two consumer
        # warpgroups everywhere; stage 12 on takes two under this short mask (causal over at most
        # 300 keys, launch_options) where the batch cases above take three, so there the same
        # batch runs again pinned to three.
        g = torch.Generator(device="cuda").manual_seed(5)
        # A 1-token and an empty sequence first: both CTAs start on an empty tile (skipped).
        lens = [1, 0, 300, 200]
        cu = torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32, device="cuda")
        q, k, v = (
            torch.randn(sum(lens), 2, 64, generator=g, device="cuda").bfloat16() for _ in range(3)
        )

        class capped_three(capped):  # the same batch on the default tile (three at D = 64)
            launch_options = staticmethod(lambda *a: {})

        ref = earlier.attention_varlen(q, k, v, cu, cu, causal=True)
        variants = [(capped, "two")]
        if hasattr(hopper.Sm90Kernel, "launch_options"):
            variants.append((capped_three, "three"))
        for kernel_class, wgs in variants:
            what = f"stage {n}, persistent, packed sequences, {wgs} consumer warpgroups"
            out = run_with_deadline(
                lambda: attention_host.attention_varlen(
                    kernel_class, q, k, v, cu, cu, None, None, None, True, None, False, None
                ),
                600,
                what,
            )
            torch.cuda.synchronize()
            if not torch.equal(out, ref):
                raise AssertionError(f"{what}: differs from stage {n - 1}")
            print(f"{what} (2 CTAs, causal) under the sanitizer: equal")


def reference_decode(q, k, v, used):
    """fp64 attention of each sequence over its first used[b] keys, K and V of Hkv heads."""
    import torch

    from common.tools.reference import attention_ref

    group = q.shape[1] // k.shape[1]
    outs = []
    for b, n in enumerate(used):
        kb, vb = (t[b : b + 1, :, :n].repeat_interleave(group, dim=1) for t in (k, v))
        outs.append(attention_ref(q[b : b + 1], kb, vb)[0])
    return torch.cat(outs).to(q.dtype)


def main(argv=None):
    import argparse

    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--stages", default="4,5,6,7,8,9,10,11,12,13,14")
    args = ap.parse_args(argv)
    wanted = [int(x) for x in args.stages.split(",")]
    exe = shutil.which("compute-sanitizer")
    if exe is None:
        print("compute-sanitizer not found (it ships with the CUDA toolkit)", file=sys.stderr)
        return 2
    failed = []
    for n in wanted:
        for tool in ("racecheck", "synccheck"):
            cmd = [
                exe,
                "--tool",
                tool,
                "--error-exitcode",
                "99",
                sys.executable,
                "-m",
                "common.tools.sanitize",
                str(n),
            ]
            if tool == "racecheck":
                cmd[3:3] = ["--racecheck-report", "all"]
            print(f"== {tool} on stage {n}: {' '.join(cmd)}", flush=True)
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=1200)
            text = p.stdout + p.stderr
            summary = [
                ln
                for ln in text.splitlines()
                if re.search(r"ERROR SUMMARY|RACECHECK SUMMARY|hazard|under the sanitizer", ln)
            ]
            print("\n".join(summary[-6:]) or text[-2000:], flush=True)
            if p.returncode != 0:
                print(text[-4000:])
                failed.append((tool, n))
    if failed:
        print("FAILED: " + ", ".join(f"{t} stage {n}" for t, n in failed))
        return 1
    print(f"sanitize: no hazards reported (racecheck and synccheck, stages {args.stages})")
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 2 and sys.argv[1].isdigit():
        target(int(sys.argv[1]))
    else:
        sys.exit(main())
