"""Stage 15 - context parallelism: one sequence over several GPUs, K and V passed around a ring.

Changes from stage 14: nothing inside the kernel. Each of N ranks holds a chunk of the
sequence's Q, K and V, (B, H, ~S / N, D); the K/V chunks travel around the ring of ranks, one
hop per step, and each rank runs the kernel (stage 14's attention with return_lse) on its Q
against the K/V chunk it holds at that step. Each step gives a partial O and its LSE over that
chunk's keys; they are merged as stage 13's combine merges splits (O = sum_i e^{lse_i - lse}
O_i, lse = log sum_i e^{lse_i}), in fp32, one step at a time:

    lse' = logaddexp(lse, lse_i),   O' = e^{lse - lse'} O + e^{lse_i - lse'} O_i.

A row that has seen no key yet has lse = -inf and weight 0 (merge keeps it at O = 0, no NaN).
The send of the next chunk is started before the kernel runs on this one (isend/irecv on
NCCL, torch.distributed): N - 1 hops of 2 B Hkv (S / N) D 2 bytes each (K and V, bf16 or fp16),
hidden when the kernel on a chunk takes longer than a hop.

Chunks (Chunks, chunk_of). The S tokens are cut in N pieces (contiguous: rank r holds piece r)
or 2N (zig-zag: pieces r and 2N - 1 - r, concatenated) by torch.tensor_split's rule: sizes differ
by at most one, the longer pieces first. Any S >= 1 is cut for any N, and two ranks' chunks
differ by at most one token (S = 10 over 4 ranks: 3, 3, 2, 2; zig-zag, 8 pieces of 2, 2, 1, 1,
1, 1, 1, 1: chunks 3, 3, 2, 2). S < N (zig-zag: S < 2N) leaves pieces, and then whole chunks,
empty. Every hop carries one buffer of the longest chunk's rows, so every send and receive of
the ring has one shape; a shorter chunk leaves its last row of the buffer unused.

Causal. With contiguous chunks (rank r: the r-th piece), rank r's queries see the chunks of
ranks 0..r: rank N - 1 does N steps of work, rank 0 one. Zig-zag chunks balance it (as
ring-flash-attention does): rank r holds pieces r and 2N - 1 - r. At each step every rank then
does the same work, half a chunk pair (ring_step):
- its own chunk (step 0): causal over the two pieces as one block (the first piece's queries
  see only their own keys, causal; the second's see the first piece whole and their own causal);
  Sq = Sk there, so the kernel's bottom-right causal alignment is the top-left one;
- a chunk from an earlier rank s < r: all its queries against the chunk's first piece (piece s,
  before both of rank r's pieces; piece 2N - 1 - s lies after both);
- a chunk from a later rank s > r: only its second piece's queries (piece 2N - 1 - r, after both
  of rank s's pieces) against the whole chunk; its first piece (piece r) sees neither.
These hold for pieces of any sizes, since pieces keep the sequence's order. A step is also
skipped where the rows it names are empty (an empty chunk or zig-zag piece, step_work): the
kernel never gets a call with no queries or no keys, and a rank with nothing to compute still
passes its K/V on. World size 1 is one step, the kernel itself: its O is returned as it is (bit
for bit stage 14's).

attention_cp(q, k, v, group=None, causal=False, zigzag=None, attention=None, return_lse=False,
seqlen=None): q (B, H, S_local, D), k and v (B, Hkv, S_local, D), this rank's chunk (chunk_of;
zig-zag: its two pieces, concatenated); group: the torch.distributed process group (default: the
world) or a Ring; attention: the per-chunk kernel, (q, k, v, causal) -> (O, LSE) (default: stage
14's); seqlen: the whole sequence's S, the same on every rank - None passes each rank's chunk
length around the ring first (N - 1 hops of one integer and a wait on the host) and adds them
up. Returns this rank's O (B, H, S_local, D) in q's dtype and, with return_lse, its LSE (B, H,
S_local) in fp32. Not supported, refused with a ValueError naming the argument: packed
sequences (q of rank 3), K and V of another length than Q's chunk (cross-attention, a KV cache),
lengths that are not the cut above. An error on one rank of a torch.distributed ring leaves the
others waiting for its hop, as in any collective; FakeRing stops them.

What ran and what did not: docs/notes/stage15.md.
"""

import threading

import torch


def ring_step(rank, world, src, causal, zigzag):
    """What rank `rank` computes at the step where it holds the K/V chunk of rank `src`:
    (q_rows, kv_rows, causal) with q_rows and kv_rows "all", "first" or "second" (the pieces of
    a zig-zag chunk), or None when the chunk is skipped (all its keys after all the queries)."""
    if not causal:
        return ("all", "all", False)
    if src == rank:
        return ("all", "all", True)
    if not zigzag:
        return ("all", "all", False) if src < rank else None
    if src < rank:
        return ("all", "first", False)
    return ("second", "all", False)


class Chunks:
    """The cut of a sequence of `seqlen` tokens over `world` ranks (the module docstring):
    pieces[r], rank r's pieces as (start, stop) token ranges, in the order its chunk holds them
    - one contiguous piece, or the zig-zag pieces r and 2 world - 1 - r."""

    def __init__(self, seqlen, world, zigzag):
        self.seqlen, self.world, self.zigzag = seqlen, world, zigzag
        count = 2 * world if zigzag else world
        base, extra = divmod(seqlen, count)  # the first `extra` pieces have one more token
        bounds = [i * base + min(i, extra) for i in range(count + 1)]
        piece = [(bounds[i], bounds[i + 1]) for i in range(count)]
        self.pieces = [
            [piece[r], piece[count - 1 - r]] if zigzag else [piece[r]] for r in range(world)
        ]

    def length(self, rank):
        """Rank `rank`'s chunk length, S_local."""
        return sum(stop - start for start, stop in self.pieces[rank])

    def rows(self, rank, part):
        """The rows of rank `rank`'s chunk that `part` ("all", "first", "second") names."""
        start, stop = self.pieces[rank][0]
        first, total = stop - start, self.length(rank)
        if part == "first":
            return slice(0, first)
        return slice(first, total) if part == "second" else slice(0, total)

    def positions(self, rank):
        """The sequence positions of rank `rank`'s chunk, in its order (int64)."""
        return torch.cat([torch.arange(start, stop) for start, stop in self.pieces[rank]])


def chunk_of(x, rank, world, zigzag, dim=2):
    """Rank `rank`'s chunk of a full-sequence tensor x (tests and the launcher): its contiguous
    piece (a view), or the zig-zag pieces rank and 2 world - 1 - rank, concatenated."""
    pieces = Chunks(x.shape[dim], world, zigzag).pieces[rank]
    parts = [x.narrow(dim, start, stop - start) for start, stop in pieces]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)


def step_work(chunks, rank, src, causal):
    """ring_step in rows: (q_rows, kv_rows, causal) as slices of rank `rank`'s chunk and of the
    chunk of rank `src`, or None when the step computes nothing (a skipped chunk, or rows that
    are empty)."""
    work = ring_step(rank, chunks.world, src, causal, chunks.zigzag)
    if work is None:
        return None
    q_part, kv_part, step_causal = work
    q_rows, kv_rows = chunks.rows(rank, q_part), chunks.rows(src, kv_part)
    if q_rows.stop == q_rows.start or kv_rows.stop == kv_rows.start:
        return None
    return q_rows, kv_rows, step_causal


def merge(out, lse, o_i, lse_i):
    """(out, lse) <- the merge of (out, lse) and (o_i, lse_i) by their LSE weights, in place, fp32
    (out (..., S, D), lse (..., S)). Rows that saw no key yet have lse = -inf, weight 0."""
    new = torch.logaddexp(lse, lse_i)
    # A row that no chunk has shown a key yet: keep it at O = 0, LSE = -inf (no NaN).
    seen = torch.isfinite(new)
    w_old = torch.where(seen, torch.exp(lse - new), 0.0).unsqueeze(-1)
    w_new = torch.where(seen, torch.exp(lse_i - new), 0.0).unsqueeze(-1)
    out.mul_(w_old).add_(w_new * o_i.float())
    lse.copy_(new)


def attend_step(q, kv, out, lse, chunks, rank, src, causal, attention):
    """One step of rank `rank`: its queries q (B, H, S_local, D) against the K/V chunk of rank
    `src` (kv (2, B, Hkv, rows, D), rows >= that chunk's length), merged into (out, lse).
    Returns the step's work (step_work), None when it computed nothing."""
    work = step_work(chunks, rank, src, causal)
    if work is not None:
        q_rows, kv_rows, step_causal = work
        o_i, lse_i = attention(
            q[:, :, q_rows].contiguous(),
            kv[0][:, :, kv_rows].contiguous(),
            kv[1][:, :, kv_rows].contiguous(),
            step_causal,
        )
        merge(out[:, :, q_rows], lse[:, :, q_rows], o_i, lse_i.float())
    return work


class Ring:
    """The ring's transport: exchange(send) sends `send` to the next rank and returns a handle
    whose wait() gives the tensor of the same shape from the previous rank. TorchRing does it
    with torch.distributed point-to-point ops (NCCL on GPUs, gloo on CPUs); FakeRing runs the
    ranks as threads of one process (tests, and N ranks on one GPU)."""

    rank: int
    world: int


class TorchRing(Ring):
    def __init__(self, group=None):
        import torch.distributed as dist

        self.dist, self.group = dist, group
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)

    def global_rank(self, rank):
        return rank if self.group is None else self.dist.get_global_rank(self.group, rank)

    def exchange(self, send):
        dist = self.dist
        recv = torch.empty_like(send)
        nxt, prv = (self.global_rank((self.rank + d) % self.world) for d in (1, -1))
        ops = [
            dist.P2POp(dist.isend, send, nxt, self.group),
            dist.P2POp(dist.irecv, recv, prv, self.group),
        ]
        reqs = dist.batch_isend_irecv(ops)

        class Pending:
            def wait(self_inner):
                for r in reqs:
                    r.wait()
                return recv

        return Pending()


class FakeRing(Ring):
    """N ranks as N threads of one process: run(fn) calls fn(ring_of_rank) in each and returns the
    results by rank; a rank still running after `timeout` seconds is reported as a hang.
    exchange is a barrier-synchronised swap through shared slots. On one GPU the ranks share the
    device and its default stream (every hop is a copy on that stream, ordered before the
    kernels that read it); one_at_a_time(attention) makes their kernel calls one after another,
    so that a kernel is compiled once, by one thread."""

    def __init__(self, world, timeout=120):
        self.world, self.timeout = world, timeout
        self._slots = [None] * world
        self._barrier = threading.Barrier(world)
        self._lock = threading.Lock()

    def one_at_a_time(self, attention):
        def serial(*args):
            with self._lock:
                return attention(*args)

        return serial

    def run(self, fn):
        results, errors = [None] * self.world, []

        def body(rank):
            try:
                results[rank] = fn(_FakeRank(self, rank))
            except BaseException as e:  # reported in the caller's thread
                errors.append(e)
                self._barrier.abort()

        threads = [threading.Thread(target=body, args=(r,)) for r in range(self.world)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=self.timeout)
        if errors:
            # The failing rank's own error, not the broken barrier it left the others
            first = [e for e in errors if not isinstance(e, threading.BrokenBarrierError)]
            raise (first or errors)[0]
        if any(t.is_alive() for t in threads):
            raise TimeoutError(
                f"a rank of the fake ring did not finish within {self.timeout} s (a hang)"
            )
        return results


class _FakeRank(Ring):
    def __init__(self, ring, rank):
        self.ring, self.rank, self.world = ring, rank, ring.world

    def exchange(self, send):
        ring = self.ring
        ring._barrier.wait()
        ring._slots[self.rank] = send.clone()
        ring._barrier.wait()
        got = ring._slots[(self.rank - 1) % self.world]
        ring._barrier.wait()
        if got.shape != send.shape:
            raise RuntimeError(
                f"rank {self.rank}: sent {tuple(send.shape)}, got {tuple(got.shape)}"
            )

        class Done:
            def wait(self_inner):
                return got

        return Done()


def default_attention(track=None):
    """Stage 14's attention of `track` (default: this machine's): (q, k, v, causal) -> (O, LSE)."""
    from common.arch import track as machine_track
    from common.tools import stage_table

    mod = stage_table.track_module(14, track or machine_track())
    return lambda q, k, v, causal: mod.attention(q, k, v, causal=causal, return_lse=True)


def check_chunk_args(q, k, v, causal, zigzag, seqlen):
    """The arguments attention_cp takes; a ValueError naming the one it cannot (a TypeError for
    a flag or a length of the wrong type, as the kernels' checks do)."""
    for name, flag in (("causal", causal), ("zigzag", zigzag)):
        if not isinstance(flag, bool):
            raise TypeError(f"argument '{name}': expected a bool, got {type(flag).__name__}")
    if seqlen is not None and (isinstance(seqlen, bool) or not isinstance(seqlen, int)):
        raise TypeError(f"argument 'seqlen': expected an int or None, got {type(seqlen).__name__}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(
                f"argument '{name}': expected this rank's chunk as (B, heads, S_local, D), got "
                f"{got}; packed sequences (varlen) are not supported by attention_cp"
            )
    B, H, S, D = q.shape
    for name, t in (("k", k), ("v", v)):
        if (t.shape[0], t.shape[2], t.shape[3]) != (B, S, D):
            raise ValueError(
                f"argument '{name}': expected (B, Hkv, S_local, D) = ({B}, Hkv, {S}, {D}) like "
                f"q's chunk, got {tuple(t.shape)}; K and V are the keys of the same tokens as Q "
                "(no cross-attention or KV cache in attention_cp)"
            )
    if k.shape[1] != v.shape[1] or k.shape[1] == 0 or H % k.shape[1]:
        raise ValueError(
            f"argument 'k': {k.shape[1]} KV heads (v: {v.shape[1]}) for H = {H} query heads; "
            "H must be a multiple of Hkv, and v must have Hkv heads too"
        )
    if seqlen is not None and seqlen < 1:
        raise ValueError(f"argument 'seqlen': the sequence needs at least one token, got {seqlen}")


def gathered_seqlen(ring, length, device):
    """S when seqlen is not given: every rank's chunk length, passed around the ring (N - 1 hops
    of one integer), added up; a set of lengths that is not a cut (Chunks) is refused by every
    rank alike. Returns (S, lengths by rank)."""
    rank, world = ring.rank, ring.world
    got = [None] * world
    got[rank] = buf = torch.tensor([length], dtype=torch.int64, device=device)
    for step in range(1, world):
        buf = ring.exchange(buf).wait()
        got[(rank - step) % world] = buf
    lengths = torch.cat(got).tolist()
    return sum(lengths), lengths


def attention_cp(
    q, k, v, group=None, causal=False, zigzag=None, attention=None, return_lse=False, seqlen=None
):
    """See the module docstring. zigzag (default: causal) says how the chunks were cut."""
    ring = group if isinstance(group, Ring) else TorchRing(group)
    zigzag = causal if zigzag is None else zigzag
    check_chunk_args(q, k, v, causal, zigzag, seqlen)
    rank, world = ring.rank, ring.world
    B, H, S, D = q.shape
    if seqlen is None:
        seqlen, lengths = gathered_seqlen(ring, S, q.device) if world > 1 else (S, [S])
        if seqlen < 1:
            raise ValueError(
                "argument 'q': every rank's chunk is empty (the sequence has no tokens)"
            )
        chunks = Chunks(seqlen, world, zigzag)
        want = [chunks.length(r) for r in range(world)]
        if lengths != want:
            raise ValueError(
                f"argument 'q': the ranks' chunk lengths {lengths} are not a cut of S = "
                f"{seqlen} tokens over {world} ranks ({'zig-zag ' if zigzag else ''}chunk_of "
                f"gives {want}); pass seqlen and cut with chunk_of"
            )
    chunks = Chunks(seqlen, world, zigzag)
    if S != chunks.length(rank):
        raise ValueError(
            f"argument 'seqlen': S = {seqlen} tokens over {world} ranks gives rank {rank} a "
            f"{'zig-zag ' if zigzag else ''}chunk of {chunks.length(rank)} tokens (chunk_of), "
            f"but q, k and v hold {S}"
        )
    attention = attention or default_attention()
    if world == 1:
        o, lse = attention(q, k, v, causal)
        return (o, lse) if return_lse else o
    out = torch.zeros(B, H, S, D, dtype=torch.float32, device=q.device)
    lse = torch.full((B, H, S), float("-inf"), dtype=torch.float32, device=q.device)
    # K and V travel together, one buffer per hop of the longest chunk's rows (every hop one shape)
    rows = max(chunks.length(r) for r in range(world))
    kv = torch.stack([k, v])
    if rows > S:
        kv = torch.nn.functional.pad(kv, (0, 0, 0, rows - S))
    for step in range(world):
        src = (rank - step) % world
        # The next hop starts before this step's kernel: it overlaps the compute.
        pending = ring.exchange(kv) if step < world - 1 else None
        attend_step(q, kv, out, lse, chunks, rank, src, causal, attention)
        if pending is not None:
            kv = pending.wait()
    o = out.to(q.dtype)
    return (o, lse) if return_lse else o
