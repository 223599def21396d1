#!/usr/bin/env bash
# SD 1.5 (its real config, random bf16 weights) at 512x512 on this CPU (issue 25's CPU target), three parts:
#  1. `footprint compare`: mlxdiff (bf16 weights, float32 compute) beside diffusers as is and diffusers' sequential
#     recipe, each process's RSS sampled per phase by the same outside sampler. diffusers runs in float32
#     (--reference-dtype float32): torch's bf16 matmuls crawl on an x86 CPU without AVX512-BF16 / AMX.
#  2. the same with mlxdiff quantizing as the Core ML guide's recipe, --quantize unet=6,text_encoder=8,vae=8
#     (mlxdiff side only: the diffusers side is part 1's).
#  3. what each component holds resident in MLX, bf16 vs that recipe, by layer kind (quantized Linear: packed
#     weights + scales + biases; what stays bf16: convolutions, norms, embeddings, the layers the model keeps full).
# The peak does not depend on the step count (each step runs the same UNet forward on the same shapes); STEPS=2
# keeps diffusers' float32 runs to minutes (about 2.4 min per 512x512 CFG step on 2 cores).
#
#   bench/sd15_cpu.sh                                   # MODEL=/tmp/sd15_real STEPS=2 LOGS=bench/logs-2026-12-03/sd15-cpu
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=${MODEL:-/tmp/sd15_real}
STEPS=${STEPS:-2}
LOGS=${LOGS:-bench/logs-2026-12-03/sd15-cpu}
RECIPE=${RECIPE:-unet=6,text_encoder=8,vae=8}
mkdir -p "$LOGS"
[ -d "$MODEL" ] || python bench/make_random_models.py sd1.5 --out "$MODEL"

{
  echo "date: $(date -u +%FT%TZ)  commit: $(git rev-parse --short HEAD 2>/dev/null || cat HEAD_COMMIT)$(git diff --quiet HEAD -- mlxdiff 2>/dev/null || echo ' (+ working tree)')"
  lscpu | grep -E "Model name|^CPU\(s\)|Flags" | sed 's/\(Flags:\).*\(avx512_bf16\|amx_bf16\).*/\1 ... \2 .../' | cut -c1-200
  grep -qE "avx512_bf16|amx_bf16" /proc/cpuinfo && echo "bf16 units: yes" || echo "bf16 units: no (no avx512_bf16 / amx_bf16)"
  free -g | head -2
  python -c "import mlx.core as mx, torch, diffusers, transformers; print('mlx', mx.__version__, mx.default_device(), '| torch', torch.__version__, '| diffusers', diffusers.__version__, '| transformers', transformers.__version__)"
  du -sh "$MODEL"/unet "$MODEL"/text_encoder "$MODEL"/vae
} > "$LOGS/machine.txt" 2>&1
cat "$LOGS/machine.txt"

echo "== 1. footprint compare, 512x512, $STEPS steps, diffusers in float32"
python -m mlxdiff.footprint compare --model "$MODEL" --width 512 --height 512 --steps "$STEPS" \
  --reference-dtype float32 --out "$LOGS/compare" 2>&1 | grep -v '^\[transformers\]' | tee "$LOGS/compare.log"

echo "== 2. mlxdiff with --quantize $RECIPE"
python -m mlxdiff.footprint compare --model "$MODEL" --width 512 --height 512 --steps "$STEPS" \
  --quantize "$RECIPE" --mlxdiff-only --out "$LOGS/compare-quantized" 2>&1 | tee "$LOGS/compare-quantized.log"

for d in compare compare-quantized; do
  echo "== mlxdiff's --report-memory table ($d)"
  python -c "import json, sys; d = json.load(open(sys.argv[1])); print(d['runs']['mlxdiff']['stdout'])" \
    "$LOGS/$d/footprint.json"
  python -c "import json, sys; d = json.load(open(sys.argv[1])); [print(r['stdout'], end='') for l, r in d['runs'].items() if l != 'mlxdiff']" \
    "$LOGS/$d/footprint.json"
done 2>&1 | tee "$LOGS/tables.log"

echo "== 3. resident bytes per component, bf16 vs --quantize $RECIPE"
python - "$MODEL" "$RECIPE" <<'EOF' 2>&1 | tee "$LOGS/components.log"
import sys
import mlxdiff   # first: its OpenBLAS preload must come before mlx.core
import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlxdiff.loading.component import load_component

model, recipe = sys.argv[1], sys.argv[2]
quantize = {k: (v if v.startswith("p") else int(v)) for k, v in (p.split("=") for p in recipe.split(","))}
MB = 2 ** 20


def kinds(m):
    """bytes by what holds them: quantized Linear (packed weights, scales, biases), Linear, Conv, the rest"""
    out = {}
    for path, module in m.named_modules():
        quantized = ("scales" in module or "lut" in module) and "weight" in module
        conv = isinstance(module, (nn.Conv2d, nn.Conv1d))
        kind = (("quantized Conv" if conv else "quantized Linear") if quantized else "Linear" if isinstance(module, nn.Linear)
                else "Conv" if isinstance(module, (nn.Conv2d, nn.Conv1d)) else None)
        if kind is None:
            continue
        n = sum(v.nbytes for _, v in tree_flatten(module.parameters()))
        out[kind] = out.get(kind, 0) + n
    total = sum(v.nbytes for _, v in tree_flatten(m.parameters()))
    out["other (norms, embeddings, ...)"] = total - sum(out.values())
    return total, out


rows = {}
for label, q in (("bf16", None), (recipe, quantize)):
    pipe = mlxdiff.load(model, quantize=q)
    for name, spec in pipe.components.items():
        if spec is None or name.startswith("tokenizer"):
            continue
        before = mx.get_active_memory()
        loaded = load_component(spec, pipe.dtype, pipe.policy)
        held = mx.get_active_memory() - before
        total, parts = kinds(loaded.model)
        rows.setdefault(name, {})[label] = (total, held, parts)
        print(f"{label:28s} {name:13s} parameters {total / MB:8.1f} MB  MLX active +{held / MB:8.1f} MB   "
              + ", ".join(f"{k} {v / MB:.1f} MB" for k, v in parts.items()))
        del loaded
        mx.clear_cache()
print()
print("| component | bf16 MB | " + recipe + " MB | ratio |")
print("|---|---|---|---|")
for name, r in rows.items():
    a, b = r["bf16"][0], r[recipe][0]
    print(f"| {name} | {a / MB:.1f} | {b / MB:.1f} | {b / a:.2f} |")
EOF
