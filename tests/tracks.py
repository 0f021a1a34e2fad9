"""The two tracks as pytest parameters (a helper module: pytest collects no tests here).

tests/test_stageN.py runs one test body on both tracks: each track's cases carry that track's GPU
marker (tests/conftest.py skips them without that GPU), and the track is the first part of every
test id (test_x[hopper-...], test_x[blackwell-...]), so `-k hopper` / `-m gpu_hopper` select one
track. Where the tracks test different cases (shapes, sizes), the cases are a dict per track, so
the difference stays written down.
"""

import importlib

import pytest

TRACKS = ("hopper", "blackwell")
GPU_MARK = {"hopper": pytest.mark.gpu_hopper, "blackwell": pytest.mark.gpu_blackwell}


def on_gpu(tracks=TRACKS):
    """parametrize("track", on_gpu()): each track, with its GPU marker."""
    return [pytest.param(t, marks=GPU_MARK[t], id=t) for t in tracks]


def on_cpu(tracks=TRACKS):
    """parametrize("track", on_cpu()): each track, no GPU marker (bad-input tests that fail in
    the argument checks, before any kernel is compiled)."""
    return [pytest.param(t, id=t) for t in tracks]


def per_track(cases, ids=str):
    """parametrize("track, case", per_track({"hopper": [...], "blackwell": [...]}, ids)): each
    track's own cases, with its GPU marker, id "track-ids(case)"; a track missing from the dict
    has no such case. Each case is passed as one value (a tuple stays a tuple)."""
    return [
        pytest.param(t, c, marks=GPU_MARK[t], id=f"{t}-{ids(c)}")
        for t in TRACKS
        for c in cases.get(t, [])
    ]


def module(stage_package, track):
    """The track's module of a stage: module("stage1_gemm", "hopper") is stages.stage1_gemm.hopper."""
    return importlib.import_module(f"stages.{stage_package}.{track}")


# Stage 7's entries and features are those of every later attention stage (8-12: only the
# schedule changes, and on Blackwell stage 12 one in 8 of P's exp2 is a cubic; 13 adds
# split-KV, chosen by the launch wherever the tiles leave SMs idle), so stage 7's tests run on
# each of them: parametrize("track", on_gpu_stages()) gives "hopper:7", "hopper:8", ... (id
# "hopper-stage8"), one per stage file that exists: Hopper 7-14, Blackwell 7-14.
KERNEL_STAGES = (7, 8, 9, 10, 11, 12, 13, 14)


def _existing(track, stage):
    from common.tools import stage_table

    return stage_table.available(stage, track)


def on_gpu_stages(tracks=TRACKS, stages=KERNEL_STAGES):
    """parametrize("track", on_gpu_stages()): "track:stage" for every stage file of the track,
    with the track's GPU marker; stage_of / track_of take it apart."""
    return [
        pytest.param(f"{t}:{s}", marks=GPU_MARK[t], id=f"{t}-stage{s}")
        for t in tracks
        for s in stages
        if _existing(t, s)
    ]


def on_cpu_stages(tracks=TRACKS, stages=KERNEL_STAGES):
    """The same without GPU markers (argument checks that fail before any compile)."""
    return [
        pytest.param(f"{t}:{s}", id=f"{t}-stage{s}")
        for t in tracks
        for s in stages
        if _existing(t, s)
    ]


def stage_module(track_stage):
    """The kernel module of "track:stage" ("hopper:9" -> stages.stage9_pingpong.hopper)."""
    from common.tools import stage_table

    track, stage = track_stage.split(":")
    return stage_table.track_module(int(stage), track)


def stage_package(track_stage):
    """The stage package of "track:stage" (its attention entries dispatch to the track)."""
    from common.tools import stage_table

    _, stage = track_stage.split(":")
    return importlib.import_module(f"stages.{stage_table.stage(int(stage)).package}")
