#!/usr/bin/env bash
# Krea 2 and FLUX 3 Klein transformer steps beside diffusers (issue 41's speed target): 1024x1024, bf16, random
# weights at diffusers 0.42.1's class defaults built in memory (bench/forward_gpu.py says what each step is: krea2 =
# Krea2Pipeline's CFG step, two forwards over the 512-token window + 4096 image tokens; flux3-klein = one
# distilled flow-map forward over 80 text + 4096 image tokens). For each model the sides alternate (mlxdiff,
# diffusers, mlxdiff, diffusers; REPEAT pairs, default 2) on the one ruler of bench/qwen_zimage_gpu.sh (nvidia-smi's
# memory.used every 0.1 s from outside, less the idle reading before each process; its peak while that side's timed
# forwards run). Logs in $LOGS (forward_<model>_<side>_<rep>.txt, smi_*.csv, ruler.txt); RESULT lines at the end.
# Budget on one H100: 8 processes of about 20-40 s each (imports; 12.8 B / 5.5 B parameters = 26 / 11 GB built on
# the GPU; 2 warm-up + 6 timed steps of about 1 s or less; the 2026-12-06 H200 run of zimage-turbo + qwen-image,
# 6 B + 20 B, took about 2.5 min for its 8 processes): about 3-4 min, under 8.
# Run on the GPU machine after the device recipe's activate step:
#     LOGS=$OUT/fwd bash bench/new_families_gpu.sh
# CPU chain check (no GPU; tiny configs):
#     MODELS="krea2-tiny flux3-klein-tiny" SIZE=64 DEVICE=cpu NO_SMI=1 LOGS=/tmp/nf_cpu bash bench/new_families_gpu.sh
MODELS="${MODELS:-krea2 flux3-klein}" exec bash "$(dirname "$0")/qwen_zimage_gpu.sh"
