#!/usr/bin/env bash
# Streaming below the weights on the lent GPU, in one job (bench/RESULTS.md, "Streaming below the weights"): FLUX.2-dev
# end to end at 1024x1024, 4 steps, random weights at the real configs: the Q4_K_M GGUF transformer, the Mistral
# encoder as the folder's bf16 (18.5 B parameters; no disk here for a 4-bit copy beside both), the VAE. One process
# per run (bench/streaming_gpu.py run), each under `python -m mlxdiff.footprint run` (NVML, the whole process):
# resident (no limit), --memory-limit 8 and 4 (LIMITS; LIMITS= skips FLUX.2); then the latents and images compared,
# and the GGUF's read rate. SD_LIMITS="none 6": SD3.5 Large in bf16 the same way. F1_LIMITS="none 8" (F1_SIZE=1024):
# FLUX.1-dev as the bf16 folder, a Q8_0 and a Q4_K_S GGUF (bench/flux1_dev_gguf.py) the same way; LIMITS= alone.
# Issue 40: ZI_LIMITS="none 6": Z-Image-Turbo (1024, 8 steps, guidance 0), then its whole process beside diffusers'
# (bench/whole_process_gpu.py pairs; ZI_WHOLE=0 skips); QI_LIMITS="none 12": Qwen-Image (1024,
# QI_STEPS=4, true CFG with a negative prompt); the folders are written here (bench/make_random_models.py), Z-Image's
# deleted before Qwen-Image's when the disk is short (their 20.5 + 56.3 GB do not fit the 64 GiB disk together).
#     ZI_LIMITS="none 6" QI_LIMITS="none 12" LIMITS= LOGS=$OUT/stream bash bench/streaming_gpu.sh
# One device call runs at most 10 minutes: split the job over calls with LOGS on the machine's /tmp (kept while it
# stays warm; copy it to $OUT each call); a limit's compare runs whenever $LOGS/run_*_none is there. Estimated,
# not measured:
#     ZI_LIMITS="none 6" ZI_WHOLE=0 LIMITS= LOGS=/tmp/l40 bash bench/streaming_gpu.sh; cp -r /tmp/l40 $OUT/
#     python3 bench/whole_process_gpu.py pairs /tmp/zi --steps 8 --guidance 0 > $OUT/whole_zi.txt 2>&1
#     rm -rf /tmp/zi; python3 bench/make_random_models.py qwen-image --out /tmp/qi --device cuda   # ~56 GB
#     QI_LIMITS=none LIMITS= LOGS=/tmp/l40 bash bench/streaming_gpu.sh; cp -r /tmp/l40 $OUT/
#     QI_LIMITS=12 LIMITS= LOGS=/tmp/l40 bash bench/streaming_gpu.sh; cp -r /tmp/l40 $OUT/
# Issue 41: F3_LIMITS="none 6" (FLUX 3 Klein) and K2_LIMITS="none 6" (Krea 2), the same way (the function `family`
# below; bench/round4_gpu.sh runs them):
#     F3_LIMITS="none 6" K2_LIMITS="none 6" LIMITS= LOGS=$OUT/stream bash bench/streaming_gpu.sh
# CPU chain check at tiny size (no GPU; RSS instead of NVML):
#     ZI_MODEL=zimage-turbo-tiny ZI_DIR=/tmp/zt ZI_SIZE=64 ZI_STEPS=2 ZI_LIMITS="none 0.005" \
#     QI_MODEL=qwen-image-tiny QI_DIR=/tmp/qt QI_SIZE=64 QI_STEPS=2 QI_LIMITS="none 0.005" QI_NEED_GB=1 \
#     MAKE_DEVICE=cpu LIMITS= LOGS=/tmp/stream-cpu bash bench/streaming_gpu.sh
#     F3_MODEL=flux3-klein-tiny F3_DIR=/tmp/f3t F3_SIZE=64 F3_STEPS=2 F3_LIMITS="none 0.008" F3_NEED_GB=1 \
#     K2_MODEL=krea2-tiny K2_DIR=/tmp/k2t K2_SIZE=64 K2_STEPS=2 K2_WHOLE_STEPS=2 K2_LIMITS="none 0.006" K2_NEED_GB=1 \
#     MAKE_DEVICE=cpu LIMITS= LOGS=/tmp/stream41-cpu bash bench/streaming_gpu.sh
# Run on the GPU machine after the device recipe's activate step; logs in $LOGS.
set -u
cd "$(dirname "$0")/.."
L=${LOGS:-/tmp/logs}
mkdir -p "$L"
stamp() { echo "$(date +%T) $1" >> "$L/steps.txt"; }
run() {   # run NAME FOLDER [args...]: one process under the outside sampler
  local name=$1; shift
  python3 -m mlxdiff.footprint run --interval 0.1 --json "$L/fp_$name.json" -- \
    python3 bench/streaming_gpu.py run "$@" --out "$L/run_$name" > "$L/run_$name.txt" 2>&1
  tail -1 "$L/run_$name.txt" >> "$L/summary.txt"
  stamp "run_$name"
}
stamp start
if [ -n "${SD_LIMITS:-}" ]; then   # SD3.5 Large in bf16 (8.1 B MMDiT, T5-XXL): SD_LIMITS="none 6"
  [ -f /tmp/sdl/model_index.json ] || python3 bench/make_random_models.py sd3.5-large --out /tmp/sdl --device cuda \
    > "$L/make_sd3.5-large.txt" 2>&1
  stamp make_sdl
  for limit in $SD_LIMITS; do
    extra=(); [ "$limit" = none ] || extra=(--memory-limit "$limit")
    run "sdl_$limit" /tmp/sdl "${extra[@]}"
  done
  for limit in $SD_LIMITS; do
    [ "$limit" = none ] || python3 bench/streaming_gpu.py compare "$L/run_sdl_none" "$L/run_sdl_$limit" \
      > "$L/compare_sdl_$limit.txt" 2>&1
  done
fi
if [ -n "${F1_LIMITS:-}" ]; then   # FLUX.1-dev: bf16 folder, Q8_0 and Q4_K_S GGUFs; F1_LIMITS="none 8", F1_SIZE=1024
  f1size=${F1_SIZE:-1024}
  # disk: folder ~33.7 GB (transformer 23.8 GB of it, T5-XXL 9.5, CLIP-L + VAE 0.4), GGUFs 12.7 + 6.8 GB
  need_gb() { local n=0; [ -f /tmp/f1/model_index.json ] || n=$((n + 34)); [ -f /tmp/f1-Q8_0.gguf ] || n=$((n + 13))
              [ -f /tmp/f1-Q4_K_S.gguf ] || n=$((n + 7)); echo $n; }
  free_gb() { df -B1G --output=avail /tmp | tail -1 | tr -d ' '; }
  echo "FLUX.1 disk: need ~$(need_gb) GB more, $(free_gb) GB free on /tmp" | tee -a "$L/disk_f1.txt"
  [ -f /tmp/f1/model_index.json ] || python3 bench/make_random_models.py flux1-dev --out /tmp/f1 --device cuda \
    > "$L/make_flux1-dev.txt" 2>&1
  stamp make_f1
  du -sh /tmp/f1/* >> "$L/disk_f1.txt" 2>&1
  variants=" ${F1_VARIANTS:-bf16 Q8_0 Q4_K_S} "   # which of the three to run (F1_VARIANTS="bf16 Q4_K_S")
  if [[ $variants == *" bf16 "* ]] && ls /tmp/f1/transformer/*.safetensors > /dev/null 2>&1; then   # bf16 runs first: the GGUF runs need only CLIP/T5/VAE
    for limit in $F1_LIMITS; do
      extra=(); [ "$limit" = none ] || extra=(--memory-limit "$limit")
      run "f1_bf16_$limit" /tmp/f1 --size "$f1size" "${extra[@]}"
    done
  fi
  if [ "$(free_gb)" -lt "$(( $(need_gb) + 2 ))" ]; then   # no room for the GGUFs: drop the bf16 transformer's weights
    echo "deleting /tmp/f1/transformer weights (config.json kept)" | tee -a "$L/disk_f1.txt"
    rm -f /tmp/f1/transformer/*.safetensors /tmp/f1/transformer/*.index.json
  fi
  for q in Q8_0 Q4_K_S; do
    [[ $variants == *" $q "* ]] || continue
    [ -f "/tmp/f1-$q.gguf" ] || python3 bench/flux1_dev_gguf.py write "/tmp/f1-$q.gguf" --type "$q" \
      > "$L/make_f1_$q.txt" 2>&1
    stamp "gguf_f1_$q"
  done
  { ls -l /tmp/f1-*.gguf /tmp/f1/transformer /tmp/f1/text_encoder_2; df -h /tmp; } >> "$L/disk_f1.txt" 2>&1
  python3 bench/streaming_gpu.py rate /tmp/f1-*.gguf > "$L/rate_f1_gguf.txt" 2>&1
  for q in Q8_0 Q4_K_S; do
    [[ $variants == *" $q "* ]] || continue
    for limit in $F1_LIMITS; do
      extra=(); [ "$limit" = none ] || extra=(--memory-limit "$limit")
      run "f1_${q}_$limit" /tmp/f1 --transformer "/tmp/f1-$q.gguf" --size "$f1size" "${extra[@]}"
    done
  done
  for v in bf16 Q8_0 Q4_K_S; do
    for limit in $F1_LIMITS; do
      [ "$limit" = none ] || [ ! -d "$L/run_f1_${v}_none" ] || python3 bench/streaming_gpu.py compare \
        "$L/run_f1_${v}_none" "$L/run_f1_${v}_$limit" > "$L/compare_f1_${v}_$limit.txt" 2>&1
    done
  done
  stamp f1_done
fi
free_gb() { df -B1G --output=avail /tmp | tail -1 | tr -d ' '; }
limit_args() { [ "$1" = none ] || echo "--memory-limit $1"; }
MAKE_DEVICE=${MAKE_DEVICE:-cuda}
if [ -n "${ZI_LIMITS:-}" ]; then   # Z-Image-Turbo: ZI_LIMITS="none 6", 1024, 8 steps, guidance 0 (Turbo's way)
  zi=${ZI_DIR:-/tmp/zi}
  # disk: ~20.5 GB (transformer 12.3, Qwen3-4B 8.0, VAE 0.2)
  echo "Z-Image disk: need ~$([ -f "$zi/model_index.json" ] && echo 0 || echo 21) GB, $(free_gb) GB free on /tmp" \
    | tee -a "$L/disk_zi.txt"
  [ -f "$zi/model_index.json" ] || python3 bench/make_random_models.py "${ZI_MODEL:-zimage-turbo}" --out "$zi" \
    --device "$MAKE_DEVICE" > "$L/make_zi.txt" 2>&1
  stamp make_zi
  du -sh "$zi"/* >> "$L/disk_zi.txt" 2>&1
  for limit in $ZI_LIMITS; do
    run "zi_$limit" "$zi" --size "${ZI_SIZE:-1024}" --steps "${ZI_STEPS:-8}" --guidance 0 $(limit_args "$limit")
  done
  for limit in $ZI_LIMITS; do
    [ "$limit" = none ] || [ ! -d "$L/run_zi_none" ] || python3 bench/streaming_gpu.py compare \
      "$L/run_zi_none" "$L/run_zi_$limit" \
      > "$L/compare_zi_$limit.txt" 2>&1
  done
  # whole process, one image each, mlxdiff's CLI beside diffusers, alternating twice (ZI_WHOLE=0 skips)
  [ "${ZI_WHOLE:-1}" = 0 ] || python3 bench/whole_process_gpu.py pairs "$zi" --size "${ZI_SIZE:-1024}" \
    --steps "${ZI_STEPS:-8}" --guidance 0 --repeat 2 --device "$MAKE_DEVICE" > "$L/whole_zi.txt" 2>&1
  stamp zi_done
fi
if [ -n "${QI_LIMITS:-}" ]; then   # Qwen-Image: QI_LIMITS="none 12", 1024, QI_STEPS (4), true CFG (a negative prompt)
  qi=${QI_DIR:-/tmp/qi}
  # disk: ~56.3 GB (transformer 40.9, Qwen2.5-VL-7B's language model 15.2 with its lm_head, VAE 0.25): it does not fit
  # beside Z-Image's 20.5 GB on the 64 GiB disk, so the other bench folders go first (Z-Image's after its runs).
  if [ ! -f "$qi/model_index.json" ] && [ "$(free_gb)" -lt "${QI_NEED_GB:-58}" ]; then
    others=("${ZI_DIR:-/tmp/zi}")   # this job's folders; the lent machine's others only there (MAKE_DEVICE=cuda)
    [ "$MAKE_DEVICE" != cuda ] || others+=(/tmp/f1 /tmp/f1-*.gguf /tmp/dev /tmp/f2.gguf /tmp/sdl)
    echo "deleting for Qwen-Image: ${others[*]}" | tee -a "$L/disk_qi.txt"
    rm -rf "${others[@]}"
  fi
  echo "Qwen-Image disk: need ~$([ -f "$qi/model_index.json" ] && echo 0 || echo "${QI_NEED_GB:-58}") GB," \
    "$(free_gb) GB free on /tmp" | tee -a "$L/disk_qi.txt"
  if [ ! -f "$qi/model_index.json" ] && [ "$(free_gb)" -lt "${QI_NEED_GB:-58}" ]; then
    echo "Qwen-Image skipped: not enough disk" | tee -a "$L/disk_qi.txt"
  else
    [ -f "$qi/model_index.json" ] || python3 bench/make_random_models.py "${QI_MODEL:-qwen-image}" --out "$qi" \
      --device "$MAKE_DEVICE" > "$L/make_qi.txt" 2>&1
    stamp make_qi
    { du -sh "$qi"/*; df -h /tmp; } >> "$L/disk_qi.txt" 2>&1
    for limit in $QI_LIMITS; do   # 2 warm-up steps: Qwen-Image's shift_terminal refuses 1
      run "qi_$limit" "$qi" --size "${QI_SIZE:-1024}" --steps "${QI_STEPS:-4}" --warmup-steps 2 \
        --negative-prompt "blurry, low quality" $(limit_args "$limit")
    done
    for limit in $QI_LIMITS; do
      [ "$limit" = none ] || [ ! -d "$L/run_qi_none" ] || python3 bench/streaming_gpu.py compare \
        "$L/run_qi_none" "$L/run_qi_$limit" \
        > "$L/compare_qi_$limit.txt" 2>&1
    done
  fi
  stamp qi_done
fi
has_index() { [ -f "$1/model_index.json" ] || [ -f "$1/modular_model_index.json" ]; }
# family TAG DIR MODEL NEED_GB LIMITS STEPS WHOLE_STEPS OTHERS: issue 41's rows of one family (F3_*, K2_* below): the
# folder written here unless there (OTHERS, this job's other folders, deleted first when the disk is short), one run
# per limit, each limit's image against the resident one, then the whole process beside diffusers (TAG_WHOLE=0 skips)
family() {
  local tag=$1 dir=$2 model=$3 need=$4 limits=$5 steps=$6 whole_steps=$7 others=$8 whole_var="${1^^}_WHOLE"
  if ! has_index "$dir" && [ "$(free_gb)" -lt "$need" ] && [ -n "$others" ]; then
    echo "deleting for $tag: $others" | tee -a "$L/disk_$tag.txt"
    rm -rf $others
  fi
  echo "$tag disk: need ~$(has_index "$dir" && echo 0 || echo "$need") GB, $(free_gb) GB free on /tmp" \
    | tee -a "$L/disk_$tag.txt"
  if ! has_index "$dir" && [ "$(free_gb)" -lt "$need" ]; then
    echo "$tag skipped: not enough disk" | tee -a "$L/disk_$tag.txt"; stamp "${tag}_done"; return
  fi
  has_index "$dir" || python3 bench/make_random_models.py "$model" --out "$dir" --device "$MAKE_DEVICE" \
    > "$L/make_$tag.txt" 2>&1
  stamp "make_$tag"
  { du -sh "$dir"/*; df -h /tmp; } >> "$L/disk_$tag.txt" 2>&1
  for limit in $limits; do
    run "${tag}_$limit" "$dir" --size "$size" --steps "$steps" $(limit_args "$limit")
  done
  for limit in $limits; do
    [ "$limit" = none ] || [ ! -d "$L/run_${tag}_none" ] || python3 bench/streaming_gpu.py compare \
      "$L/run_${tag}_none" "$L/run_${tag}_$limit" > "$L/compare_${tag}_$limit.txt" 2>&1
  done
  [ "${!whole_var:-1}" = 0 ] || python3 bench/whole_process_gpu.py pairs "$dir" --size "$size" \
    --steps "$whole_steps" --repeat 2 --device "$MAKE_DEVICE" > "$L/whole_$tag.txt" 2>&1
  stamp "${tag}_done"
}
# Issue 41: F3_LIMITS="none 6": FLUX 3 Klein, step-distilled (bench/make_random_models.py flux3-klein, ~20 GB: the
# transformer 11.1, Qwen3-VL-4B 8.9, VAE 0.17), 1024, its 16 steps without guidance; K2_LIMITS="none 6": Krea 2
# (krea2, ~35 GB: transformer 25.6, Qwen3-VL-4B 8.9, VAE 0.25), 1024, CFG 4.5 against "" (Krea2Pipeline's defaults),
# K2_STEPS=4 for the resident and streamed runs (a streamed step reads the transformer twice, ~50 GB) and its default
# 28 (K2_WHOLE_STEPS) for the whole process. The two folders fit the 64 GiB disk together only just: the other is
# deleted first when short.
f3=${F3_DIR:-/tmp/f3} k2=${K2_DIR:-/tmp/k2}
if [ -n "${F3_LIMITS:-}" ]; then
  size=${F3_SIZE:-1024}
  family f3 "$f3" "${F3_MODEL:-flux3-klein}" "${F3_NEED_GB:-22}" "$F3_LIMITS" "${F3_STEPS:-16}" "${F3_STEPS:-16}" "$k2"
fi
if [ -n "${K2_LIMITS:-}" ]; then
  size=${K2_SIZE:-1024}
  family k2 "$k2" "${K2_MODEL:-krea2}" "${K2_NEED_GB:-37}" "$K2_LIMITS" "${K2_STEPS:-4}" "${K2_WHOLE_STEPS:-28}" "$f3"
fi
[ -n "${LIMITS-x}" ] || { stamp JOB-DONE; exit 0; }
[ -f /tmp/dev/model_index.json ] || python3 bench/make_random_models.py flux2-dev --out /tmp/dev --device cuda \
  > "$L/make_flux2-dev.txt" 2>&1
stamp make_dev
[ -f /tmp/f2.gguf ] || python3 bench/flux2_dev_gpu.py write-gguf /tmp/f2.gguf > "$L/make_gguf.txt" 2>&1
stamp gguf
python3 bench/streaming_gpu.py rate /tmp/f2.gguf > "$L/rate_gguf.txt" 2>&1
for limit in ${LIMITS:-none 8 4}; do
  extra=(); [ "$limit" = none ] || extra=(--memory-limit "$limit")
  run "$limit" /tmp/dev --transformer /tmp/f2.gguf "${extra[@]}"
done
for limit in ${LIMITS:-none 8 4}; do
  [ "$limit" = none ] || python3 bench/streaming_gpu.py compare "$L/run_none" "$L/run_$limit" > "$L/compare_$limit.txt" 2>&1
done
stamp JOB-DONE
