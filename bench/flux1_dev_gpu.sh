#!/usr/bin/env bash
# FLUX.1-dev's transformer step (1024x1024: 4096 image + 512 text tokens, bf16, random weights at the real config),
# mlxdiff beside diffusers in one job, the sides alternating (A B A B; REPEAT pairs, default 2), on the one ruler of
# bench/qwen_zimage_gpu.sh (nvidia-smi's memory.used every 0.1 s from outside, less the idle reading before each
# process; its peak while that side's timed forwards run). Logs in $LOGS (forward_flux1-dev_<side>_<rep>.txt, ...).
# Run on the GPU machine after the device recipe's activate step.
MODELS=flux1-dev exec bash "$(dirname "$0")/qwen_zimage_gpu.sh"
