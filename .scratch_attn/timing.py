"""Quick timings (median of CUDA-event timings, common.bench.time_ms) of the stage entry points at
the FlashAttention shapes (B*S = 16k tokens, H*D = 2048), SDPA flash timed in the same run."""
import datetime
import torch
from common import bench, inputs, checker, reference
from stages.stage2_qk import hopper as s2
from stages.stage3_softmax import hopper as s3
from stages.stage4_kv_interleave import hopper as s4
from stages.stage5_online_softmax import hopper as s5
print(torch.cuda.get_device_name(), datetime.date.today(), flush=True)
sdpa = bench.sdpa_backend_fn("flash")
with checker.no_poison():
    for (S, D, dtype) in [(8192, 128, torch.bfloat16), (8192, 64, torch.bfloat16), (2048, 128, torch.bfloat16),
                          (16384, 128, torch.bfloat16), (8192, 128, torch.float16)]:
        H, B = 2048 // D, 16384 // S
        q, k, v = inputs.attention_inputs(B, H, S, S, D, dtype, seed=0)
        fl = reference.attention_flops(B, H, S, S, D)
        ms = bench.time_ms(sdpa, [(q, k, v)], warmup=3, reps=20)
        print(f"{dtype} S={S} D={D} B={B} H={H}: SDPA flash {ms:.3f} ms {bench.tflops(fl, ms):.0f} TFLOP/s", flush=True)
        ref = sdpa(q, k, v).double()
        for name, fn in (("stage5", s5.attention), ("stage4", s4.attention)):
            if name == "stage4" and S == 16384:
                continue
            o = fn(q, k, v); torch.cuda.synchronize()
            ms = bench.time_ms(fn, [(q, k, v)], warmup=3, reps=20)
            print(f"  {name}: {ms:.3f} ms {bench.tflops(fl, ms):.0f} TFLOP/s (rel diff vs SDPA {checker.rel_err(o, ref):.2e})", flush=True)
    q, k, v = inputs.attention_inputs(16, 16, 1024, 128, 128, torch.bfloat16, seed=0)
    fl = reference.attention_flops(16, 16, 1024, 128, 128)
    for name, fn in (("stage3", s3.attention), ("SDPA flash", sdpa)):
        fn(q, k, v); ms = bench.time_ms(fn, [(q, k, v)], warmup=3, reps=20)
        print(f"(16,16,1024,128,128) {name}: {ms:.3f} ms {bench.tflops(fl, ms):.0f} TFLOP/s", flush=True)
    q, k, _ = inputs.attention_inputs(4, 16, 1024, 1024, 128, torch.bfloat16, seed=0)
    fl = 2 * 4 * 16 * 1024 * 1024 * 128
    for name, fn in (("stage2", s2.qk), ("cuBLAS bf16 q@k^T", lambda q, k: torch.matmul(q, k.transpose(-1, -2)))):
        fn(q, k); ms = bench.time_ms(fn, [(q, k)], warmup=3, reps=20)
        print(f"(4,16,1024,1024,128) {name}: {ms:.3f} ms {bench.tflops(fl, ms):.0f} TFLOP/s", flush=True)
