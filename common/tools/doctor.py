"""`make doctor`: versions, GPU, driver, arch - what to paste into a bug report."""

import platform
import shutil
import subprocess


def cuda_libs_advice(torch):
    """Which CUDA build of the CuTe DSL libraries is installed, against the CUDA major of torch:
    `pip install nvidia-cutlass-dsl==4.8.1` always brings the CUDA 12 libraries;
    `nvidia-cutlass-dsl[cu13]==4.8.1` adds the CUDA 13 ones, which a CUDA 13 torch needs."""
    from common.tools.setup import dsl_libs

    have = [f"cu{m}" for m in dsl_libs()]
    cuda = getattr(getattr(torch, "version", None), "cuda", None) if torch else None
    want = f"cu{cuda.split('.')[0]}" if cuda else None
    text = f"installed: {', '.join(have) or 'none'}; torch wants: {want or 'none (CPU torch)'}"
    if want == "cu13" and "cu13" not in have:
        text += " -> make setup (adds nvidia-cutlass-dsl[cu13]==4.8.1)"
    return text


def main():
    print(f"python      {platform.python_version()} ({platform.machine()})")
    try:
        import torch

        print(f"torch       {torch.__version__} (CUDA {torch.version.cuda})")
    except Exception as e:
        print(f"torch       not importable: {e}")
        torch = None
    try:
        import cutlass

        print(f"cutlass-dsl {cutlass.__version__}")
    except Exception as e:
        print(f"cutlass-dsl not importable: {e}")
    print(f"dsl libs    {cuda_libs_advice(torch)}")
    from common.arch import ARCH_OF_TRACK, compute_capability, gpu_description, track_of_capability

    print(f"gpu         {gpu_description()}")
    t = track_of_capability(compute_capability())
    print(
        f"track       {t + ' (' + ARCH_OF_TRACK[t] + ')' if t else 'none: compile-only mode (both tracks compile without a GPU)'}"
    )
    if shutil.which("nvidia-smi"):
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version,memory.total", "--format=csv,noheader"],
            capture_output=True,
            text=True,
        ).stdout.strip()
        print(f"driver      {out}")
    for tool in ("ptxas", "cuobjdump", "compute-sanitizer"):
        print(f"{tool:<11} {shutil.which(tool) or 'not found'}")
    print(f"ptxas       release {ptxas_release()}")


def ptxas_release():
    """ptxas's release and what it means for the spill counts: the DSL's cu12 libraries write
    PTX ISA 8.8, its cu13 ones 9.4; CUDA 13.0's ptxas reads up to 9.0 (README, Set-up)."""
    exe = shutil.which("ptxas")
    if exe is None:
        return "none: no ptxas on PATH, so compile reports count no spills (registers come from the DSL's cubin)"
    out = subprocess.run([exe, "--version"], capture_output=True, text=True).stdout
    release = next((w.rstrip(",") for w in out.split() if w[:1].isdigit() and "." in w), "?")
    return (
        f"{release}: spills are counted where it reads the DSL's PTX (cu12 libs write ISA 8.8, "
        "cu13 libs 9.4; CUDA 13.0's ptxas reads up to 9.0)"
    )


if __name__ == "__main__":
    main()
