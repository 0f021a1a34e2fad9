"""common/tools/model.py: the tutorial kernel inside a transformers Llama (`make model`).

- Without transformers (CI): `make model`'s entry prints a skip message and exits 0. Every other
  CPU test needs transformers (optional) and is skipped with the reason where it is missing.
- CPU, with transformers: the config (32/8 heads of 128, hidden 4096) builds a model on the meta
  device; the registration (attention and mask functions under the tutorial's name); the glue's
  refusals (dropout, padding, non-causal masks and modules, head dims, sliding windows, softcap,
  output_attentions) and what it accepts (no mask, all-ones padding masks, 4D plain-causal masks
  bool and float, a static cache's prefill); with an SDPA-backed stand-in for the kernel, a tiny
  fp32 Llama gives transformers' own logits (prefill, one decode step on the cache, and
  torch.compile(fullgraph=True)); with the real op (its fake implementation) the whole model
  runs under FakeTensorMode; without a Hopper GPU the entry exits 0 with the reason.
- GPU (gpu_hopper): a short `make model` run passes its own logits check and writes its table;
  the model compiled with torch.compile(fullgraph=True) around the op gives the eager logits.
"""

import subprocess
import sys
import types

import pytest
import torch

from common import arch, masks
from common.tools import model as M

ROOT = __file__.rsplit("/tests/", 1)[0]


def tiny_config(head_dim=64, layers=2, **kw):
    return M.model_config(
        layers=layers,
        hidden=256 if head_dim == 64 else 512,
        heads=4,
        kv_heads=2,
        head_dim=head_dim,
        intermediate=256,
        vocab=128,
        max_positions=512,
        **kw,
    )


def reference_attend(q, k, v, scale):
    """What the kernel computes, in SDPA: causal bottom-right aligned, GQA, O in (B, S, H, D)."""
    Sq, Sk = q.shape[2], k.shape[2]
    mask = masks.visible(Sq, Sk, Sk, 0, q.device)
    o = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, scale=scale, enable_gqa=True
    )
    return o.transpose(1, 2)


REF = "flash_tutorial_test_reference"


@pytest.fixture
def tf():
    return pytest.importorskip("transformers", reason="transformers is optional (make model)")


# ---------------------------------------------------------------- skips


def test_main_skips_without_transformers(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers -> ImportError
    assert M.main([]) == 0
    assert "SKIPPED: make model needs transformers" in capsys.readouterr().out


def test_module_entry_exits_0_without_transformers():
    code = (
        "import sys; sys.modules['transformers'] = None; "
        "from common.tools.model import main; sys.exit(main([]))"
    )
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "SKIPPED" in r.stdout


@pytest.mark.skipif(arch.gpu_track_available("hopper"), reason="this machine has a Hopper GPU")
def test_main_skips_without_a_hopper_gpu(tf, capsys):
    assert M.main([]) == 0
    assert "SKIPPED: make model runs the kernel on an sm_90 GPU" in capsys.readouterr().out


# ---------------------------------------------------------------- config and registration


def test_config_is_llama3_attention(tf):
    cfg = M.model_config()
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (32, 8, 128)
    assert cfg.hidden_size == 4096 and cfg.num_hidden_layers == 4
    assert cfg.attention_dropout == 0.0
    with torch.device("meta"):
        model = tf.LlamaForCausalLM(cfg)
    n = sum(p.numel() for p in model.parameters())
    # Per layer 2 * 4096^2 + 2 * 4096 * 1024 (attention) + 3 * 4096^2 (MLP), plus 2 * 4096 * 8192.
    assert (
        n == 4 * (2 * 4096**2 + 2 * 4096 * 1024 + 3 * 4096**2 + 2 * 4096) + 2 * 4096 * 8192 + 4096
    )
    attn = model.model.layers[0].self_attn
    assert attn.is_causal and attn.num_key_value_groups == 4


def test_registration(tf):
    M.register(M.TUTORIAL, M.tutorial_attend)
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    assert M.TUTORIAL in ALL_ATTENTION_FUNCTIONS
    try:
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    except ImportError:
        return
    assert ALL_MASK_ATTENTION_FUNCTIONS[M.TUTORIAL] is ALL_MASK_ATTENTION_FUNCTIONS["sdpa"]


# ---------------------------------------------------------------- refusals and acceptance


def fake_module(causal=True, config_causal=True):
    return types.SimpleNamespace(
        is_causal=causal, config=types.SimpleNamespace(is_causal=config_causal)
    )


def qkv(B=2, H=4, Hkv=2, Sq=16, Sk=16, D=64, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, Sq, D, dtype=dtype, generator=g)
    k = torch.randn(B, Hkv, Sk, D, dtype=dtype, generator=g)
    return q, k, torch.randn(k.shape, dtype=dtype, generator=g)


def causal_mask_4d(B, Sq, Sk, as_float=False):
    m = masks.visible(Sq, Sk, Sk, 0).expand(B, 1, Sq, Sk)
    if as_float:
        return torch.zeros(B, 1, Sq, Sk).masked_fill(~m, torch.finfo(torch.float32).min)
    return m


def padded_2d(B, S):
    m = torch.ones(B, S, dtype=torch.long)
    m[0, :3] = 0
    return m


REFUSALS = {
    "dropout": (dict(dropout=0.1), "dropout"),
    "padding 2D": (dict(mask=lambda: padded_2d(2, 16)), "pads some sequences"),
    "non-causal 4D": (
        dict(mask=lambda: torch.ones(2, 1, 16, 16, dtype=torch.bool)),
        "not the plain causal mask",
    ),
    "sliding 4D": (
        dict(
            mask=lambda: (
                causal_mask_4d(2, 16, 16) & masks.visible(16, 16, 4, 0).expand(2, 1, 16, 16)
            )
        ),
        "not the plain causal mask",
    ),
    "block mask": (dict(mask=lambda: object()), "BlockMask"),
    "non-causal module": (dict(module=lambda: fake_module(causal=False)), "non-causal"),
    "is_causal=False": (dict(kwargs=dict(is_causal=False)), "non-causal"),
    "bidirectional config": (dict(module=lambda: fake_module(config_causal=False)), "non-causal"),
    "head dim 96": (dict(D=96), "head dims"),
    "sliding_window": (dict(kwargs=dict(sliding_window=128)), "sliding_window"),
    "softcap": (dict(kwargs=dict(softcap=30.0)), "softcap"),
    "attention sinks": (dict(kwargs=dict(s_aux=torch.zeros(4))), "s_aux"),
    "output_attentions": (dict(kwargs=dict(output_attentions=True)), "output_attentions"),
    "Sk < Sq": (dict(Sk=8), "causal needs Sk >= Sq"),
}


@pytest.mark.parametrize("case", list(REFUSALS), ids=list(REFUSALS))
def test_refusals(case):
    spec, match = REFUSALS[case]
    called = []
    fn = M.make_attention_function(lambda *a: called.append(a))
    q, k, v = qkv(Sk=spec.get("Sk", 16), D=spec.get("D", 64))
    module = spec.get("module", fake_module)()
    mask = spec.get("mask", lambda: None)()
    with pytest.raises(M.UnsupportedAttention, match=match):
        fn(module, q, k, v, mask, dropout=spec.get("dropout", 0.0), scaling=0.125,
           **spec.get("kwargs", {}))  # fmt: skip
    assert not called  # refused before the kernel


ACCEPTED = {
    "no mask": lambda: None,
    "2D all ones": lambda: torch.ones(2, 16, dtype=torch.long),
    "4D bool causal": lambda: causal_mask_4d(2, 16, 16),
    "4D float causal": lambda: causal_mask_4d(2, 16, 16, as_float=True),
    "4D longer than Sk": lambda: torch.cat(
        [causal_mask_4d(2, 16, 16), torch.zeros(2, 1, 16, 4, dtype=torch.bool)], -1
    ),
}


@pytest.mark.parametrize("case", list(ACCEPTED), ids=list(ACCEPTED))
def test_accepted_masks(case):
    fn = M.make_attention_function(reference_attend)
    q, k, v = qkv()
    out, weights = fn(fake_module(), q, k, v, ACCEPTED[case](), dropout=0.0, scaling=0.125)
    assert weights is None and out.shape == (2, 16, 4, 64) and out.is_contiguous()
    want = reference_attend(q, k, v, 0.125)
    torch.testing.assert_close(out, want)


def test_mask_read_once_per_object(monkeypatch):
    """The layers of a forward share one mask: it is read once; an in-place change, a new object
    or new sizes are read again."""
    reads = []
    visible = masks.visible
    monkeypatch.setattr(masks, "visible", lambda *a, **k: reads.append(a) or visible(*a, **k))
    mask = causal_mask_4d(2, 16, 16).clone()
    reads.clear()
    for _ in range(3):
        assert M.is_plain_causal(mask, 16, 16)
    assert len(reads) == 1
    mask[0, 0, 0, 5] = True  # in place: no longer causal
    assert not M.is_plain_causal(mask, 16, 16)
    assert not M.is_plain_causal(torch.ones(2, 1, 16, 16, dtype=torch.bool), 16, 16)
    assert M.is_plain_causal(causal_mask_4d(2, 8, 16), 8, 16)
    assert not M.is_plain_causal(causal_mask_4d(2, 8, 16), 8, 12)  # sliced: top-left, not causal


def test_static_cache_prefill_slices_keys_like_sdpa():
    seen = []
    fn = M.make_attention_function(lambda q, k, v, s: seen.append(k.shape) or q.transpose(1, 2))
    q, k, v = qkv(Sq=16, Sk=64)
    fn(fake_module(), q, k, v, None, scaling=0.125)
    assert seen == [(2, 2, 16, 64)]


def test_gqa_heads_reach_the_kernel_unrepeated():
    seen = []
    fn = M.make_attention_function(lambda q, k, v, s: seen.append((q.shape, k.shape, s)) or q)
    q, k, v = qkv(H=32, Hkv=8, D=128)
    fn(fake_module(), q, k, v, None, scaling=0.3)
    assert seen == [((2, 32, 16, 128), (2, 8, 16, 128), 0.3)]


# ---------------------------------------------------------------- whole models on the CPU


@pytest.fixture
def tiny_model(tf):
    M.register(REF, reference_attend)
    return M.build_model(tiny_config(), device="cpu", dtype=torch.float32)


def test_glue_gives_transformers_logits(tiny_model):
    ids = torch.randint(0, 128, (2, 40), generator=torch.Generator().manual_seed(0))
    want = M.logits(tiny_model, ids, "sdpa")
    got = M.logits(tiny_model, ids, REF)
    eager = M.logits(tiny_model, ids, "eager")
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(eager, want, rtol=1e-4, atol=1e-4)
    rel, agree, _ = M.compare(got, want)
    assert rel < 1e-5 and agree == 1.0


def test_glue_decode_step_on_the_cache(tiny_model):
    """One query over 41 cached keys: the kernel's bottom-right causal sees them all."""
    ids = torch.randint(0, 128, (2, 41), generator=torch.Generator().manual_seed(1))
    out = {}
    for name in ("sdpa", REF):
        M.set_attention(tiny_model, name)
        with torch.no_grad():
            pre = tiny_model(input_ids=ids[:, :40], use_cache=True)
            cache = pre.past_key_values
            out[name] = tiny_model(input_ids=ids[:, 40:], past_key_values=cache).logits
    torch.testing.assert_close(out[REF], out["sdpa"], rtol=1e-5, atol=1e-5)


def test_paged_cache_decode_gives_dynamic_cache_logits(tiny_model):
    """The decode run's glue on the CPU (common/tools/model_decode.py): a PagedKVCache with pages
    in random order, attention over it in plain torch, fed sdpa's tokens - the logits of the
    prompt's last position and of every step equal sdpa's with its DynamicCache, the pages past
    what was written stay NaN, and the glue refuses a forward without the cache."""
    from common.tools import model_decode as MD

    MD.register_paged(MD.paged_attend_reference)
    rows = MD.decode_run(
        tiny_model, [1, 3], prompt_len=37, steps=12, page_size=16, warmup=3, log=lambda m: None
    )
    for r in rows:
        assert r["finite"] and r["rel"] < 1e-5 and r["agree"] == 1.0, r
    cache = MD.PagedKVCache(2, 2, 2, 64, 40, 16, torch.float32, "cpu")
    assert sorted(cache.page_table.flatten().tolist()) != list(range(6))  # drawn, not in order
    cache.begin(5)
    cache.update(torch.ones(2, 2, 5, 64), torch.ones(2, 2, 5, 64), 0)
    first = cache.page_table[:, 0].long()
    assert (cache.k[0][first, :5] == 1).all() and cache.k[0][first, 5:].isnan().all()
    assert cache.seqused_k.tolist() == [5, 5]
    with pytest.raises(ValueError, match="exceed"):
        cache.begin(100)
    M.set_attention(tiny_model, MD.PAGED)
    with torch.no_grad(), pytest.raises(M.UnsupportedAttention, match="paged_cache"):
        tiny_model(input_ids=torch.zeros(1, 4, dtype=torch.long), use_cache=False)


def test_paged_cache_positions_without_position_ids(tiny_model):
    """transformers starts the positions it is not given at cache.get_seq_length(): the keys
    cached before this forward. The same prompt and steps, fed without position_ids, give the
    logits of the run that passes them (a count that included the forward's own tokens would
    shift every position by that many)."""
    from common.tools import model_decode as MD

    MD.register_paged(MD.paged_attend_reference)
    M.set_attention(tiny_model, MD.PAGED)
    B, P, steps = 2, 11, 3
    ids = torch.randint(0, 128, (B, P + steps), generator=torch.Generator().manual_seed(4))
    logits = {}
    for given in (True, False):
        cache = MD.PagedKVCache(2, B, 2, 64, P + steps, 8, torch.float32, "cpu")
        out = []
        with torch.no_grad():
            for start, stop in [(0, P)] + [(P + i, P + i + 1) for i in range(steps)]:
                cache.begin(stop - start)
                assert cache.get_seq_length() == start
                extra = dict(position_ids=torch.arange(start, stop).expand(B, -1)) if given else {}
                out.append(
                    tiny_model(
                        input_ids=ids[:, start:stop],
                        past_key_values=cache,
                        use_cache=True,
                        paged_cache=cache,
                        **extra,
                    ).logits[:, -1]
                )
                assert [cache.get_seq_length(i) for i in range(2)] == [stop, stop]
        logits[given] = torch.stack(out)
    torch.testing.assert_close(logits[False], logits[True], rtol=0, atol=0)
    cache.rewind(P)
    assert cache.get_seq_length() == P and cache.get_seq_length(1) == P


def test_padded_batch_is_refused(tiny_model):
    M.set_attention(tiny_model, REF)
    ids = torch.randint(0, 128, (2, 20))
    with torch.no_grad(), pytest.raises(M.UnsupportedAttention):
        tiny_model(input_ids=ids, attention_mask=padded_2d(2, 20), use_cache=False)
    with torch.no_grad():  # all-ones: no padding, accepted
        tiny_model(input_ids=ids, attention_mask=torch.ones(2, 20, dtype=torch.long))


def test_glue_compiles_fullgraph(tiny_model):
    torch._dynamo.reset()
    ids = torch.randint(0, 128, (2, 40), generator=torch.Generator().manual_seed(2))
    want = M.logits(tiny_model, ids, "sdpa")
    M.set_attention(tiny_model, REF)
    compiled = torch.compile(tiny_model, fullgraph=True, backend="aot_eager")
    with torch.no_grad():
        got = compiled(input_ids=ids, use_cache=False).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_real_op_in_the_model_under_fake_tensors(tf):
    """The tutorial's attention function with the real custom op: under FakeTensorMode the op's
    fake implementation gives every layer its output shape (no GPU)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    M.register(M.TUTORIAL, M.tutorial_attend)
    model = M.build_model(tiny_config(head_dim=128), device="cpu", dtype=torch.bfloat16)
    M.set_attention(model, M.TUTORIAL)
    with FakeTensorMode() as mode:
        state = {k: mode.from_tensor(t) for k, t in [*model.named_parameters(), *model.named_buffers()]}  # fmt: skip
        ids = mode.from_tensor(torch.randint(0, 128, (2, 50)))
        with torch.no_grad():
            out = torch.func.functional_call(
                model, state, (), {"input_ids": ids, "use_cache": False}
            )
    assert out.logits.shape == (2, 50, 128) and out.logits.dtype == torch.bfloat16


def test_real_op_in_the_model_compiles_fullgraph(tf):
    """torch.compile(fullgraph=True) of the whole model with the tutorial's attention function:
    one graph, one op node per layer; under tracing transformers builds a 4D mask, which the glue
    turns into a device-side assertion (run here on meta tensors: no kernel, no GPU)."""
    torch._dynamo.reset()
    M.register(M.TUTORIAL, M.tutorial_attend)
    model = M.build_model(tiny_config(head_dim=128), device="meta", dtype=torch.bfloat16)
    M.set_attention(model, M.TUTORIAL)
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    compiled = torch.compile(model, fullgraph=True, backend=capture)
    ids = torch.zeros(2, 50, dtype=torch.long, device="meta")
    try:
        with torch.no_grad():
            out = compiled(input_ids=ids, use_cache=False)
    except torch._dynamo.exc.InternalTorchDynamoError as e:
        if "unsupported scalarType" not in str(e):
            raise
        # transformers < 5's rotary embedding enters torch.autocast on the tensors' device type,
        # which has no autocast dtype for meta: a limit of this CPU stand-in, not of the glue.
        pytest.skip(f"transformers {tf.__version__}: autocast on meta tensors does not trace")
    assert out.logits.shape == (2, 50, 128)
    assert len(graphs) == 1
    targets = [str(n.target) for n in graphs[0].graph.nodes]
    assert sum("flash_tutorial.attention" in t for t in targets) == 2  # one per layer


def test_tolerances():
    assert M.logits_tolerance(4) == 5 / 256
    assert M.argmax_floor(0.0, 8192) == pytest.approx(0.995)
    assert M.argmax_floor(5e-3, 8192) < M.argmax_floor(1e-3, 8192) < 1
    assert M.parse_shapes("2x2048,1X8192") == [(2, 2048), (1, 8192)]


# ---------------------------------------------------------------- GPU


@pytest.mark.gpu_hopper
def test_make_model_short_run(tf, tmp_path, capsys):
    rc = M.main(
        ["--layers", "2", "--check-shape", "2x1024", "--shapes", "1x2048", "--reps", "3"]
        + ["--warmup", "1", "--no-eager", "--decode-batches", "", "--out", str(tmp_path)]
    )
    out = capsys.readouterr().out
    assert rc == 0, out
    written = list(tmp_path.glob("model_*.md"))
    assert len(written) == 1 and "PASS" in written[0].read_text()


@pytest.mark.gpu_hopper
def test_make_model_decode_short_run(tf, tmp_path, capsys):
    """The decode run with stage 14 on the paged cache: a prompt that is not a page multiple,
    teacher-forced steps crossing page boundaries, logits within make model's tolerance."""
    rc = M.main(
        ["--layers", "2", "--decode-only", "--decode-batches", "1,3", "--decode-prompt", "1000"]
        + ["--decode-steps", "40", "--page-size", "16", "--out", str(tmp_path)]
    )
    out = capsys.readouterr().out
    assert rc == 0, out
    text = list(tmp_path.glob("model_*.md"))[0].read_text()
    assert text.count("| PASS |") == 2, text


@pytest.mark.gpu_hopper
def test_compiled_model_with_the_kernel(tf):
    torch._dynamo.reset()
    M.register(M.TUTORIAL, M.tutorial_attend)
    model = M.build_model(tiny_config(head_dim=128, layers=2), device="cuda")
    ids = torch.randint(
        0, 128, (2, 300), device="cuda", generator=torch.Generator(device="cuda").manual_seed(3)
    )
    want = M.logits(model, ids, M.TUTORIAL)
    ref = M.logits(model, ids, "sdpa")
    M.set_attention(model, M.TUTORIAL)
    compiled = torch.compile(model, fullgraph=True)
    with torch.no_grad():
        got = compiled(input_ids=ids, use_cache=False).logits
    rel, agree, _ = M.compare(got, want)
    assert rel < 1e-2 and agree > 0.95, (rel, agree)
    rel, _, _ = M.compare(want, ref)
    assert rel < M.logits_tolerance(2), rel


def test_paged_glue_refuses_a_padding_mask():
    """A padding mask given with the paged cache is refused by name, not dropped: transformers
    passes an implementation without a mask function no mask at all."""
    pytest.importorskip("transformers", reason="transformers is optional (make model)")
    from common.tools import model as M
    from common.tools import model_decode as MD

    config = M.model_config(
        layers=2,
        hidden=256,
        heads=4,
        kv_heads=2,
        head_dim=64,
        intermediate=256,
        vocab=128,
        max_positions=512,
    )
    model = M.build_model(config, device="cpu", dtype=torch.float32)
    MD.register_paged(MD.paged_attend_reference)
    M.set_attention(model, MD.PAGED)
    B, P = 2, 10
    ids = torch.randint(0, 128, (B, P), generator=torch.Generator().manual_seed(0))
    padding = torch.ones(B, P, dtype=torch.long)
    padding[1, :4] = 0  # sequence 1 left-padded by 4 tokens
    cache = MD.PagedKVCache(2, B, 2, 64, 16, 16, torch.float32, "cpu")
    cache.begin(P)
    with torch.no_grad(), pytest.raises(M.UnsupportedAttention, match="mask"):
        model(
            input_ids=ids,
            attention_mask=padding,
            past_key_values=cache,
            position_ids=torch.arange(P).expand(B, P),
            use_cache=True,
            paged_cache=cache,
        )
