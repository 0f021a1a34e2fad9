"""Stage 15 - context parallelism: one sequence over several GPUs, K and V passed around a ring.

Changes from stage 14: nothing inside the kernel. Each of N ranks holds a chunk of the
sequence's Q, K and V, (B, H, S / N, D); the K/V chunks travel around the ring of ranks, one
hop per step, and each rank runs the kernel (stage 14's attention with return_lse) on its Q
against the K/V chunk it holds at that step. Each step gives a partial O and its LSE over that
chunk's keys; they are merged as stage 13's combine merges splits (O = sum_i e^{lse_i - lse}
O_i, lse = log sum_i e^{lse_i}), in fp32, one step at a time:

    lse' = logaddexp(lse, lse_i),   O' = e^{lse - lse'} O + e^{lse_i - lse'} O_i.

The send of the next chunk is started before the kernel runs on this one (isend/irecv on
NCCL, torch.distributed): N - 1 hops of 2 (S / N) Hkv D 2 bytes each, hidden when the kernel
on a chunk takes longer than a hop.

Causal. With contiguous chunks (rank r: tokens r S/N .. (r + 1) S/N - 1), rank r's queries see
the chunks of ranks 0..r: rank N - 1 does N steps of work, rank 0 one. Zig-zag chunks balance it
(as ring-flash-attention does): the sequence is cut in 2N pieces and rank r holds pieces r and
2N - 1 - r. At each step every rank then does the same work, half a chunk pair (ring_step):
- its own chunk (step 0): causal over the two pieces as one block (the first piece's queries
  see only their own keys, causal; the second's see the first piece whole and their own causal);
- a chunk from an earlier rank s < r: all its queries against the chunk's first piece (piece s,
  before both of rank r's pieces; piece 2N - 1 - s lies after both);
- a chunk from a later rank s > r: only its second piece's queries (piece 2N - 1 - r, after both
  of rank s's pieces) against the whole chunk; its first piece (piece r) sees neither.
World size 1 is one step, the kernel itself: its O is returned as it is (bit for bit stage
14's).

attention_cp(q, k, v, group=None, causal=False, zigzag=None, attention=None): q (B, H, S_local,
D), k and v (B, Hkv, S_local, D), this rank's chunk (zig-zag: its two pieces, concatenated);
group: the torch.distributed process group (default: the world) or a Ring; attention: the
per-chunk kernel, (q, k, v, causal) -> (O, LSE) (default: stage 14's). Returns this rank's O
(B, H, S_local, D) in q's dtype and, with return_lse, its LSE (B, H, S_local) in fp32.

What ran and what did not: docs/notes/stage15.md.
"""

import threading

import torch


def ring_step(rank, world, src, causal, zigzag):
    """What rank `rank` computes at the step where it holds the K/V chunk of rank `src`:
    (q_rows, kv_rows, causal) with q_rows and kv_rows "all", "first" or "second" (the halves of
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


def chunk_of(x, rank, world, zigzag, dim=2):
    """Rank `rank`'s chunk of a full-sequence tensor x (tests and the launcher): contiguous, or
    the zig-zag pieces rank and 2 world - 1 - rank, concatenated."""
    if not zigzag:
        return x.chunk(world, dim=dim)[rank]
    pieces = x.chunk(2 * world, dim=dim)
    return torch.cat([pieces[rank], pieces[2 * world - 1 - rank]], dim=dim)


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


class Ring:
    """The ring's transport: exchange(send) sends `send` to the next rank and returns a handle
    whose wait() gives the chunk from the previous rank. TorchRing does it with torch.distributed
    point-to-point ops (NCCL on GPUs, gloo on CPUs); FakeRing runs the ranks as threads of one
    process (CPU tests)."""

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
    results by rank. exchange is a barrier-synchronised swap through shared slots."""

    def __init__(self, world):
        self.world = world
        self._slots = [None] * world
        self._barrier = threading.Barrier(world)

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
            t.join(timeout=120)
        if errors:
            # The failing rank's own error, not the broken barrier it left the others
            first = [e for e in errors if not isinstance(e, threading.BrokenBarrierError)]
            raise (first or errors)[0]
        if any(t.is_alive() for t in threads):
            raise TimeoutError("a rank of the fake ring did not finish within 120 s (a hang)")
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

        class Done:
            def wait(self_inner):
                return got

        return Done()


def default_attention():
    """Stage 14's attention of this machine's track: (q, k, v, causal) -> (O, LSE)."""
    from common.arch import track
    from common.tools import stage_table

    mod = stage_table.track_module(14, track())
    return lambda q, k, v, causal: mod.attention(q, k, v, causal=causal, return_lse=True)


def attention_cp(q, k, v, group=None, causal=False, zigzag=None, attention=None, return_lse=False):
    """See the module docstring. zigzag (default: causal) says how the chunks were cut."""
    ring = group if isinstance(group, Ring) else TorchRing(group)
    zigzag = causal if zigzag is None else zigzag
    if zigzag and q.shape[2] % 2:
        raise ValueError(
            f"argument 'q': a zig-zag chunk is two equal pieces, got S_local = {q.shape[2]}"
        )
    attention = attention or default_attention()
    rank, world = ring.rank, ring.world
    if world == 1:
        o, lse = attention(q, k, v, causal)
        return (o, lse) if return_lse else o
    B, H, S, D = q.shape
    half = S // 2
    rows = {"all": slice(0, S), "first": slice(0, half), "second": slice(half, S)}
    out = torch.zeros(B, H, S, D, dtype=torch.float32, device=q.device)
    lse = torch.full((B, H, S), float("-inf"), dtype=torch.float32, device=q.device)
    # K and V travel together: one buffer per hop
    kv = torch.stack([k, v])
    for step in range(world):
        src = (rank - step) % world
        # The next hop starts before this step's kernel: it overlaps the compute.
        pending = ring.exchange(kv) if step < world - 1 else None
        work = ring_step(rank, world, src, causal, zigzag)
        if work is not None:
            q_rows, kv_rows, step_causal = work
            qs, ks = rows[q_rows], rows[kv_rows]
            o_i, lse_i = attention(
                q[:, :, qs].contiguous(),
                kv[0][:, :, ks].contiguous(),
                kv[1][:, :, ks].contiguous(),
                step_causal,
            )
            merge(out[:, :, qs], lse[:, :, qs], o_i, lse_i.float())
        if pending is not None:
            kv = pending.wait()
    o = out.to(q.dtype)
    return (o, lse) if return_lse else o
