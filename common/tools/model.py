"""`make model`: the tutorial's attention kernel inside a real model.

A Llama-style decoder from `transformers`, random weights from a config (nothing downloaded):
32 query heads, 8 KV heads, head_dim 128 (hidden 4096, Llama-3-8B's attention), causal, bf16 on
the GPU. Its attention is replaced by the tutorial's kernel through transformers' attention-
function registry (`AttentionInterface.register` and `config._attn_implementation`), the kernel
called as the custom op `torch.ops.flash_tutorial.attention` (common/ops.py) with K and V of 8
heads as they come (no repeat_kv), once per stage with that API (7: GQA and packed sequences,
8: warp specialisation; `--stages` picks). Then, in one run on one GPU:

1. logits of each stage's model against the same model (same weights, same tokens) on
   transformers' own "sdpa" implementation, prefill B = 2, S = 2048: ||a - b|| / ||b|| in fp32 and
   the argmax agreement, against a stated tolerance (below); transformers' "eager" against "sdpa"
   is printed next to it as a yardstick of what two correct bf16 implementations differ by;
2. prefill tokens/s for each stage, sdpa, and FA4 (flash_attn.cute) when importable, with a
   floor (an attention function that returns its query: the time of everything but attention),
   CUDA-event medians after warm-up;
3. a decode run (common/tools/model_decode.py): 256 tokens generated after a 32k-token prompt at
   B = 1 and 8, stage 14's kernel on this repository's paged KV cache against sdpa with
   transformers' own cache, tokens/s and the logits of every step compared;
4. a table on stdout and in results/model_<gpu>_<date>.md (--out picks the folder).

The model (`model_config`): 4 layers, hidden 4096, 32/8 heads of 128, intermediate 4096, vocabulary
8192. Attention is exactly Llama-3-8B's per layer; the MLP (14336 there) and the vocabulary
(128256) are cut so that the ~0.9 GB of weights build in seconds and attention is a visible part
of a forward pass (causal, S = 8k: 27% of a layer's FLOPs, against 13% with Llama-3-8B's MLP),
which is what this comparison is about. Four layers are enough to see errors propagate through the residual stream.

Tolerance of the logits check: bf16 keeps 8 significant bits, unit roundoff u = 2^-8 = 3.9e-3.
Two correct implementations differ in where they round (P to bf16 before P @ V, O to bf16), so
each layer's attention output differs by about one rounding, relative ~u; the residual stream
carries each layer's difference on to the logits, which are themselves rounded to bf16 once
more. Adding those coherently (the worst case): rel_tol = (layers + 1) * u = 1.95e-2 for 4
layers; independent errors would give about sqrt(layers + 1) * u / 2, a few 1e-3, which is what
eager vs sdpa is expected to show (it is printed as the yardstick). The argmax follows from that error: the gap between the two largest of V
Gaussian logits has density about sqrt(2 ln V) / sigma at zero, so a perturbation of relative
size rel flips about sqrt(2) * rel * sqrt(2 ln V) of the argmaxes; the check allows 3x that
(at least 0.5%).

What the kernel cannot do is refused with UnsupportedAttention (a ValueError) rather than
computed wrongly: dropout > 0, an attention mask that is not the plain causal one (padding,
packed sequences in one row, a static cache's empty slots, biases), non-causal attention,
sliding windows / softcap / attention sinks, head dims other than 64 and 128, and
output_attentions. With no padding transformers passes no mask (its sdpa mask function returns
None for plain causal, which this module registers for the tutorial's name as well) and the
kernel computes the causal mask itself (bottom-right aligned, the same as top-left at Sq == Sk).

Without transformers this prints a skip message and exits 0; without an sm_90 GPU (the Hopper
track, the one run on hardware) it prints which GPU it needs and exits 0."""

import argparse
import math
import os
import sys
import time
import weakref

import torch

from common import arch, masks, ops
from common.tools import timing

TUTORIAL = "flash_tutorial"  # transformers' attn_implementation name of the tutorial kernel
FA4 = "flash_tutorial_fa4"  # FA4 (flash_attn.cute.flash_attn_func) through the same glue
NO_ATTENTION = "flash_tutorial_none"  # timing floor: returns the query, computes nothing
HEAD_DIMS = (64, 128)
UNIT_ROUNDOFF_BF16 = 2.0**-8


class UnsupportedAttention(ValueError):
    """A call the tutorial kernel cannot compute as transformers means it."""


def import_transformers():
    """The transformers module, or None when it is not installed (it is optional)."""
    try:
        import transformers
    except ImportError:
        return None
    return transformers


def model_config(
    layers=4,
    hidden=4096,
    heads=32,
    kv_heads=8,
    head_dim=128,
    intermediate=4096,
    vocab=8192,
    max_positions=32768,
    attn_implementation="sdpa",
):
    """A LlamaConfig: Llama-3-8B's attention (32 query / 8 KV heads of 128, RoPE theta 5e5), few
    layers, a small MLP and vocabulary (module docstring: why)."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        max_position_embeddings=max_positions,
        rope_theta=500000.0,
        attention_bias=False,
        attention_dropout=0.0,
        tie_word_embeddings=False,
        attn_implementation=attn_implementation,
    )


# ------------------------------------------------------------------ the attention function


# The last mask found plain causal, by identity (a weak reference, so never a recycled object)
# and version (an in-place change counts as a new mask): the layers of one forward pass share one
# mask object, which is then read once, not once per layer.
_LAST_CAUSAL = {"ref": None, "version": None, "shape": None}


def is_plain_causal(mask, Sq, Sk):
    """Whether a 4D mask (bool: True = attend; float: 0 = attend, a large negative = masked) is
    exactly the causal mask over Sq queries and Sk keys, bottom-right aligned (the last query sees
    every key; the kernel's causal), for every batch entry and head. Reads the mask (one small
    device-to-host synchronisation, once per mask object); transformers >= 4.53 passes one only
    when a mask is needed, older versions always build one for a custom implementation."""
    if mask.dim() != 4 or mask.shape[-2] != Sq or mask.shape[-1] < Sk:
        return False
    tracing = _tracing(mask)
    key = (Sq, Sk)
    if not tracing:
        ref = _LAST_CAUSAL["ref"]
        if ref is not None and ref() is mask and _LAST_CAUSAL["version"] == mask._version:
            if _LAST_CAUSAL["shape"] == key:
                return True
    m = mask[..., :Sk]  # transformers' own functions slice a longer mask the same way
    seen = m if m.dtype == torch.bool else m == 0
    want = masks.visible(Sq, Sk, Sk, 0, device=m.device)
    ok = _all(seen == want, "the attention mask is not the plain causal mask")
    if ok and not tracing:
        _LAST_CAUSAL.update(ref=weakref.ref(mask), version=mask._version, shape=key)
    return ok


def _tracing(t):
    from torch._subclasses.fake_tensor import is_fake

    return torch.compiler.is_compiling() or is_fake(t)


def _all(cond, what):
    """bool(cond.all()), or, while torch.compile / FakeTensorMode traces (where transformers
    always builds a 4D mask and no value can be read), a device-side assertion in the graph:
    True here, and a failed CUDA assertion at run time if the mask was not plain causal after
    all."""
    if _tracing(cond):
        torch._assert_async(cond.all(), f"flash_tutorial attention: {what}")
        return True
    return bool(cond.all())


def check_call(module, query, key, value, attention_mask, dropout, is_causal, kwargs):
    """Refuse what the kernel cannot compute; returns (key, value), sliced to Sq keys in the one
    case transformers' sdpa path slices them too (no mask, Sk > Sq > 1: a static cache's
    prefill, whose slots past Sq are empty)."""
    name = type(module).__name__
    if dropout and dropout > 0:
        raise UnsupportedAttention(
            f"{name}: attention dropout = {dropout}; the tutorial kernel has no dropout "
            "(use it for inference: model.eval(), or attention_dropout = 0)"
        )
    for kw in ("softcap", "sliding_window", "s_aux", "position_bias", "head_mask"):
        if kwargs.get(kw) is not None:
            raise UnsupportedAttention(
                f"{name}: '{kw}' is not supported by the tutorial kernel (plain causal softmax "
                "attention only)"
            )
    if kwargs.get("output_attentions"):
        raise UnsupportedAttention(
            f"{name}: output_attentions=True needs the attention weights, which a flash kernel "
            "never forms; use attn_implementation='eager' for them"
        )
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    config = getattr(module, "config", None)
    if not causal or (config is not None and getattr(config, "is_causal", True) is False):
        raise UnsupportedAttention(
            f"{name}: non-causal attention; the model integration runs causal decoders only "
            "(the kernel itself takes causal=False, but transformers would then pass masks this "
            "glue does not translate)"
        )
    D = query.shape[-1]
    if D not in HEAD_DIMS or key.shape[-1] != D or value.shape[-1] != D:
        raise UnsupportedAttention(
            f"{name}: head dims q {D}, k {key.shape[-1]}, v {value.shape[-1]}; the kernel is "
            f"specialised for D in {HEAD_DIMS} with one D for Q, K and V"
        )
    Sq, Sk = query.shape[2], key.shape[2]
    if attention_mask is None:
        if Sq > 1 and Sk > Sq:
            key, value = key[:, :, :Sq], value[:, :, :Sq]
        elif Sk < Sq:
            raise UnsupportedAttention(
                f"{name}: {Sq} queries and {Sk} keys with no mask; causal needs Sk >= Sq"
            )
        return key, value
    if not isinstance(attention_mask, torch.Tensor):
        raise UnsupportedAttention(
            f"{name}: attention mask of type {type(attention_mask).__name__} (e.g. flex "
            "attention's BlockMask); the tutorial kernel takes no mask"
        )
    if attention_mask.dim() == 2:
        # A 2D padding mask (batch, keys): only all-ones means "no padding".
        if attention_mask.shape[-1] >= Sk and _all(
            attention_mask[:, -Sk:].bool(), "the 2D attention mask pads a sequence"
        ):
            return key, value
        raise UnsupportedAttention(
            f"{name}: the attention mask pads some sequences; the batch kernel computes plain "
            "causal attention only (packed sequences: common.ops.attention_varlen)"
        )
    if is_plain_causal(attention_mask, Sq, Sk):
        return key, value
    raise UnsupportedAttention(
        f"{name}: the attention mask {tuple(attention_mask.shape)} is not the plain causal mask "
        f"over {Sq} queries and {Sk} keys (padding, packed sequences, a static cache's empty "
        "slots or a bias); the tutorial kernel computes plain causal attention only"
    )


def make_attention_function(attend):
    """A transformers attention function around attend(q, k, v, scale) -> O in (B, Sq, H, D)
    (any strides), called with q (B, H, Sq, D) and k, v (B, Hkv, Sk, D) exactly as transformers
    passes them (GQA: Hkv heads, not repeated). Returns (attn_output (B, Sq, H, D) contiguous,
    None): transformers' contract, the same as its sdpa_attention_forward."""

    def attention_forward(
        module,
        query,
        key,
        value,
        attention_mask,
        dropout=0.0,
        scaling=None,
        is_causal=None,
        **kwargs,
    ):
        key, value = check_call(
            module, query, key, value, attention_mask, dropout, is_causal, kwargs
        )
        return attend(query, key, value, scaling).contiguous(), None

    return attention_forward


def tutorial_attend(q, k, v, scale):
    """The tutorial's kernel (common.ops.current_stage()) through the ops' wrapper, causal
    (bottom-right aligned): the custom op under torch.compile, the stage directly in eager mode."""
    return ops.attention(q, k, v, scale=scale, causal=True).transpose(1, 2)


def fa4_attend_or_none():
    """FA4's CuTe DSL forward as an attend function, or None when flash_attn.cute does not
    import."""
    try:
        from flash_attn.cute import flash_attn_func
    except Exception:
        return None

    def attend(q, k, v, scale):
        # (B, H, S, D) views -> (B, S, H, D) views of the same memory: FA4's layout.
        out = flash_attn_func(
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            softmax_scale=scale,
            causal=True,
        )
        return out[0] if isinstance(out, tuple) else out

    return attend


def no_attend(q, k, v, scale):
    """Timing floor only: the query itself, O = Q (wrong on purpose, nothing computed)."""
    return q.transpose(1, 2)


def register(name, attend):
    """Register make_attention_function(attend) as transformers' attn_implementation `name`,
    and, where transformers has mask functions per implementation (>= 4.53), its sdpa mask
    function under the same name: None for plain causal (the kernel's own), a 4D mask otherwise,
    which check_call refuses unless it is plain causal. Works from transformers 4.48 on."""
    fn = make_attention_function(attend)
    try:
        from transformers import AttentionInterface

        AttentionInterface.register(name, fn)
    except ImportError:  # before AttentionInterface: a plain dict
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        ALL_ATTENTION_FUNCTIONS[name] = fn
    try:
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    except ImportError:  # before masking_utils, custom implementations get a 4D float mask
        return fn
    AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    return fn


def set_attention(model, name):
    """Switch every config of the model (they are usually one shared object) to `name`; the
    attention modules and the mask builder read it at each forward."""
    seen = set()
    for m in [model, *model.modules()]:
        cfg = getattr(m, "config", None)
        if cfg is not None and id(cfg) not in seen:
            seen.add(id(cfg))
            cfg._attn_implementation = name


def build_model(config, device="cuda", dtype=torch.bfloat16, seed=0):
    """LlamaForCausalLM(config) with transformers' random initialisation (seeded), in eval mode,
    no parameter requiring grad (the kernels are forward-only)."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    with torch.device(device):
        model = LlamaForCausalLM(config)
    model = model.to(dtype).eval()
    model.requires_grad_(False)
    return model


def logits(model, ids, name):
    set_attention(model, name)
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False).logits


def compare(a, b):
    """(relative error ||a - b|| / ||b|| in fp32, argmax agreement, max |a - b|)."""
    a, b = a.float(), b.float()
    rel = (torch.linalg.vector_norm(a - b) / torch.linalg.vector_norm(b)).item()
    agree = (a.argmax(-1) == b.argmax(-1)).float().mean().item()
    return rel, agree, (a - b).abs().max().item()


def logits_tolerance(layers):
    """(layers + 1) bf16 roundings, coherent (module docstring)."""
    return (layers + 1) * UNIT_ROUNDOFF_BF16


def argmax_floor(rel, vocab):
    """Lowest argmax agreement that a logit perturbation of relative size rel explains, with a
    margin of 3 (module docstring)."""
    return 1.0 - max(0.005, 3 * math.sqrt(2) * rel * math.sqrt(2 * math.log(vocab)))


def prefill_ms(model, ids, name, warmup=3, reps=20):
    set_attention(model, name)

    def run(x):
        with torch.no_grad():
            model(input_ids=x, use_cache=False)

    return timing.time_ms(run, [(ids,)], warmup=warmup, reps=reps)


def parse_shapes(text):
    out = []
    for part in text.split(","):
        b, s = part.lower().split("x")
        out.append((int(b), int(s)))
    return out


def skip_reason():
    """Why `make model` cannot run here, or None."""
    if import_transformers() is None:
        return (
            "SKIPPED: make model needs transformers, which is not installed (it is optional: "
            "pip install 'transformers>=4.48')"
        )
    if not arch.gpu_track_available("hopper"):
        return (
            "SKIPPED: make model runs the kernel on an sm_90 GPU (H100/H200, the Hopper track, the "
            f"one run on hardware); this machine has {arch.gpu_description()}"
        )
    return None


def _run_as(impl):
    """The context in which a column runs: its stage pinned for the tutorial's columns."""
    import contextlib

    return ops.use_stage(impl["stage"]) if impl["stage"] is not None else contextlib.nullcontext()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--intermediate", type=int, default=4096)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument(
        "--stages", default="", help="comma-separated stages to run (default: every stage >= 7)"
    )
    ap.add_argument("--check-shape", default="2x2048", help="BxS of the logits comparison")
    ap.add_argument("--shapes", default="2x2048,1x8192,1x16384", help="BxS prefill timings")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--no-eager", action="store_true", help="skip the eager-vs-sdpa yardstick")
    ap.add_argument("--decode-batches", default="1,8", help="B of the decode run ('' to skip it)")
    ap.add_argument("--decode-prompt", type=int, default=32768, help="prompt tokens, decode run")
    ap.add_argument("--decode-steps", type=int, default=256, help="tokens generated, decode run")
    ap.add_argument("--page-size", type=int, default=64, help="keys per page, decode run")
    ap.add_argument("--decode-only", action="store_true", help="only the decode run")
    ap.add_argument(
        "--out",
        default="results",
        help="folder of the .md ('' to not write; default results/, not tracked by git)",
    )
    args = ap.parse_args(argv)

    reason = skip_reason()
    if reason is not None:
        print(reason, flush=True)
        return 0
    import transformers

    from common.outputs import no_poison

    t0 = time.time()
    gpu, date = timing.gpu_and_date()
    print(
        f"make model on {arch.gpu_description()}: transformers {transformers.__version__}, "
        f"torch {torch.__version__}",
        flush=True,
    )
    stage_list = [int(x) for x in args.stages.split(",")] if args.stages else ops.stage_numbers()
    register(TUTORIAL, tutorial_attend)
    register(NO_ATTENTION, no_attend)
    impls = [
        {"key": f"stage {n}", "name": TUTORIAL, "stage": n, "label": f"stage {n}"}
        for n in stage_list
    ]
    impls.append({"key": "sdpa", "name": "sdpa", "stage": None, "label": "sdpa"})
    fa4 = fa4_attend_or_none()
    if fa4 is not None:
        register(FA4, fa4)
        impls.append({"key": "FA4", "name": FA4, "stage": None, "label": "FA4"})
    else:
        print("FA4: flash_attn.cute does not import here; its column is skipped", flush=True)
    floor_impl = {"key": "floor", "name": NO_ATTENTION, "stage": None, "label": "no attention"}

    max_positions = max(32768, args.decode_prompt + args.decode_steps)
    config = model_config(
        layers=args.layers,
        intermediate=args.intermediate,
        vocab=args.vocab,
        max_positions=max_positions,
    )
    layers, vocab = config.num_hidden_layers, config.vocab_size
    print(
        f"building LlamaForCausalLM: {layers} layers, hidden {config.hidden_size}, "
        f"{config.num_attention_heads}/{config.num_key_value_heads} heads of {config.head_dim}, "
        f"intermediate {config.intermediate_size}, vocab {vocab}, random weights, bf16 ...",
        flush=True,
    )
    model = build_model(config)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"  {n_params / 1e6:.0f} M parameters ({time.time() - t0:.0f} s)", flush=True)

    rows, verdicts, speed, ok = [], [], [], True
    B, S = parse_shapes(args.check_shape)[0]
    tol = logits_tolerance(layers)
    g = torch.Generator(device="cuda")
    g.manual_seed(1)
    if not args.decode_only:
        # 1. Logits against sdpa, each stage gated by the tolerance.
        ids = torch.randint(0, vocab, (B, S), generator=g, device="cuda")
        print(f"logits at B = {B}, S = {S}: sdpa ...", flush=True)
        ref = logits(model, ids, "sdpa")
        for impl in impls:
            if impl["name"] == "sdpa":
                continue
            ours = impl["stage"] is not None
            print(
                f"  {impl['label']}"
                + (" (the first call compiles the kernel)" if ours else "")
                + " ...",
                flush=True,
            )
            t1 = time.time()
            try:
                with _run_as(impl):
                    out = logits(model, ids, impl["name"])
            except Exception as e:
                if ours:
                    raise
                print(f"  {impl['label']}: failed ({type(e).__name__}: {str(e)[:120]})", flush=True)
                continue
            rel, agree, mx = compare(out, ref)
            finite = bool(torch.isfinite(out.float()).all())
            del out
            print(
                f"  rel {rel:.2e}, argmax {agree * 100:.2f}% ({time.time() - t1:.0f} s)", flush=True
            )
            rows.append((f"{impl['label']} vs sdpa", rel, agree, mx))
            if ours:
                floor = argmax_floor(rel, vocab)
                verdicts.append(
                    (impl["label"], rel, agree, floor, finite and rel <= tol and agree >= floor)
                )
        if not args.no_eager:
            print("  eager (yardstick) ...", flush=True)
            rows.append(("eager vs sdpa (yardstick)", *compare(logits(model, ids, "eager"), ref)))
        del ref
        torch.cuda.empty_cache()
        ok = all(v[-1] for v in verdicts)

        # 2. Prefill tokens/s.
        speed = []
        for Bt, St in parse_shapes(args.shapes):
            ids_t = torch.randint(0, vocab, (Bt, St), generator=g, device="cuda")
            row = {}
            for impl in impls + [floor_impl]:
                print(f"prefill B = {Bt}, S = {St}: {impl['label']} ...", flush=True)
                try:
                    # As make bench: the NaN fill of the kernel's fresh outputs is not timed.
                    with no_poison(), _run_as(impl):
                        row[impl["key"]] = prefill_ms(
                            model, ids_t, impl["name"], args.warmup, args.reps
                        )
                except Exception as e:  # a column that cannot run this shape is reported
                    print(
                        f"  {impl['label']}: failed ({type(e).__name__}: {str(e)[:120]})",
                        flush=True,
                    )
                    continue
                ms = row[impl["key"]]
                print(f"  {ms:.2f} ms, {Bt * St / ms * 1e3:,.0f} tokens/s", flush=True)
            speed.append(((Bt, St), row))
            del ids_t
            torch.cuda.empty_cache()

    # 3. Decode with the paged cache.
    decode_rows = []
    batches = [int(x) for x in args.decode_batches.split(",") if x]
    if batches:
        from common.tools import model_decode

        model_decode.register_paged(model_decode.paged_attend_stage14())
        with no_poison():
            decode_rows = model_decode.decode_run(
                model,
                batches,
                args.decode_prompt,
                args.decode_steps,
                args.page_size,
                log=lambda m: print(m, flush=True),
            )

    latest = f"stage {stage_list[-1]}"
    lines = [
        f"# A Llama-style model with the tutorial's attention, {gpu}, {date}",
        "",
        f"`make model` (common/tools/model.py). transformers {transformers.__version__}, torch "
        f"{torch.__version__}. LlamaForCausalLM from a config, random weights (seed 0), bf16: "
        f"{layers} layers, hidden {config.hidden_size}, {config.num_attention_heads} query / "
        f"{config.num_key_value_heads} KV heads of {config.head_dim}, intermediate "
        f"{config.intermediate_size}, vocabulary {vocab} ({n_params / 1e6:.0f} M parameters). "
        "Attention through transformers' AttentionInterface: the tutorial's kernel of each "
        "stage as the custom op torch.ops.flash_tutorial.attention (common/ops.py), K and V with "
        f"{config.num_key_value_heads} heads as they come (no repeat_kv); FA4 "
        "(flash_attn.cute.flash_attn_func) through the same glue; sdpa and eager are "
        "transformers' own.",
        "",
    ]
    if not args.decode_only:
        lines += prefill_lines(args, B, S, rows, verdicts, speed, tol, impls, latest)
    if decode_rows:
        dec, dec_ok = model_decode.decode_lines(
            decode_rows,
            args.decode_prompt,
            args.decode_steps,
            args.page_size,
            tol,
            lambda rel: argmax_floor(rel, vocab),
        )
        lines += dec + [""]
        ok &= dec_ok
    lines += [f"Took {time.time() - t0:.0f} s."]
    text = "\n".join(lines) + "\n"
    print("\n" + text, flush=True)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        tag = f"{timing.file_tag(gpu)}_{date}"
        path = os.path.join(args.out, f"model_{tag}.md")
        with open(path, "w") as f:
            f.write(text)
        print(f"written to {path}", flush=True)
    if not ok:
        for lab, rel, agree, fl, good in verdicts:
            if not good:
                print(
                    f"FAIL: {lab} vs sdpa rel {rel:.2e} (tolerance {tol:.2e}), argmax agreement "
                    f"{agree * 100:.2f}% (floor {fl * 100:.2f}%), or non-finite logits",
                    flush=True,
                )
        if decode_rows and not dec_ok:
            print("FAIL: the decode run's logits (its table says which batch size)", flush=True)
        return 1
    return 0


def prefill_lines(args, B, S, rows, verdicts, speed, tol, impls, latest):
    """The logits and prefill sections of make model's .md."""
    lines = [
        f"## Logits against transformers' sdpa (B = {B}, S = {S}, all positions)",
        "",
        "| comparison | rel. error ‖a − b‖/‖b‖ (fp32) | argmax agreement | max abs diff |",
        "| --- | --- | --- | --- |",
    ]
    lines += [f"| {n} | {r:.2e} | {a * 100:.2f}% | {m:.3g} |" for n, r, a, m in rows]
    lines += [
        "",
        f"Tolerance: rel ≤ (layers + 1) · 2^-8 = {tol:.2e} (one bf16 rounding per layer plus the "
        "logits', added coherently) and an argmax agreement of at least what a perturbation of "
        "the measured size explains, with a margin of 3: "
        + "; ".join(
            f"{lab} ≥ {fl * 100:.2f}%: **{'PASS' if good else 'FAIL'}**"
            for lab, _, _, fl, good in verdicts
        )
        + ".",
        "",
        "## Prefill tokens/s (a forward pass over B x S tokens, use_cache=False, all logits)",
        "",
        f"CUDA-event medians of {args.reps} forwards after {args.warmup} warm-up ones, every "
        "column in this run. `floor` = the same model with an attention function that returns "
        "its query (everything but attention); `attn ms` = a column's time minus the floor, "
        "the attention of all layers per forward.",
        "",
    ]
    cols = [impl for impl in impls]
    lines += [
        "| B x S | "
        + " | ".join(f"{c['label']} tok/s | attn ms" for c in cols)
        + f" | floor ms | {latest} / sdpa tok/s |",
        "|" + " --- |" * (2 * len(cols) + 3),
    ]
    for (Bt, St), row in speed:
        floor_ms = row.get("floor")
        cells = []
        for c in cols:
            ms = row.get(c["key"])
            if ms is None:
                cells.append("- | -")
                continue
            attn = f"{ms - floor_ms:.2f}" if floor_ms is not None else "-"
            cells.append(f"{Bt * St / ms * 1e3:,.0f} | {attn}")
        ratio = f"{row['sdpa'] / row[latest]:.2f}x" if latest in row and "sdpa" in row else "-"
        floor_txt = f"{floor_ms:.2f}" if floor_ms is not None else "-"
        lines.append(f"| {Bt} x {St} | " + " | ".join(cells) + f" | {floor_txt} | {ratio} |")
    lines.append("")
    return lines


if __name__ == "__main__":
    sys.exit(main())
