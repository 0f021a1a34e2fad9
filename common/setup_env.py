"""`make setup`: install requirements.txt only when something the project needs does not import.
On a machine that already has everything (the H200 machine, which has no network) it installs
nothing. Jupyter is only needed to open the notebooks, not to test them."""

import importlib
import subprocess
import sys

NEEDED = {  # import name -> what pip installs it as
    "cutlass": "nvidia-cutlass-dsl==4.8.1",
    "torch": "torch",
    "cuda.bindings": "cuda-python",
    "tvm_ffi": "apache-tvm-ffi",
    "matplotlib": "matplotlib",
    "pytest": "pytest",
    "pytest_timeout": "pytest-timeout",
}


def missing():
    out = []
    for mod, pkg in NEEDED.items():
        try:
            importlib.import_module(mod)
        except Exception:
            out.append(pkg)
    return out


def main():
    miss = missing()
    if not miss:
        import cutlass
        import torch

        print(
            f"setup: everything imports (cutlass-dsl {cutlass.__version__}, torch {torch.__version__}); "
            "nothing to install"
        )
        return 0
    print(f"setup: missing {', '.join(miss)}; installing requirements.txt", flush=True)
    r = subprocess.run([sys.executable, "-m", "pip", "install", "-r", "requirements.txt"])
    if r.returncode != 0:
        print(
            "setup: pip failed (no network?). Install these by hand: " + ", ".join(miss),
            file=sys.stderr,
        )
        return r.returncode
    still = missing()
    if still:
        print("setup: still missing after install: " + ", ".join(still), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
