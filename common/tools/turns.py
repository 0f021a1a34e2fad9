"""The turns of the Hopper consumer warpgroups (stages 9-12) on the CPU: a model of named
barriers that explores every interleaving of the warpgroups' programs, the programs of stage 10's
overlapped loop, and the order of the synchronisation and wgmma statements read from the PTX.

Named barriers (bar.sync / bar.arrive with a thread count): a barrier completes when its count
of threads has arrived, and releases those waiting in it (bar.sync waits, bar.arrive does not).
Turn barrier 1 + w is warpgroup w's turn: wait_turn is a bar.sync of 256 threads (this
warpgroup's 128 and the 128 of the one before it, from its pass_turn's bar.arrive), so each
completion hands over one turn. Barrier 1 joins all consumer warpgroups (zero_rows, the
epilogue).

A program is a list of ('sync', barrier), ('arrive', barrier) and ('gemm', name) in the
kernel's order, one per consumer warpgroup. explore() runs every interleaving and reports what
the hardware would do wrong: a deadlock, an arrival left at the end, a warpgroup arriving twice
in one phase, a GEMM reaching the tensor cores out of the expected order.

Stage 9's programs (pingpong_program, with the turn operations a kernel performs), the wgmma
waits and the reads of the GEMMs' results (waits=True, in_flight_reads), one interleaving's
order and where it gets stuck (issue_order), and what the PTX says of the turns
(pingpong_turn_ops) and of the wgmma groups (wgmma_groups) serve notebook 9 and the exercises
(common/tools/exercises.py).

Used by tests/test_stage9_hopper.py, tests/test_stage10_hopper.py, tests/test_stage12_hopper.py,
notebooks 9 and 10 and common/tools/exercises.py; no GPU needed.
"""

import re

# ---------------------------------------------------------------- the PTX's order

SCHEDULE_LETTERS = [
    (r"(bar|barrier)\.sync\s+0;", "0"),  # the CTA-wide sync after the barriers' initialisation
    (r"setmaxnreg\.dec", "d"),
    (r"setmaxnreg\.inc", "i"),
    (r"cp\.async\.bulk\.tensor", "L"),  # a TMA load
    (r"bar\.sync\s+(%r\d+|3), 256;", "T"),  # wait_turn
    (r"bar\.arrive\s+(%r\d+|2), 256;", "P"),  # pass_turn
    (r"bar\.sync\s+1, (256|384);", "B"),  # the consumers' own barrier (all their threads)
    (r"wgmma\.mma_async", "G"),
    (r"wgmma\.commit_group", "C"),
    (r"wgmma\.wait_group\.sync\.aligned\s+1;", "w"),
    (r"wgmma\.wait_group\.sync\.aligned\s+0;", "W"),
]


def schedule_string(ptx):
    """The order of the kernel's synchronisation and wgmma statements in the PTX, one letter
    each (SCHEDULE_LETTERS), a run of wgmma.mma_async as one G."""
    out = []
    for line in ptx.splitlines():
        stmt = re.sub(r"^@!?%p\d+\s+", "", line.strip())
        out += [c for pat, c in SCHEDULE_LETTERS if re.match(pat, stmt)]
    return re.sub("G+", "G", "".join(out))


# ---------------------------------------------------------------- stage 10's programs


def overlap_program(kernel, wg, steps, zero_rows, waits=False, pv_first=False):
    """Consumer warpgroup wg of `kernel` (stage 10's loop: turns of (QK_j, PV_{j-1})) over
    `steps` KV tiles: ('sync', id), ('arrive', id), ('gemm', name) in the kernel's order, with
    the kernel's own barrier numbers (wait_turn: sync on turn_barrier(wg); pass_turn: arrive on
    the next warpgroup's). zero_rows: packed sequences, whose last V tile is zeroed between
    turns. Stage 12 runs it with three warpgroups. waits=True adds the wgmma waits and the reads
    of the GEMMs' results (('wait_group', n), ('use', name): the softmax of S_j after wait_group
    1, O rescaled after wait_group 0), for in_flight_reads; explore takes the program without
    them (without_waits). pv_first=True issues each turn's pair in the other order, PV_{j-1}
    before QK_j."""
    n = kernel.mma_warpgroups
    wait = ("sync", kernel.turn_barrier(wg))
    ops, pass_to = [], ("arrive", kernel.turn_barrier(kernel.next_warpgroup(wg)))
    if steps > 0:
        if wg > 1:
            ops.append(wait)  # turn 0 comes round from warpgroup 1
        ops += [("gemm", f"{wg}: QK0"), pass_to]  # first_half_block_overlap
        ops += [("wait_group", 0), ("use", f"{wg}: QK0")] if waits else []
        for t in range(1, steps):  # mma_one_n_block
            pair = [("gemm", f"{wg}: QK{t}"), ("gemm", f"{wg}: PV{t - 1}")]
            ops += [wait, *(pair[::-1] if pv_first else pair)]
            ops.append(pass_to)
            if waits:  # softmax_t under PV_{t-1}, then O *= row_scale_t once PV_{t-1} is done
                ops += [("wait_group", 1), ("use", f"{wg}: QK{t}")]
                ops += [("wait_group", 0), ("use", f"{wg}: PV{t - 1}")]
        if zero_rows:
            ops.append(("sync", 1))  # zero_rows of the last V tile, between turns
        ops += [wait, ("gemm", f"{wg}: PV{steps - 1}")]  # last_half_block_overlap
        if wg < n:
            ops.append(pass_to)  # the last turn goes round, the last warpgroup's to nobody
        ops += [("wait_group", 0), ("use", f"{wg}: PV{steps - 1}")] if waits else []
    return ops + [("sync", 1), ("sync", 1)]  # the epilogue


def overlap_order(steps, n=2):
    """The tensor cores' order under stage 10's turns: every warpgroup's QK0, then each turn's
    QK_t and PV_{t-1} warpgroup by warpgroup, the last PVs alone."""
    order = []
    for t in range(steps + 1 if steps else 0):
        for wg in range(1, n + 1):
            order += [f"{wg}: QK{t}"] if t < steps else []
            order += [f"{wg}: PV{t - 1}"] if t > 0 else []
    return order


# ---------------------------------------------------------------- the model


def explore(programs, expected, sizes=None, stats=None):
    """Every interleaving of the programs (one per consumer warpgroup) under named-barrier rules:
    a barrier completes when sizes.get(barrier, 2) warpgroups have arrived (2: 256 threads, a
    turn barrier; barrier 1 counts every consumer warpgroup) and releases those waiting in it.
    Returns the problems found: a deadlock, a barrier left with arrivals, a warpgroup arriving
    twice in one phase (the hardware would complete the barrier without its partner), a GEMM out
    of turn. The empty set: none in any interleaving. stats (a dict) receives the number of
    states visited."""
    sizes = {1: len(programs)} if sizes is None else sizes
    problems = set()
    # program counters, (barrier, warpgroup) arrivals of the open phases, warpgroup -> the
    # barrier it is blocked in
    start = (tuple(0 for _ in programs), (), frozenset())
    seen, todo = {start}, [start]
    while todo:
        pcs, arrivals, blocked = todo.pop()
        done = all(pc == len(p) for pc, p in zip(pcs, programs))
        if done:
            if arrivals:
                problems.add(f"barrier arrivals left at the end: {arrivals}")
            continue
        moves = []
        for w, (pc, prog) in enumerate(zip(pcs, programs)):
            if pc == len(prog) or any(x == w for x, _ in blocked):
                continue
            kind, arg = prog[pc]
            nxt_pcs = tuple(pc + (i == w) for i, pc in enumerate(pcs))
            if kind == "gemm":
                issued = sum(op[0] == "gemm" for p, c in zip(programs, pcs) for op in p[:c])
                if issued >= len(expected) or expected[issued] != arg:
                    problems.add(f"{arg} issued out of turn")
                moves.append((nxt_pcs, arrivals, blocked))
                continue
            if (arg, w) in arrivals:
                problems.add(f"warpgroup {w + 1} arrives twice on barrier {arg} in one phase")
                continue
            arr = arrivals + ((arg, w),)
            blk = blocked | {(w, arg)} if kind == "sync" else blocked
            if sum(b == arg for b, _ in arr) == sizes.get(arg, 2):  # the barrier completes
                blk = frozenset(x for x in blk if x[1] != arg)
                arr = tuple(a for a in arr if a[0] != arg)
            moves.append((nxt_pcs, tuple(sorted(arr)), frozenset(blk)))
        if not moves:
            problems.add(f"deadlock at {pcs}, arrivals {arrivals}")
        for m in moves:
            if m not in seen:
                seen.add(m)
                todo.append(m)
    if stats is not None:
        stats["states"] = len(seen)
    return problems


def problem_kinds(problems):
    """The kinds of problem explore reported, in words, each once: "a deadlock", "an arrival left
    on a barrier at the end", "GEMMs out of turn (the first: ...)", "a warpgroup arriving twice
    in one phase"."""
    kinds = []
    for p in sorted(problems):
        text = re.sub(r"^\[[^\]]*\] ", "", p)
        if text.startswith("deadlock"):
            kind = "a deadlock"
        elif text.startswith("barrier arrivals left"):
            kind = "an arrival left on a barrier at the end"
        elif "out of turn" in text:
            kind = f"GEMMs out of turn (the first: {text.split(' issued')[0]})"
        elif "twice" in text:
            kind = "a warpgroup arriving twice in one phase"
        else:
            kind = text
        if not any(k.split(" (")[0] == kind.split(" (")[0] for k in kinds):
            kinds.append(kind)
    return kinds


# ---------------------------------------------------------------- stage 9's programs

# Stage 9's four turn operations per consumer warpgroup, in program order.
TURN_OPS = (
    "wait_turn before QK_lo",  # warpgroups 2 .. N: turn 0 comes round from warpgroup 1
    "pass_turn after QK_j",
    "wait_turn before PV_j",
    "pass_turn after the last PV",  # warpgroups 1 .. N - 1: the last turn goes round too
)


def pingpong_program(kernel, wg, steps, zero_rows=False, turn_ops=TURN_OPS, waits=False):
    """Consumer warpgroup wg (1 .. N) of stage 9's loop over `steps` KV tiles, in the kernel's
    order: a turn is PV_{t-1} (issued at the end of the previous step) and QK_t; ('sync', id),
    ('arrive', id), ('gemm', name) with the kernel's own barrier numbers (wait_turn: sync on
    turn_barrier(wg); pass_turn: arrive on next_warpgroup's). zero_rows: the packed kernel's
    sync of all consumer warpgroups before the last PV. turn_ops: the TURN_OPS the kernel
    performs (all of them, or fewer for a kernel that lost one). waits=True adds the wgmma waits
    and the reads of the results, as in overlap_program."""
    unknown = set(turn_ops) - set(TURN_OPS)
    if unknown:
        raise ValueError(f"unknown turn operations {sorted(unknown)}; allowed: {TURN_OPS}")
    n = kernel.mma_warpgroups
    wait = ("sync", kernel.turn_barrier(wg))
    pass_to = ("arrive", kernel.turn_barrier(kernel.next_warpgroup(wg)))
    ops = []
    for t in range(steps):
        if t == 0 and wg > 1 and TURN_OPS[0] in turn_ops:
            ops.append(wait)  # wait_turn: turn 0 comes round from warpgroup 1
        ops.append(("gemm", f"{wg}: QK{t}"))
        if TURN_OPS[1] in turn_ops:
            ops.append(pass_to)
        if waits:  # one wait for PV_{t-1} and QK_t; the softmax of S_t, then O *= row_scale
            ops += [("wait_group", 0), ("use", f"{wg}: QK{t}")]
            ops += [("use", f"{wg}: PV{t - 1}")] if t > 0 else []
        if zero_rows and t == steps - 1:
            ops.append(("sync", 1))  # zero_rows of the last V tile, between turns
        if TURN_OPS[2] in turn_ops:
            ops.append(wait)
        ops.append(("gemm", f"{wg}: PV{t}"))
    if steps > 0:
        if wg < n and TURN_OPS[3] in turn_ops:
            ops.append(pass_to)  # the last turn goes round, the last warpgroup's to nobody
        ops += [("wait_group", 0), ("use", f"{wg}: PV{steps - 1}")] if waits else []
    return ops + [("sync", 1), ("sync", 1)]  # the epilogue


def pingpong_order(steps, n=2):
    """The tensor cores' order under stage 9's turns: turn t is PV_{t-1} and QK_t of warpgroup
    1, then of warpgroup 2, ...; turn 0 is QK_0 alone, the last turn the last PV alone."""
    order = []
    for t in range(steps + 1):
        for wg in range(1, n + 1):
            order += [f"{wg}: PV{t - 1}"] if t > 0 else []
            order += [f"{wg}: QK{t}"] if t < steps else []
    return order


# ---------------------------------------------------------------- waits, and one interleaving


def without_waits(program):
    """The program's barrier and GEMM operations, what explore takes."""
    return [op for op in program if op[0] in ("sync", "arrive", "gemm")]


def in_flight_reads(program):
    """The reads of a GEMM's result while its wgmma group may still run, in a program with waits
    (waits=True). A warpgroup's groups complete in the order they were committed and wait_group
    n waits for all but the newest n, so this depends on the program alone, not on the
    interleaving. [(the GEMM read, the groups still pending there)]."""
    out, pending = [], []
    for op in program:
        if op[0] == "gemm":
            pending.append(op[1])
        elif op[0] == "wait_group":
            pending = pending[len(pending) - op[1] :] if op[1] else []
        elif op[0] == "use" and op[1] in pending:
            out.append((op[1], tuple(pending)))
    return out


def issue_order(programs, sizes=None):
    """One interleaving of the programs (barrier and GEMM operations; the lowest warpgroup that
    can move moves first): (the GEMMs in the order the tensor cores receive them, None or where
    each warpgroup is stuck when nothing can move). Where explore finds no problem, every
    interleaving gives this order; where it finds a deadlock in every interleaving, this names
    the barriers the warpgroups wait at."""
    n = len(programs)
    sizes = {1: n} if sizes is None else sizes
    pcs, arrivals, blocked, order = [0] * n, [], set(), []
    while not all(pc == len(p) for pc, p in zip(pcs, programs)):
        for w in range(n):
            if pcs[w] == len(programs[w]) or w in {x for x, _ in blocked}:
                continue
            kind, arg = programs[w][pcs[w]]
            pcs[w] += 1
            if kind == "gemm":
                order.append(arg)
            else:
                arrivals.append((arg, w))
                if kind == "sync":
                    blocked.add((w, arg))
                if sum(b == arg for b, _ in arrivals) == sizes.get(arg, 2):
                    blocked = {x for x in blocked if x[1] != arg}
                    arrivals = [a for a in arrivals if a[0] != arg]
            break
        else:
            stuck = []
            for w, b in sorted(blocked):
                nxt = next((op[1] for op in programs[w][pcs[w] :] if op[0] == "gemm"), None)
                what = "all consumer warpgroups" if b == 1 else "its turn"
                where = f"before its {nxt.split(': ')[-1]}" if nxt else "in the epilogue"
                stuck.append(f"warpgroup {w + 1} waits at barrier {b} ({what}) {where}")
            return order, "; ".join(stuck)
    return order, None


# ---------------------------------------------------------------- more of the PTX


# Stage 9's order in batch mode (schedule_string; no zero_rows), each turn operation optional so
# that a kernel missing one still matches: producer; consumers: the turn-0 wait, QK, pass, wait,
# [zero_rows], turn wait, PV, the last pass, the wait, the epilogue.
_PINGPONG_PTX = re.compile(r"0dL+i(T)?GC(P)?W(B)?(T)?GC(P)?WBB")


def pingpong_turn_ops(ptx):
    """The TURN_OPS a stage-9-like kernel's PTX performs, read from its schedule_string, or None
    when the PTX's order is not stage 9's with some turn operations left out."""
    m = _PINGPONG_PTX.fullmatch(schedule_string(ptx))
    if m is None:
        return None
    present = (m.group(1), m.group(2), m.group(4), m.group(5))
    return tuple(op for op, there in zip(TURN_OPS, present) if there)


def wgmma_groups(ptx):
    """The wgmma groups of the PTX in program order, one per commit_group: "QK" (A from shared
    memory: two descriptors after the accumulator registers) or "PV" (A from registers: a
    register vector after them)."""
    groups, kinds = [], []
    for line in ptx.splitlines():
        s = line.strip()
        if s.startswith("wgmma.mma_async"):
            after = s.split("}", 1)[1].lstrip(" ,")
            kinds.append("PV" if after.startswith("{") else "QK")
        elif s.startswith("wgmma.commit_group") and kinds:
            groups.append("+".join(sorted(set(kinds))))
            kinds = []
    return groups
