"""`make sanitize`: compute-sanitizer racecheck and synccheck on stages 4 and 5 at small shapes.
Each (tool, stage) runs in its own process under the sanitizer; any reported hazard fails."""

import re
import shutil
import subprocess
import sys

SHAPES = {4: (1, 2, 128, 512, 64), 5: (1, 2, 128, 512, 64)}


def target(n):
    """What runs under the sanitizer: one launch of stage n on a small shape, checked."""
    import torch

    from .arch import track
    from .cases import make_case
    from .checker import check_close, run_with_deadline

    c = make_case(n, track(), SHAPES[n])
    out = run_with_deadline(c.run, 600, f"stage {n}")
    out = out[0] if isinstance(out, tuple) else out
    r = check_close(f"stage {n}", out, c.ref(), rtol=c.rtol)
    torch.cuda.synchronize()
    print(f"stage {n} under the sanitizer: {r}")


def main():
    exe = shutil.which("compute-sanitizer")
    if exe is None:
        print("compute-sanitizer not found (it ships with the CUDA toolkit)", file=sys.stderr)
        return 2
    failed = []
    for n in (4, 5):
        for tool in ("racecheck", "synccheck"):
            cmd = [
                exe,
                "--tool",
                tool,
                "--error-exitcode",
                "99",
                sys.executable,
                "-m",
                "common.sanitize",
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
                if re.search(r"ERROR SUMMARY|RACECHECK SUMMARY|hazard", ln)
            ]
            print("\n".join(summary[-5:]) or text[-2000:], flush=True)
            if p.returncode != 0:
                print(text[-4000:])
                failed.append((tool, n))
    if failed:
        print("FAILED: " + ", ".join(f"{t} stage {n}" for t, n in failed))
        return 1
    print("sanitize: no hazards reported (racecheck and synccheck, stages 4 and 5)")
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 2:
        target(int(sys.argv[1]))
    else:
        sys.exit(main())
