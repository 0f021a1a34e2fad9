"""One small launch per stage (2-5) with a short deadline, before the full tests."""
import sys, time, traceback
import torch
from common import checker, inputs, reference
ok = True
def go(name, fn):
    global ok
    t = time.time()
    try:
        r = checker.run_with_deadline(fn, seconds=20, what=name)
        print(f"{name}: {r} ({time.time()-t:.1f}s)", flush=True)
    except TimeoutError as e:
        print(f"{name}: TIMEOUT {e}", flush=True); sys.exit(3)
    except Exception:
        ok = False
        print(f"{name}: FAILED\n{traceback.format_exc()[-3000:]}", flush=True)

from stages.stage2_qk import hopper as s2
from stages.stage3_softmax import hopper as s3
from stages.stage4_kv_interleave import hopper as s4
from stages.stage5_online_softmax import hopper as s5
for D in (64, 128):
    q, k, v = inputs.attention_inputs(2, 3, 200, 260, D, torch.bfloat16, seed=1)
    go(f"stage2 D={D}", lambda: checker.compare("S", s2.qk(q, k), reference.qk_ref(q, k), rtol=1e-4).rel_err)
    q3, k3, v3 = inputs.attention_inputs(2, 3, 200, 100, D, torch.bfloat16, seed=2)
    go(f"stage3 D={D}", lambda: checker.compare("O", s3.attention(q3, k3, v3), reference.attention_ref(q3, k3, v3)[0], rtol=1e-2).rel_err)
    go(f"stage4 D={D}", lambda: checker.compare("O", s4.attention(q, k, v), reference.attention_ref(q, k, v)[0], rtol=1e-2).rel_err)
    def f5():
        o, lse = s5.attention(q, k, v, return_lse=True)
        ro, rl = reference.attention_ref(q, k, v)
        return checker.compare("O", o, ro, rtol=1e-2).rel_err, checker.compare("LSE", lse, rl, rtol=1e-4).rel_err
    go(f"stage5 D={D}", f5)
print("SMOKE", "OK" if ok else "FAILED")
