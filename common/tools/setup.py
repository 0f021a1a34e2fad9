"""`make setup`: install what the project needs, and only what is missing.

1. torch, if it does not import: on a machine without an NVIDIA GPU the CPU build (about 200 MB,
   from PyTorch's CPU index), otherwise the default CUDA build (several GB).
2. requirements.txt, if anything in NEEDED does not import (the CuTe DSL, Jupyter, nbclient,
   jupytext, ruff, pytest-xdist, ...).
3. The CuTe DSL's CUDA libraries that match torch's CUDA major: `nvidia-cutlass-dsl==4.8.1`
   brings the CUDA 12 ones; beside a CUDA 13 torch, `nvidia-cutlass-dsl[cu13]==4.8.1` too.
   A CPU torch needs neither GPU library (the kernels only compile there).

On a machine that already has everything (the H200 machine, which has no network) it installs
nothing and says so. Those checks import torch and the CuTe DSL in fresh interpreters (18-24 s
on a two-core machine without a GPU, 2026-12-07), and every `make` target that runs code runs `make setup` first; so a successful
check leaves a stamp in the environment (sys.prefix), and while the stamp's key still holds (the
same interpreter, requirements.txt, this file, and no package added to or removed from
site-packages since) setup says so and checks nothing. `python -m common.tools.setup --full`
checks again."""

import hashlib
import importlib
import importlib.metadata as md
import json
import os
import shutil
import site
import subprocess
import sys

DSL = "nvidia-cutlass-dsl==4.8.1"
CPU_INDEX = "https://download.pytorch.org/whl/cpu"

NEEDED = {  # import name -> what pip installs it as
    "cutlass": DSL,
    "cuda.bindings": "cuda-python",
    "tvm_ffi": "apache-tvm-ffi",
    "matplotlib": "matplotlib",
    "pytest": "pytest",
    "pytest_timeout": "pytest-timeout",
    "xdist": "pytest-xdist",
    "nbformat": "nbformat",
    "nbclient": "nbclient",
    "ipykernel": "ipykernel",
    "jupytext": "jupytext",
    "jupyter_core": "jupyter",
    "ruff": "ruff",
}
# Without these the kernels cannot even compile; the rest only runs notebooks, lint or xdist
# (their tests skip with the reason, which is what a machine without network gets).
CORE = {"cutlass", "cuda.bindings", "tvm_ffi", "matplotlib", "pytest", "pytest_timeout"}


_PROBE = """
import importlib, json, sys
out = {}
for mod in sys.argv[1:]:
    try:
        importlib.import_module(mod)
        out[mod] = True
    except Exception:
        out[mod] = False
print(json.dumps(out))
"""


def importable_all(mods):
    """{module: importable} checked in a fresh interpreter: a package installed by this process
    (the CuTe DSL puts itself on sys.path through a .pth file, which only a new interpreter
    reads) is seen as a new Python would see it."""
    p = subprocess.run(
        [sys.executable, "-c", _PROBE, *mods], capture_output=True, text=True, check=False
    )
    try:
        return json.loads(p.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        return {m: False for m in mods}


def importable(mod):
    return importable_all([mod])[mod]


def missing():
    ok = importable_all(list(NEEDED))
    return [NEEDED[m] for m in NEEDED if not ok[m]]


def pip(*args):
    cmd = [sys.executable, "-m", "pip", "install", *args]
    print("setup: " + " ".join(cmd[2:]), flush=True)
    rc = subprocess.run(cmd).returncode
    importlib.invalidate_caches()
    return rc


def has_nvidia_gpu():
    return shutil.which("nvidia-smi") is not None


def torch_cuda_major():
    """'12', '13', or None for a CPU build (or no torch), asked of a fresh interpreter."""
    p = subprocess.run(
        [sys.executable, "-c", "import torch; print(torch.version.cuda or '')"],
        capture_output=True,
        text=True,
        check=False,
    )
    cuda = p.stdout.strip() if p.returncode == 0 else ""
    return cuda.split(".")[0] if cuda else None


def dsl_libs():
    have = []
    for major in ("12", "13"):
        try:
            md.version(f"nvidia-cutlass-dsl-libs-cu{major}")
            have.append(major)
        except md.PackageNotFoundError:
            pass
    return have


def install_torch():
    if has_nvidia_gpu():
        print("setup: torch is missing; installing the CUDA build (several GB)", flush=True)
        return pip("torch")
    print(
        "setup: torch is missing and this machine has no NVIDIA GPU: installing the CPU build "
        f"(about 200 MB, from {CPU_INDEX})",
        flush=True,
    )
    if pip("torch", "--index-url", CPU_INDEX, "--retries", "1", "--timeout", "20") == 0:
        return 0
    print("setup: the CPU index is not reachable; trying PyPI's torch (a CUDA build, several GB)")
    return pip("torch")


STAMP = os.path.join(sys.prefix, ".flash-tutorial-setup")


def stamp_key():
    """What a stamp vouches for: this interpreter, requirements.txt and this file, and the
    modification times of the site-packages folders, the user's included (a package installed or
    removed changes them)."""
    h = hashlib.sha256(sys.executable.encode())
    for path in ("requirements.txt", __file__):
        try:
            with open(path, "rb") as f:
                h.update(f.read())
        except OSError:
            h.update(b"-")
    for folder in site.getsitepackages() + [site.getusersitepackages()]:
        if os.path.isdir(folder):
            h.update(f"{folder}:{os.stat(folder).st_mtime_ns}".encode())
    return h.hexdigest()


def stamped():
    try:
        with open(STAMP) as f:
            return f.read().split("\n")[0] == stamp_key()
    except OSError:
        return False


def write_stamp(summary):
    try:
        with open(STAMP, "w") as f:
            f.write(stamp_key() + "\n" + summary + "\n")
    except OSError:  # a read-only environment: setup checks again next time
        pass


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if "--full" not in argv and stamped():
        with open(STAMP) as f:
            summary = (f.read().split("\n") + [""])[1]
        print(f"setup: nothing to install (as checked before: {summary}; --full checks again)")
        return 0
    installed = []
    if not importable("torch"):
        if install_torch() != 0:
            print(
                "setup: could not install torch; install it by hand (README, Set-up)",
                file=sys.stderr,
            )
            return 1
        installed.append("torch")
    miss = missing()
    if miss:
        print(f"setup: missing {', '.join(miss)}; installing requirements.txt", flush=True)
        if pip("-r", "requirements.txt") != 0:
            ok = importable_all(sorted(CORE))
            core = [NEEDED[m] for m in sorted(CORE) if not ok[m]]
            if core:
                print(
                    "setup: pip failed (no network?). Install by hand: " + ", ".join(core),
                    file=sys.stderr,
                )
                return 1
            print(
                "setup: pip failed (no network?); the kernels and their tests run, but the tests "
                "of these skip with the reason: " + ", ".join(missing()),
                file=sys.stderr,
            )
            return 0
        installed += miss
    major = torch_cuda_major()
    if major == "13" and "13" not in dsl_libs():
        print(
            "setup: torch is a CUDA 13 build; adding the CuTe DSL's CUDA 13 libraries", flush=True
        )
        if pip(f"nvidia-cutlass-dsl[cu13]=={DSL.split('==')[1]}") != 0:
            return 1
        installed.append("nvidia-cutlass-dsl[cu13]")
    still = missing()
    if still:
        print("setup: still missing after install: " + ", ".join(still), file=sys.stderr)
        return 1
    versions = subprocess.run(
        [
            sys.executable,
            "-c",
            "import cutlass, torch; print(cutlass.__version__, torch.__version__, "
            "torch.version.cuda or 'CPU build')",
        ],
        capture_output=True,
        text=True,
        check=False,
    ).stdout.split()
    dsl, torch_version, cuda = (versions + ["?", "?", "?"])[:3]
    libs = ", ".join(f"cu{m}" for m in dsl_libs()) or "none"
    cuda = f"CUDA {cuda}" if cuda not in ("CPU", "?") else "CPU build"
    what = f"installed {', '.join(installed)}" if installed else "nothing to install"
    summary = f"cutlass-dsl {dsl} (libs {libs}), torch {torch_version} ({cuda})"
    print(f"setup: {what}; {summary}")
    write_stamp(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
