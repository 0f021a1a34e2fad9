"""Which track the current GPU runs.

hopper    -> sm_90a  (H100, H200): wgmma, accumulators in registers
blackwell -> sm_100a (B200, GB200, and sm_103 B300): tcgen05.mma, accumulators in tensor memory
"""

import functools

TRACKS = ("hopper", "blackwell")
ARCH_OF_TRACK = {"hopper": "sm_90a", "blackwell": "sm_100a"}


_SM_COUNTS = {}


def device_sm_count():
    """The SMs of the current CUDA device (132 on an H100 SXM or H200), the cap on a persistent
    grid (stages 11 and 12); 132 without a GPU (compile-only). Read once per device: every call
    builds kernel objects, and the property lookup is a measurable part of a short call's host
    work."""
    import torch

    if not torch.cuda.is_available():
        return 132
    device = torch.cuda.current_device()
    count = _SM_COUNTS.get(device)
    if count is None:
        count = _SM_COUNTS[device] = torch.cuda.get_device_properties(device).multi_processor_count
    return count


class UnsupportedGPUError(RuntimeError):
    """The current machine has no GPU that one of the two tracks targets."""


@functools.lru_cache(maxsize=None)
def compute_capability():
    """(major, minor) of GPU 0, or None when torch sees no CUDA GPU."""
    import torch

    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_capability(0)


def track_of_capability(cc):
    if cc is None:
        return None
    major, minor = cc
    if major == 9 and minor == 0:
        return "hopper"
    if major == 10 and minor in (0, 3):
        return "blackwell"
    return None


def track():
    """'hopper' on sm_90, 'blackwell' on sm_100/sm_103; a clear error anywhere else."""
    cc = compute_capability()
    t = track_of_capability(cc)
    if t is not None:
        return t
    if cc is None:
        raise UnsupportedGPUError(
            "no CUDA GPU is visible: the kernels need an sm_90 (H100/H200) or sm_100/sm_103 "
            "(B200/GB200/B300) GPU. Without one you can still compile every stage: "
            "`make tour` or common.tools.ptx.compile_only(stage, track)."
        )
    import torch

    raise UnsupportedGPUError(
        f"GPU '{torch.cuda.get_device_name(0)}' is sm_{cc[0]}{cc[1]}; this tutorial has a Hopper "
        "track (sm_90) and a Blackwell track (sm_100/sm_103) only. wgmma and tcgen05 do not exist "
        "on other architectures."
    )


def gpu_track_available(name):
    """True when the current GPU runs track `name`."""
    return track_of_capability(compute_capability()) == name


def gpu_description():
    import torch

    if not torch.cuda.is_available():
        return "no CUDA GPU"
    cc = compute_capability()
    return f"{torch.cuda.get_device_name(0)} (sm_{cc[0]}{cc[1]})"
