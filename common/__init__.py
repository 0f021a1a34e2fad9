"""What the stage files import at run time: GPU and track detection (arch), argument checks,
torch <-> CuTe wrapping, the compile cache, output allocation, masks, pack-GQA, the host launch of
stages 7-14 (attention_host), the split-KV combine kernel (combine), K/V-ring and TMEM device
helpers, the custom ops (ops). Nothing here is copied into a stage file. What measures, checks or
shows the kernels (references, the checker, benchmarks, plots, the notebook helpers) is in
common/tools/."""
