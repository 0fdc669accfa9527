#!/bin/bash
# Session 6, one device call (issue 4), tables and logs to $OUT:
#   default: the GPU kernel tests (-m gpu), then the ablation at T=4096, N=1M on the trained
#   indexer (benchmarks.profile_kernels --stages): DoSA and dense per tile spec (DOSA_SPECS),
#   each checked bitwise against the dense kernel, with DoSA cut after each stage;
#   FINAL=1: XLA / dense / DoSA at 128K and 1M (SHAPES), exact_topk and the peak.
# Since session 7 both modes run session 7's script (device-clock timing; FINAL also runs the
# GPU tests after the figures unless NO_TESTS is set).
# Usage (device tool): bash benchmarks/gpu_s6.sh
DOSA_SPECS="${DOSA_SPECS-,kc:64:4:3:kc:4:4:1:0:0}" exec bash "$(dirname "$0")/gpu_s7.sh"
