"""Figures of notebook 9 (ping-pong): the schedule model of the two consumer warpgroups on the
tensor cores and the exponential units, its timelines (stage 8 against stage 9, and the turn's two
GEMMs back to back against a wait between them), measured TFLOP/s of one step against S, and the
Blackwell two-tile CTA (its roles, TMEM and MMA issue order). Notebooks 8 and 10 draw some of them
again (notebooks/figures/stage8.py and stage10.py import them from here).
"""

import re

import matplotlib.pyplot as plt
from matplotlib.patches import Patch

from common.tools.draw import FIG_WIDTH, WARP_COLORS, C, arrow, box, finish, kernel_color
from notebooks.figures.timelines import Deadlock as Deadlock


def hopper_unit_times(head_dim=128, block_n=128, rows=64, tc_tflops=989.0, exp_tflops=3.9, sms=132):
    """(QK^T, softmax, PV) time in ns of one consumer warpgroup's `rows` query rows against one
    KV tile of block_n keys on one SM, from the FlashAttention-3 paper's H100 SXM5 throughputs:
    989 TFLOP/s of bf16/fp16 matrix multiply and 3.9 TFLOP/s of special functions (exp2), over
    132 SMs. The softmax time counts only the exponentials (one per score); the other softmax
    instructions (max, sum, scale, conversion, O rescale) are left out."""
    per_sm_tc = tc_tflops * 1e12 / sms
    per_sm_exp = exp_tflops * 1e12 / sms
    gemm = 2 * rows * block_n * head_dim / per_sm_tc * 1e9
    softmax = rows * block_n / per_sm_exp * 1e9
    return gemm, softmax, gemm


def attention_schedule(
    pingpong,
    steps=3,
    qk_time=1.0,
    softmax_time=1.0,
    pv_time=1.0,
    qk_instr=8,
    pv_instr=8,
    dt=None,
    final_pass=True,
    overlap=False,
    wait_for_pv=False,
    wait_latency=0.0,
):
    """A model of the two consumer warpgroups' loop over `steps` KV tiles (durations illustrative
    unless taken from hopper_unit_times). Shared units: the tensor cores serve wgmma instructions
    in the order they were issued (two warpgroups issuing at the same moment interleave theirs),
    and the exp units are shared equally between the warpgroups running a softmax.

    pingpong=False is stage 8 in step: each warpgroup issues QK_j, waits, runs its softmax, issues
    PV_j and waits, and the model starts QK_j and PV_j of both together (the ('sync', ...)
    steps), so that their wgmma interleave on the tensor cores and their exponentials share the
    exponential units. Stage 8 has no barrier between the two: they start together on the same
    work with the same instructions and nothing holds them apart, and the model assumes that they
    stay together (without the syncs its warpgroups drift apart by themselves, because its tensor
    cores serve the first-issued of two simultaneous instructions first - a detail of the model;
    on the GPU which warp issues first varies). The producer's ring runs ahead: loads are assumed
    to arrive in time. pingpong=True is stage 9: the turn of the tensor cores (named barriers
    2 and 3) is PV_j with QK_(j+1), issued back to back; a warpgroup waits for its turn before PV_j
    (warpgroup 2 also before QK_0), passes it right after issuing QK_(j+1) (warpgroup 1 also after
    its last PV), and then waits for both. (The model's waits cost no time, so it does not show
    what issuing the pair back to back saves: the gap while a warpgroup holding the turn sees PV_j
    complete before it issues QK_(j+1) - unless wait_latency is set.) wait_for_pv=True (with
    pingpong) is the order of FlashAttention-3's kernel without intra-warpgroup overlap: the
    warpgroup waits for PV_j before it issues QK_(j+1). wait_latency: the time from a
    warpgroup's last outstanding wgmma completing to its next instruction after a wait (seeing
    the completion, issuing again; illustrative - the kernel's cost is not measured directly).
    overlap=True (with pingpong) is stage 10: a turn is QK_j with PV_(j-1), issued together; the
    warpgroup waits for QK_j only (wait_group 1), runs softmax_j while PV_(j-1) is on the tensor
    cores, then waits for PV_(j-1).

    Returns {"tc": [(start, end, wg, label)], "softmax": {wg: [(start, end, label, shared)]},
    "waits": {wg: [(start, end, reason)]}, "end": t, "tc_busy": fraction, "turns": {barrier:
    completions}, "pending": {barrier: arrives never waited for}}. final_pass=False drops
    warpgroup 1's pass after its last PV (a lost arrive): the model then raises Deadlock, as the
    kernel would hang."""
    if dt is None:
        dt = min(qk_time, softmax_time, pv_time) / 60.0
    progs = {}
    for w in (1, 2):
        ops = []
        for j in range(steps if not overlap else 0):
            if pingpong:
                if j == 0 and w == 2:
                    ops.append(("wait_turn",))
                # The wait after QK_j also covers PV_(j-1), issued right before it in the turn.
                waited = "QK" if j == 0 or wait_for_pv else "PV and QK"
                ops += [("issue", f"QK{j}", qk_instr, qk_time), ("pass_turn",), ("wait", waited)]
                ops += [("softmax", f"softmax {j}", softmax_time), ("wait_turn",)]
                ops += [("issue", f"PV{j}", pv_instr, pv_time)]
                if wait_for_pv:
                    ops.append(("wait", "PV"))
            else:  # in step: both warpgroups start QK_j together, and PV_j
                ops += [("sync", f"K{j}"), ("issue", f"QK{j}", qk_instr, qk_time), ("wait", "QK")]
                ops += [("softmax", f"softmax {j}", softmax_time), ("sync", f"V{j}")]
                ops += [("issue", f"PV{j}", pv_instr, pv_time), ("wait", "PV")]
        if overlap and steps > 0:
            if w == 2:
                ops.append(("wait_turn",))
            ops += [("issue", "QK0", qk_instr, qk_time), ("pass_turn",), ("wait", "QK")]
            ops.append(("softmax", "softmax 0", softmax_time))
            for j in range(1, steps):
                ops += [("wait_turn",), ("issue", f"QK{j}", qk_instr, qk_time)]
                ops += [("issue", f"PV{j - 1}", pv_instr, pv_time), ("pass_turn",)]
                ops += [("wait_for", f"QK{j}"), ("softmax", f"softmax {j}", softmax_time)]
                ops.append(("wait", "PV"))
            ops += [("wait_turn",), ("issue", f"PV{steps - 1}", pv_instr, pv_time)]
        if pingpong and steps > 0 and w == 1 and final_pass:
            ops.append(("pass_turn",))
        if pingpong and not overlap and not wait_for_pv and steps > 0:
            ops.append(("wait", "PV"))  # the last PV, after the last pass
        if overlap and steps > 0:
            ops.append(("wait", "PV"))
        progs[w] = ops
    pc = {1: 0, 2: 0}
    queue = []  # [wg, label, remaining] in the tensor cores' order
    outstanding = {1: 0, 2: 0}
    active = {}  # wg -> [label, remaining work]
    tokens = {1: 0, 2: 0}  # turns passed to warpgroup w and not yet taken
    turns = {2: 0, 3: 0}  # completions of named barrier 1 + w
    at_sync = {}
    woken = {}  # (wg, pc) of a wait whose wgmmas completed -> when the warpgroup goes on
    tc, soft, waits = [], {1: [], 2: []}, {1: [], 2: []}
    t = 0.0
    limit = 100000 * max(1, steps)
    for _ in range(limit):
        before = dict(pc)
        issued = {1: [], 2: []}
        passed = {1: 0, 2: 0}
        blocked = {}
        sleeping = False
        for w in (1, 2):
            while pc[w] < len(progs[w]):
                op = progs[w][pc[w]]
                kind = op[0]
                if kind == "issue":
                    _, label, n, work = op
                    issued[w] += [[w, label, work / n] for _ in range(n)]
                    outstanding[w] += n
                    pc[w] += 1
                elif kind == "pass_turn":
                    passed[3 - w] += 1
                    pc[w] += 1
                elif kind == "wait_turn":
                    if tokens[w] == 0:
                        blocked[w] = "waits for its turn"
                        break
                    tokens[w] -= 1
                    turns[1 + w] += 1
                    pc[w] += 1
                elif kind == "wait":
                    if outstanding[w]:
                        blocked[w] = f"waits for its {op[1]} wgmmas"
                        break
                    if wait_latency > 0:
                        go = woken.setdefault((w, pc[w]), t + wait_latency)
                        if t + 1e-12 < go:
                            blocked[w] = f"waits for its {op[1]} wgmmas"
                            sleeping = True
                            break
                    pc[w] += 1
                elif kind == "wait_for":  # wait_group 1: the group named, not the later one
                    if any(q[0] == w and q[1] == op[1] for q in queue + issued[w]):
                        blocked[w] = f"waits for its {op[1][:2]} wgmmas"
                        break
                    pc[w] += 1
                elif kind == "sync":
                    at_sync[w] = op[1]
                    if at_sync.get(3 - w) == op[1]:
                        # both arrived: both go on at the next moment, together
                        pc[1] += 1
                        pc[2] += 1
                        at_sync.clear()
                    else:
                        blocked[w] = "waits for the other warpgroup"
                    break
                elif kind == "softmax":
                    if w not in active:
                        active[w] = [op[1], op[2]]
                    break
        # instructions issued at the same moment by both warpgroups interleave
        for i in range(max(len(issued[1]), len(issued[2]))):
            for w in (1, 2):
                if i < len(issued[w]):
                    queue.append(issued[w][i])
        if pc[1] >= len(progs[1]) and pc[2] >= len(progs[2]) and not queue and not active:
            break
        if pc == before and not queue and not active and not any(passed.values()) and not sleeping:
            raise Deadlock(
                f"deadlock at t = {t:.0f}: "
                + "; ".join(f"warpgroup {w} {why}" for w, why in sorted(blocked.items()))
            )
        # the tensor cores: first come, first served
        budget = dt
        while budget > 1e-15 and queue:
            head = queue[0]
            use = min(budget, head[2])
            start = t + dt - budget
            if (
                tc
                and tc[-1][2] == head[0]
                and tc[-1][3] == head[1]
                and abs(tc[-1][1] - start) < 1e-9
            ):
                tc[-1] = (tc[-1][0], start + use, head[0], head[1])
            else:
                tc.append((start, start + use, head[0], head[1]))
            head[2] -= use
            budget -= use
            if head[2] <= 1e-12:
                queue.pop(0)
                outstanding[head[0]] -= 1
        # the exp units: shared equally
        for w in list(active):
            label, left = active[w]
            shared = len(active) > 1
            done = dt / len(active)
            runs = soft[w]
            if runs and runs[-1][2] == label and abs(runs[-1][1] - t) < 1e-9:
                runs[-1] = (runs[-1][0], t + dt, label, runs[-1][3] or shared)
            else:
                runs.append((t, t + dt, label, shared))
            active[w][1] = left - done
            if active[w][1] <= 1e-12:
                del active[w]
                pc[w] += 1
        for w, why in blocked.items():
            runs = waits[w]
            if runs and runs[-1][2] == why and abs(runs[-1][1] - t) < 1e-9:
                runs[-1] = (runs[-1][0], t + dt, why)
            else:
                runs.append((t, t + dt, why))
        for w in (1, 2):
            tokens[w] += passed[w]
        t += dt
    else:
        raise Deadlock(f"the schedule did not finish: pc = {pc}, tokens = {tokens}")
    busy = sum(e - s for s, e, _, _ in tc)
    return {
        "tc": tc,
        "softmax": soft,
        "waits": waits,
        "end": t,
        "tc_busy": busy / t if t else 0.0,
        "turns": turns,
        "pending": {1 + w: tokens[w] for w in (1, 2)},
    }


WG_COLORS = {1: "#4C72B0", 2: "#DD8452"}


def pingpong_timelines(
    head_dim=128,
    block_n=128,
    rows=64,
    steps=3,
    path=None,
    compare="stage 8",
    wait_latency=0.0,
    **rates,
):
    """Two schedules of the consumer warpgroups on one time axis, from attention_schedule with
    the durations of hopper_unit_times for this head_dim, block_n and rows per warpgroup (the
    kernel's configuration): which warpgroup's wgmma the tensor cores run, and when each
    warpgroup runs its softmax or waits. Loads are assumed to arrive in time (the model leaves
    memory out). compare="stage 8" (top: stage 8, the two warpgroups in step; bottom: stage 9's
    turns); "wait for PV" (stage 9's turns with a wait for PV_j before QK_(j+1),
    FlashAttention-3's warp-specialised order, against stage 9's back-to-back pair); "overlap"
    (stage 9 against stage 10's QK_j with PV_(j-1)). wait_latency (ns) goes to
    attention_schedule: what a warpgroup takes from its wgmmas' completion to its next
    instruction."""
    qk, sm, pv = hopper_unit_times(head_dim, block_n, rows, **rates)
    n_qk, n_pv = head_dim // 16, block_n // 16
    stage9 = (
        attention_schedule(True, steps, qk, sm, pv, n_qk, n_pv, wait_latency=wait_latency),
        "stage 9: ping-pong (named barriers hand over the tensor cores)",
    )
    if compare == "wait for PV":
        runs = [
            (
                attention_schedule(
                    True, steps, qk, sm, pv, n_qk, n_pv, wait_for_pv=True, wait_latency=wait_latency
                ),
                "wait for PV_j, then QK_(j+1)",
            ),
            (stage9[0], "PV_j and QK_(j+1) back to back"),
        ]
    elif compare == "overlap":
        runs = [
            stage9,
            (
                attention_schedule(True, steps, qk, sm, pv, n_qk, n_pv, overlap=True),
                "stage 10: + QK_j with PV_(j-1), softmax under the PV",
            ),
        ]
    elif compare == "stage 8":
        runs = [
            (
                attention_schedule(False, steps, qk, sm, pv, n_qk, n_pv, wait_latency=wait_latency),
                "stage 8: the two consumer warpgroups in step (nothing holds them apart)",
            ),
            stage9,
        ]
    else:
        raise ValueError(f"compare = {compare!r}; allowed: 'stage 8', 'wait for PV', 'overlap'")
    t_max = max(r["end"] for r, _ in runs)
    fig, axes = plt.subplots(2, 1, figsize=(FIG_WIDTH, 6.4), sharex=True)
    lanes = ("tensor cores\n(wg 1 | wg 2)", "warpgroup 1", "warpgroup 2")
    h = 0.7
    for ax, (r, title) in zip(axes, runs):
        # The tensor-core lane in two halves, one per warpgroup: a GEMM is drawn from its first
        # instruction to its last; two GEMMs side by side in time share the tensor cores.
        spans = {}
        for s, e, w, label in r["tc"]:
            a, b = spans.get((w, label), (s, e))
            spans[w, label] = (min(a, s), max(b, e))
        for (w, label), (s, e) in spans.items():
            other = [
                (a, b)
                for (w2, _), (a, b) in spans.items()
                if w2 != w and a < e - 1e-6 and b > s + 1e-6
            ]
            box(
                ax,
                s,
                -h / 2 + (w - 1) * h / 2,
                e - s,
                h / 2,
                WG_COLORS[w],
                lw=0.5,
                hatch="xx" if other else None,
                tc="white",
                text=label if e - s > 0.04 * t_max else None,
                fontsize=9,
            )
        for w in (1, 2):
            for s, e, why in r["waits"][w]:
                box(ax, s, w - h / 2, e - s, h, C["wait"], lw=0.2, hatch="//", alpha=0.6)
            for s, e, label, shared in r["softmax"][w]:
                box(
                    ax,
                    s,
                    w - h / 2,
                    e - s,
                    h,
                    C["softmax"],
                    lw=0.5,
                    hatch=".." if shared else None,
                    tc="white",
                    text=label.replace("softmax ", "S") if e - s > 0.04 * t_max else None,
                    fontsize=9,
                )
        per_tile = r["end"] / steps
        ax.set_yticks(range(3), lanes, fontsize=10)
        ax.set_ylim(2.6, -0.6)
        ax.set_xlim(0, t_max * 1.01)
        ax.grid(axis="x", alpha=0.25)
        ax.tick_params(axis="x", labelsize=9)
        ax.set_title(
            f"{title}: done at {r['end']:.0f} ns ({per_tile:.0f} ns per KV tile), tensor cores "
            f"busy {100 * r['tc_busy']:.0f}%",
            fontsize=10,
        )
    latency = (
        f"\n{wait_latency:g} ns from a warpgroup's wgmmas completing to its next instruction "
        "(illustrative)"
        if wait_latency
        else ""
    )
    axes[-1].set_xlabel(
        f"model time in ns on one SM, D = {head_dim}, {block_n}-key tiles, {rows} rows per "
        f"warpgroup (one GEMM {qk:.0f} ns, one softmax {sm:.0f} ns){latency}",
        fontsize=9,
    )
    handles = [
        Patch(facecolor=WG_COLORS[1], label="wgmma of warpgroup 1 (QK_j, PV_j)"),
        Patch(facecolor=WG_COLORS[2], label="wgmma of warpgroup 2"),
        Patch(facecolor="#999999", hatch="xx", label="both warpgroups' wgmma interleaved"),
        Patch(facecolor=C["softmax"], label="softmax (exp2 of a 64 x 128 S tile)"),
        Patch(facecolor=C["softmax"], hatch="..", label="softmax sharing the exp units"),
        Patch(facecolor=C["wait"], hatch="//", label="waiting (for its wgmma, for its turn)"),
    ]
    fig.legend(handles=handles, loc="lower center", ncol=3, fontsize=9, frameon=False)
    return finish(fig, path, rect=(0, 0.1, 1, 1))


def tmem_two_tiles(cfg, title=None, path=None):
    """TMEM of Blackwell stage 9 (and 10) from the kernel's own offsets (cfg: nb.kernel_config or the
    kernel's attributes): S_0, S_1, O_0, O_1 and P_0, P_1, either over S_s (hatched) or in
    columns of their own. Every region spans all 128 lanes: lane r is row r of both Q tiles."""
    D = cfg["pv_mma_tiler"][1]
    bN = cfg["qk_mma_tiler"][1]
    p_cells = bN // 2  # 16-bit P: two values per 32-bit cell
    regions = []
    for s in range(cfg["q_tiles"]):
        regions.append((f"S{s}", cfg["tmem_s_offset"][s], bN, "fp32", C["s"], False))
    for s in range(cfg["q_tiles"]):
        regions.append((f"O{s}", cfg["tmem_o_offset"][s], D, "fp32", C["o"], False))
    for s in range(cfg["q_tiles"]):
        over = cfg["tmem_p_offset"][s] == cfg["tmem_s_offset"][s]
        regions.append((f"P{s}", cfg["tmem_p_offset"][s], p_cells, "16-bit x2", C["p"], over))
    total = cfg.get("num_tmem_alloc_cols", 512)
    fig, ax = plt.subplots(figsize=(FIG_WIDTH, 3.2))
    box(ax, 0, 0, total, 128, "#FAFAFA", lw=0.8)
    for name, start, width, what, color, over in regions:
        box(
            ax,
            start,
            0,
            width,
            128,
            color,
            alpha=0.45 if over else 0.75,
            hatch="///" if over else None,
            lw=1.5 if over else 0.8,
        )
        ax.text(
            start + width / 2,
            128 * (0.28 if over else 0.62),
            f"{name}\n{start}-{start + width - 1}\n{what}",
            ha="center",
            va="center",
            fontsize=9,
            fontweight="bold",
        )
    ax.set_xlim(-5, 517)
    ax.set_ylim(133, -5)
    ax.set_xticks(range(0, 513, 64))
    ax.set_yticks([0, 32, 64, 96, 128])
    ax.set_ylabel("lane (row)", fontsize=10)
    ax.set_xlabel("TMEM column (32 bits each)", fontsize=10)
    ax.set_title(
        title or f"TMEM of a CTA with two Q tiles, D = {D}: {total} columns allocated", fontsize=10
    )
    return finish(fig, path)


def blackwell_two_tile_roles(cfg, title=None, path=None):
    """The 512-thread CTA of Blackwell stage 9 (and 10) from the kernel's settings (cfg: warp ids,
    registers per warpgroup): which warps do what, and the hand-offs between them."""
    sm0, sm1 = cfg["softmax_warp_ids"]
    corr = cfg["correction_warp_ids"]
    fig, ax = plt.subplots(figsize=(FIG_WIDTH, 4.6))

    def warps(ids):
        return f"warps {ids[0]}-{ids[-1]}"

    reg = cfg.get("softmax_registers"), cfg.get("correction_registers"), cfg.get("other_registers")
    box(
        ax,
        0,
        0,
        3.3,
        1.5,
        WARP_COLORS[3],
        text=f"softmax 0: {warps(sm0)}\nrows of Q tile 0\n{reg[0]} registers",
        fontsize=9.5,
    )
    box(
        ax,
        0,
        1.9,
        3.3,
        1.5,
        WARP_COLORS[3],
        text=f"softmax 1: {warps(sm1)}\nrows of Q tile 1\n{reg[0]} registers",
        fontsize=9.5,
    )
    box(
        ax,
        4.6,
        0.75,
        2.6,
        1.9,
        "#F6E3E3",
        text="TMEM\nS0 S1 (P over S\nor its own)\nO0 O1",
        fontsize=9.5,
    )
    box(
        ax,
        8.6,
        0,
        3.4,
        1.5,
        WARP_COLORS[0],
        text=f"MMA: warp {cfg['mma_warp_id']} (one thread)\nQK0 QK1 PV0 PV1 ...\n"
        f"{reg[2]} registers (warpgroup 3)",
        fontsize=9.5,
    )
    box(
        ax,
        8.6,
        1.9,
        3.4,
        1.5,
        WARP_COLORS[1],
        text=f"TMA: warp {cfg['tma_warp_id']}\nQ0, Q1 once; K, V ring\n({cfg['kv_slots']} slots)",
        fontsize=9.5,
    )
    box(
        ax,
        4.3,
        3.0,
        3.2,
        1.3,
        WARP_COLORS[2],
        text=f"correction: {warps(corr)}\nrescale O_s, normalise,\nstore O (TMA), LSE; "
        f"{reg[1]} regs",
        fontsize=9.2,
    )
    arrow(ax, (8.6, 0.75), (7.2, 1.2), "S_s ready", dy=-0.2)
    arrow(ax, (4.6, 1.2), (3.3, 0.75), "tcgen05.ld S0", dy=-0.2)
    arrow(ax, (3.3, 2.65), (4.6, 2.2), "tcgen05.st P1", dy=0.2)
    arrow(ax, (3.3, 3.3), (4.3, 3.6), "row factor,\nsum, max (smem)", dy=0.0)
    arrow(ax, (7.2, 2.3), (8.6, 0.9), "P_s ready", dy=0.15)
    arrow(ax, (5.9, 3.0), (5.9, 2.65), None, style="<->")
    ax.text(6.05, 2.82, "O_s", fontsize=9)
    ax.text(
        0,
        4.55,
        f"idle warps {cfg['idle_warp_ids'][0]}-{cfg['idle_warp_ids'][-1]} only complete "
        "warpgroup 3: setmaxnreg acts on whole warpgroups",
        fontsize=9,
        va="top",
    )
    ax.set_xlim(-0.2, 12.2)
    ax.set_ylim(4.8, -0.3)
    ax.axis("off")
    ax.set_title(title or "Blackwell CTA with two Q tiles: 16 warps, 5 roles", fontsize=11)
    return finish(fig, path)


def mma_issue_orders(orders, steps, notes=None, title=None, path=None):
    """The MMA warp's tcgen05.mma in program order, read from each stage's PTX (orders: [(label,
    string of Q / P per instruction: a QK step, a PV step)], as tests' mma_order gives them):
    one strip per stage, one box per GEMM (steps: instructions per GEMM with its k-blocks
    unrolled, {"Q": D / 16, "P": 8}, or one such dict per strip; a strip whose runs are not
    whole GEMMs of that many is a kernel that issues each GEMM's k-blocks in a loop, one
    instruction per GEMM, as Blackwell stages 9-14),
    QK in S's colour, PV in P's. notes: a line under each strip (which boxes are a loop body)."""
    fig, ax = plt.subplots(figsize=(FIG_WIDTH, 0.9 + 0.95 * len(orders)))
    width = 0
    for row, (label, seq) in enumerate(orders):
        per = steps[row] if isinstance(steps, (list, tuple)) else steps
        runs = [(m.group(0)[0], len(m.group(0))) for m in re.finditer(r"Q+|P+", seq)]
        if any(n % per[ch] for ch, n in runs):
            per = {"Q": 1, "P": 1}  # the k-blocks in a loop: one tcgen05.mma per GEMM
        gemms, i = [], 0
        while i < len(seq):
            ch = seq[i]
            gemms.append(ch)
            i += per[ch]
        for x, ch in enumerate(gemms):
            box(
                ax,
                x,
                row,
                0.92,
                0.6,
                C["s"] if ch == "Q" else C["p"],
                alpha=0.85,
                text="QK" if ch == "Q" else "PV",
                fontsize=9.5,
                tc="white",
            )
        width = max(width, len(gemms))
        ax.text(-0.2, row + 0.3, label, ha="right", va="center", fontsize=10)
        if notes and notes[row]:
            ax.text(0, row + 0.78, notes[row], ha="left", va="center", fontsize=9, color="#444444")
    ax.set_xlim(-2.2, max(width, 8) + 0.2)
    ax.set_ylim(len(orders) + 0.1, -0.3)
    ax.axis("off")
    ax.set_title(
        title or "The MMA warp's GEMMs in program order (read from each stage's PTX)", fontsize=10
    )
    return finish(fig, path)


def step_against_s(rows, before, after, title, baselines=("FA4",), path=None):
    """One step of the ablation as measured: rows of a `make bench` ablation run (the json's
    "rows" whose "stage" is "ablation": shape (B, H, S, S, D, causal), TFLOP/s per kernel), one
    panel per (D, causal), TFLOP/s against S for the stage `before`, the stage `after` and the
    baselines; each panel's title gives after / before at S >= 2k (below it a call's host work
    can be longer than the kernel)."""
    rows = [r for r in rows if r["stage"] == "ablation"]
    panels = sorted(
        {(r["shape"][4], bool(r["shape"][5])) for r in rows}, key=lambda p: (-p[0], p[1])
    )
    fig, axes = plt.subplots(1, len(panels), figsize=(FIG_WIDTH, 3.6), squeeze=False, sharey=True)
    for ax, (D, causal) in zip(axes[0], panels):
        mine = sorted(
            (r for r in rows if (r["shape"][4], bool(r["shape"][5])) == (D, causal)),
            key=lambda r: r["shape"][2],
        )
        for name in (before, after, *baselines):
            pts = [(r["shape"][2], r["tflops"][name]) for r in mine if name in r["tflops"]]
            if pts:
                xs, ys = zip(*pts)
                ax.plot(
                    xs,
                    ys,
                    marker="o",
                    label=name,
                    color=kernel_color(name),
                    linewidth=2.5 if name == after else 1.5 if name == before else 1.0,
                )
        gains = [
            r["tflops"][after] / r["tflops"][before]
            for r in mine
            if r["shape"][2] >= 2048 and before in r["tflops"] and after in r["tflops"]
        ]
        span = f"\n{after[6:]} / {before[6:]}: {min(gains):.2f}-{max(gains):.2f}" if gains else ""
        ax.set_title(f"D = {D}, {'causal' if causal else 'non-causal'}{span}", fontsize=10)
        ax.set_xscale("log", base=2)
        ax.set_xticks([512, 2048, 8192], ["512", "2k", "8k"])
        ax.tick_params(labelsize=9)
        ax.set_xlabel("S", fontsize=10)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("TFLOP/s", fontsize=10)
    axes[0][0].legend(fontsize=9)
    fig.suptitle(title, fontsize=11)
    return finish(fig, path)
