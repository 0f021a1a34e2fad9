"""`make tour`: every stage present, on this machine's track - compile time, instruction summary,
correctness against the reference and TFLOP/s against the baseline, as one table. With no GPU
(or a GPU of neither track) it prints the compile-only summary of both tracks."""

import argparse
import shutil
import sys
import time

import torch

from common import arch
from common.tools import stage_table
from common.tools.notebook import cubin_registers
from common.tools.ptx import compile_only

KEY_COUNTS = {
    "hopper": (
        "wgmma.mma_async",
        "cp.async.bulk.tensor (load)",
        "mbarrier.try_wait",
        "shfl.sync",
        "ex2.approx",
    ),
    "blackwell": (
        "tcgen05.mma",
        "tcgen05.ld",
        "tcgen05.st",
        "tcgen05.alloc",
        "cp.async.bulk.tensor (load)",
        "mbarrier.try_wait",
    ),
}


def _short(name):
    return name.replace("cp.async.bulk.tensor (load)", "tma.load").replace(
        "mbarrier.try_wait", "mbar.wait"
    )


def compile_rows(track):
    rows = []
    for st in stage_table.STAGES:
        if not stage_table.available(st.number, track):
            rows.append((st.number, st.title, "not written yet", ""))
            continue
        print(f"  compiling stage {st.number} ({track}) ...", flush=True)
        try:
            r = compile_only(st.number, track)
        except Exception as e:  # a broken stage is reported, the tour goes on
            rows.append(
                (
                    st.number,
                    st.title,
                    f"COMPILE FAILED: {type(e).__name__}: {str(e).splitlines()[0][:80]}",
                    "",
                )
            )
            continue
        counts = ", ".join(
            f"{_short(k)} {r.counts[k]}" for k in KEY_COUNTS[track] if r.counts.get(k)
        )
        res = r.resources or {}
        n = res.get("registers") or cubin_registers(r.cubin)
        regs = f"{n} regs" if n else ""
        rows.append((st.number, st.title, f"{r.seconds:.1f} s", f"{counts}; {regs}".strip("; ")))
    return rows


def print_table(header, rows):
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    line = " | ".join(h.ljust(w) for h, w in zip(header, widths))
    print(line)
    print("-+-".join("-" * w for w in widths))
    for r in rows:
        print(" | ".join(str(x).ljust(w) for x, w in zip(r, widths)))


def gpu_rows(track):
    from common.tools.bench import measure
    from common.tools.verify import compare, run_with_deadline
    from common.tools.workloads import make_case

    rows = []
    for st in stage_table.STAGES:
        if not stage_table.available(st.number, track):
            rows.append((st.number, st.title, "not written yet", "", "", "", ""))
            continue
        print(
            f"  stage {st.number}: compile-only summary, correctness at {st.compile_shape}, "
            f"speed at {st.tour_shape} ...",
            flush=True,
        )
        try:
            r = compile_only(st.number, track, resources=False)
            c = make_case(st.number, track, st.compile_shape)
            out = run_with_deadline(c.run, 60, f"stage {st.number}")
            chk = compare(f"stage {st.number}", out, c.ref(), rtol=c.rtol, torch_lowp=c.lowp())
            verdict = f"{'ok' if chk.passed else 'FAIL'} ({chk.rel_err:.1e})"
            big = make_case(st.number, track, st.tour_shape, seed=1)
            # The same timing path as `make bench` (inputs rotated past L2, event medians), so
            # the two agree within noise.
            name = next(iter(big.baselines))
            res = measure(big, names=(name,))
            tf, btf = res[f"stage {st.number}"][1], res[name][1]
            rows.append(
                (
                    st.number,
                    st.title,
                    f"{r.seconds:.1f} s",
                    verdict,
                    f"{tf:.0f}",
                    f"{name} {btf:.0f}",
                    f"{tf / btf:.2f}x",
                )
            )
            del big, c
            torch.cuda.empty_cache()
        except Exception as e:
            rows.append(
                (
                    st.number,
                    st.title,
                    "",
                    f"ERROR {type(e).__name__}: {str(e).splitlines()[0][:70]}",
                    "",
                    "",
                    "",
                )
            )
    return rows


def _failed(rows):
    """Rows whose verdict says the stage did not compile, run or pass."""
    return [
        r for r in rows if any(str(x).startswith(("COMPILE FAILED", "FAIL", "ERROR")) for x in r)
    ]


def main(argv=None):
    argparse.ArgumentParser(
        prog="python -m common.tools.tour",
        description=__doc__.split("\n\n")[0],
        epilog="No options: the track is this machine's GPU's (both tracks compile-only without one).",
    ).parse_args(argv)
    t0 = time.time()
    failed = []
    t = arch.track_of_capability(arch.compute_capability())
    if t is None:
        print(
            f"No GPU of either track here ({arch.gpu_description()}): compile-only tour of both tracks.\n"
        )
        for track in arch.TRACKS:
            print(f"== {track} ({arch.ARCH_OF_TRACK[track]}) ==")
            rows = compile_rows(track)
            failed += _failed(rows)
            print_table(("stage", "title", "compile", "PTX instructions; registers"), rows)
            print()
        print(
            "Registers per thread are read from the cubin the CuTe DSL built (no ptxas needed); "
            "spill counts are in `make stage-N`'s compile checks and need a ptxas on PATH as new "
            "as the DSL's PTX"
            + ("" if shutil.which("ptxas") else " (none on PATH here)")
            + ".\nBlackwell kernels are compile-checked here, not run on hardware."
        )
    else:
        from common.tools.timing import gpu_and_date

        gpu, date = gpu_and_date()
        print(f"== {t} track on {gpu}, {date} ==")
        rows = gpu_rows(t)
        failed += _failed(rows)
        print()
        print_table(
            (
                "stage",
                "title",
                "compile",
                "correct (rel err)",
                "TFLOP/s",
                "baseline TFLOP/s",
                "ratio",
            ),
            rows,
        )
    print(f"\ntour took {time.time() - t0:.0f} s")
    if failed:
        print(f"tour: {len(failed)} stage(s) failed: " + ", ".join(f"stage {r[0]}" for r in failed))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
