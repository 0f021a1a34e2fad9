"""`make model`'s decode run: generating tokens after a long prompt, with this repository's paged
KV cache and stage 14's kernel, against the same model on transformers' sdpa with its own cache.

The model is make model's (common/tools/model.py: Llama-3-8B's attention, 32 query / 8 KV heads
of 128, few layers, random weights, bf16). For each batch size B:

1. sdpa: a prompt of P random tokens per sequence (one forward, use_cache=True: transformers'
   DynamicCache, which appends each step's K and V with torch.cat), then N decode steps of one
   token per sequence, each step's token the argmax of the last logits.
2. The tutorial: the same prompt into a PagedKVCache (below), then the same N steps fed the
   tokens sdpa chose (teacher forcing: both models see the same inputs, so their logits can be
   compared at every step even where one bf16 rounding would flip an argmax and make two free
   runs diverge). Attention is stage 14's attention_paged, causal, through transformers'
   AttentionInterface under the name "flash_tutorial_paged"; that name has no mask function,
   so transformers builds no mask (as for its own paged backends) and the kernel masks.
3. Logits of every step (the prompt's last position and the N steps) compared as make model's
   prefill check: relative error and argmax agreement against the same tolerance.
4. tokens/s = B x N / the time of the N steps (CUDA events around the loop, after a few warm-up
   steps that are then undone, so no compile is timed); the GPU never waits for the host inside
   the loop (tokens stay on the GPU).

The paged cache: `page_size` keys a page; each sequence owns ceil((P + N) / page_size) pages
drawn in random order from the pool, so page_table is a real indirection; every page starts as
NaN, so a key read before it is written would show as NaN logits. update() writes a step's K and
V into their pages (one index_put per tensor) and returns the layer's whole cache; the attention
function takes page_table and seqused_k from the cache, passed as the `paged_cache` keyword,
which transformers hands on to the attention function. check_values=False: the cache wrote the
table itself, and a per-step read of it to the host would make the host wait for the GPU each
step (common/attention_host.py, attention_paged)."""

import time

import torch

from common.tools import timing

PAGED = "flash_tutorial_paged"  # transformers' attn_implementation name of the paged glue


class PagedKVCache:
    """K and V of every layer in pages of page_size keys: k[layer] and v[layer] are (num_pages,
    page_size, Hkv, D); page_table int32 (B, pages per sequence); seqused_k int32 (B,), the keys
    each sequence has (all sequences here have the same length, `length`). Follows the part of
    transformers' Cache protocol that a decoder's forward uses: update(), get_seq_length() (the
    keys a layer holds: before a forward's update the tokens of the forwards before it, which is
    where transformers starts positions it is not given), and the sizes transformers' mask
    builder asks for (get_query_offset, get_mask_sizes)."""

    def __init__(self, layers, batch, kv_heads, head_dim, max_tokens, page_size, dtype, device):
        self.page_size = page_size
        per_sequence = -(-max_tokens // page_size)
        num_pages = batch * per_sequence + 1  # one page nobody owns
        g = torch.Generator().manual_seed(0)
        order = torch.randperm(num_pages, generator=g)[: batch * per_sequence]
        self.page_table = order.view(batch, per_sequence).to(torch.int32).to(device)
        shape = (num_pages, page_size, kv_heads, head_dim)
        self.k = [
            torch.full(shape, float("nan"), dtype=dtype, device=device) for _ in range(layers)
        ]
        self.v = [
            torch.full(shape, float("nan"), dtype=dtype, device=device) for _ in range(layers)
        ]
        self.seqused_k = torch.zeros(batch, dtype=torch.int32, device=device)
        self.length = 0
        self.new = 0  # tokens of the forward begin() prepared
        self.capacity = per_sequence * page_size
        self.written = [0] * layers  # keys each layer holds (update() sets it to `length`)
        self._pages = self._rows = None

    def begin(self, new):
        """Before a forward of `new` tokens per sequence: where they go (page and row of each
        position length .. length + new - 1), and the new seqused_k."""
        if self.length + new > self.capacity:
            raise ValueError(
                f"PagedKVCache: {self.length} + {new} tokens exceed the {self.capacity} allocated"
            )
        device = self.page_table.device
        pos = torch.arange(self.length, self.length + new, device=device)
        self._pages = self.page_table[:, pos // self.page_size].long()  # (B, new)
        self._rows = (pos % self.page_size).expand_as(self._pages)  # (B, new)
        self.length += new
        self.new = new
        self.seqused_k.fill_(self.length)

    def rewind(self, length):
        """Forget the tokens after `length` (their pages keep stale keys, never read again:
        seqused_k stops before them)."""
        self.length = length
        self.new = 0
        self.written = [length] * len(self.written)
        self.seqused_k.fill_(length)

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        """key_states, value_states (B, Hkv, new, D): written to their pages; returns the
        layer's (k_cache, v_cache)."""
        self.k[layer_idx][self._pages, self._rows] = key_states.transpose(1, 2)
        self.v[layer_idx][self._pages, self._rows] = value_states.transpose(1, 2)
        self.written[layer_idx] = self.length
        return self.k[layer_idx], self.v[layer_idx]

    def get_seq_length(self, layer_idx=0):
        """The keys layer `layer_idx` holds (DynamicCache's meaning): a forward asks before its
        first update, and gets the tokens of the forwards before it."""
        return self.written[layer_idx]

    def get_query_offset(self, layer_idx=0):
        """Where this forward's queries start: the keys before begin()'s tokens."""
        return self.length - self.new

    def get_mask_sizes(self, query_length, layer_idx=0):
        """(kv_length, kv_offset) for transformers' mask builder: every key of the cache, from 0."""
        return self.length, 0


def paged_attend_stage14():
    """attend(q, k_cache, v_cache, cache, scale) -> O (B, H, Sq, D) with stage 14's kernel."""
    from common import arch
    from common.tools import stage_table

    mod = stage_table.track_module(14, arch.track())

    def attend(q, k_cache, v_cache, cache, scale):
        return mod.attention_paged(
            q,
            k_cache,
            v_cache,
            cache.page_table,
            cache.seqused_k,
            scale=scale,
            causal=True,
            check_values=False,
        )

    return attend


def paged_attend_reference(q, k_cache, v_cache, cache, scale):
    """The same from the pages in plain torch (common/tools/reference.py, fp64), for tests
    without a GPU kernel."""
    from common.tools.reference import attention_gqa_ref

    n = cache.length
    pages = cache.page_table[:, : -(-n // cache.page_size)].long()  # (B, pages used)
    # (B, pages, page_size, Hkv, D) -> (B, Hkv, n, D)
    k, v = (c[pages].flatten(1, 2)[:, :n].transpose(1, 2) for c in (k_cache, v_cache))
    o, _ = attention_gqa_ref(q, k, v, causal=True, scale=scale)
    return o.to(q.dtype)


def register_paged(attend):
    """Register the paged glue as transformers' attn_implementation PAGED, with a mask function
    that passes no mask on and refuses a padding mask: the glue computes plain causal attention
    over each sequence's seqused_k keys. (Without a mask function of its own, transformers would
    drop the caller's 2D mask before the glue could see it.)"""
    from transformers import AttentionInterface

    from common.tools.model import UnsupportedAttention

    def refuse_padding(*args, attention_mask=None, **kwargs):
        if attention_mask is not None and not bool(attention_mask.all()):
            raise UnsupportedAttention(
                f"attn_implementation '{PAGED}': an attention mask with padding was passed; the "
                "paged glue computes plain causal attention over each sequence's seqused_k keys"
            )
        return None

    try:  # transformers >= 4.53: mask functions per implementation
        from transformers.masking_utils import AttentionMaskInterface

        AttentionMaskInterface.register(PAGED, refuse_padding)
    except ImportError:  # before: the glue gets the 4D mask and refuses it below
        pass

    def forward(
        module,
        query,
        key,
        value,
        attention_mask,
        dropout=0.0,
        scaling=None,
        is_causal=None,
        paged_cache=None,
        **kwargs,
    ):
        name = type(module).__name__
        if not isinstance(paged_cache, PagedKVCache):
            raise UnsupportedAttention(
                f"{name}: attn_implementation '{PAGED}' needs the PagedKVCache as the forward's "
                "'paged_cache' keyword (and as past_key_values)"
            )
        if dropout and dropout > 0:
            raise UnsupportedAttention(f"{name}: attention dropout = {dropout}; none here")
        if attention_mask is not None:
            raise UnsupportedAttention(
                f"{name}: an attention mask was passed; the paged glue computes plain causal "
                "attention over each sequence's seqused_k keys"
            )
        o = attend(query, key, value, paged_cache, scaling)  # (B, H, Sq, D)
        return o.transpose(1, 2).contiguous(), None

    AttentionInterface.register(PAGED, forward)
    return forward


def step_positions(batch, start, new, device):
    return torch.arange(start, start + new, device=device).expand(batch, new)


def run_sdpa(model, prompt, steps, warmup):
    """sdpa with its DynamicCache: (logits (steps + 1, B, V) fp32, the tokens fed at each step
    (steps, B), ms of the timed steps)."""
    from common.tools.model import set_attention

    set_attention(model, "sdpa")
    B, P = prompt.shape
    device = prompt.device
    with torch.inference_mode():
        out = model(input_ids=prompt, use_cache=True, logits_to_keep=1)
        cache = out.past_key_values
        first = out.logits[:, -1].float()
        del out

        def decode(tok, n, logits=None, tokens=None):
            for i in range(n):
                pos = step_positions(B, P + i, 1, device)
                out = model(
                    input_ids=tok[:, None], past_key_values=cache, position_ids=pos, use_cache=True
                )
                last = out.logits[:, -1]
                if logits is not None:
                    tokens[i] = tok
                    logits[i + 1] = last
                tok = last.argmax(-1)
            return tok

        tok0 = first.argmax(-1)
        decode(tok0, warmup)
        cache.crop(P)
        logits = torch.empty(steps + 1, B, first.shape[-1], device=device)
        logits[0] = first
        tokens = torch.empty(steps, B, dtype=torch.long, device=device)
        ms = timing.elapsed_ms(lambda: decode(tok0, steps, logits, tokens))
    return logits, tokens, ms


def run_paged(model, prompt, tokens, page_size, warmup):
    """The tutorial's paged glue fed sdpa's tokens: (logits (steps + 1, B, V) fp32, ms)."""
    from common.tools.model import set_attention

    set_attention(model, PAGED)
    cfg = model.config
    B, P = prompt.shape
    steps = tokens.shape[0]
    device = prompt.device
    cache = PagedKVCache(
        cfg.num_hidden_layers,
        B,
        cfg.num_key_value_heads,
        cfg.head_dim,
        P + steps,
        page_size,
        next(model.parameters()).dtype,
        device,
    )

    def forward(ids, start):
        cache.begin(ids.shape[1])
        pos = step_positions(B, start, ids.shape[1], device)
        return model(
            input_ids=ids,
            past_key_values=cache,
            position_ids=pos,
            use_cache=True,
            logits_to_keep=1,
            paged_cache=cache,
        ).logits[:, -1]

    with torch.inference_mode():
        logits = torch.empty(steps + 1, B, model.config.vocab_size, device=device)
        logits[0] = forward(prompt, 0)

        def decode(n, out=None):
            for i in range(n):
                last = forward(tokens[i][:, None], P + i)
                if out is not None:
                    out[i + 1] = last

        decode(min(warmup, steps))
        cache.rewind(P)
        ms = timing.elapsed_ms(lambda: decode(steps, logits))
    return logits, ms


def decode_run(model, batches, prompt_len, steps, page_size, warmup=4, seed=2, log=print):
    """Rows {B, sdpa_ms, paged_ms, rel, agree, finite} of the decode comparison (module
    docstring), one per batch size."""
    from common.tools.model import compare

    vocab = model.config.vocab_size
    device = next(model.parameters()).device
    rows = []
    for B in batches:
        g = torch.Generator(device=device).manual_seed(seed + B)
        prompt = torch.randint(0, vocab, (B, prompt_len), generator=g, device=device)
        t0 = time.time()
        log(f"decode B = {B}: sdpa, prompt of {prompt_len} then {steps} steps ...")
        ref, tokens, sdpa_ms = run_sdpa(model, prompt, steps, warmup)
        log(f"  {B * steps / sdpa_ms * 1e3:,.0f} tokens/s ({time.time() - t0:.0f} s)")
        t0 = time.time()
        log(f"decode B = {B}: stage 14, pages of {page_size} (the first calls compile) ...")
        ours, paged_ms = run_paged(model, prompt, tokens, page_size, warmup)
        rel, agree, mx = compare(ours, ref)
        finite = bool(torch.isfinite(ours).all())
        log(
            f"  {B * steps / paged_ms * 1e3:,.0f} tokens/s, logits rel {rel:.2e}, argmax "
            f"{agree * 100:.2f}% ({time.time() - t0:.0f} s)"
        )
        rows.append(
            dict(
                B=B,
                sdpa_ms=sdpa_ms,
                paged_ms=paged_ms,
                rel=rel,
                agree=agree,
                max_abs=mx,
                finite=finite,
            )
        )
        del ref, ours, tokens, prompt
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def decode_lines(rows, prompt_len, steps, page_size, tol, floor_of):
    """The decode section of make model's .md, and whether every row passed."""
    lines = [
        f"## Decode: {steps} tokens after a {prompt_len:,}-token prompt",
        "",
        "transformers' sdpa with its own DynamicCache against stage 14's attention_paged with "
        f"this repository's PagedKVCache (pages of {page_size} keys in random order, "
        "common/tools/model_decode.py), the latter fed the tokens sdpa chose. tokens/s = B x "
        f"{steps} / the time of the {steps} steps (CUDA events around the loop, no compile "
        "inside). Logits of the prompt's last position and of every step compared as above.",
        "",
        "| B | sdpa tok/s | stage 14 paged tok/s | paged / sdpa | ms per step (sdpa, paged) | "
        "logits rel. error | argmax agreement | check |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    ok = True
    for r in rows:
        floor = floor_of(r["rel"])
        good = r["finite"] and r["rel"] <= tol and r["agree"] >= floor
        ok &= good
        lines.append(
            f"| {r['B']} | {r['B'] * steps / r['sdpa_ms'] * 1e3:,.0f} | "
            f"{r['B'] * steps / r['paged_ms'] * 1e3:,.0f} | {r['sdpa_ms'] / r['paged_ms']:.2f}x | "
            f"{r['sdpa_ms'] / steps:.2f}, {r['paged_ms'] / steps:.2f} | {r['rel']:.2e} | "
            f"{r['agree'] * 100:.2f}% (floor {floor * 100:.2f}%) | "
            f"{'PASS' if good else 'FAIL'} |"
        )
    return lines, ok
