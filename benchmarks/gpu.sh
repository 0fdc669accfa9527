#!/bin/bash
# The GPU run: the -m gpu tests, then the headline and matrix presets, outputs in $OUT.
#
#   bash benchmarks/gpu.sh [STAGE ...]      (default: tests headline matrix)
#
# Stages: tests | headline | matrix | matrix1m | matrix1m_bw | matrix1m64 | matrix128k |
# matrix1m_slack | matrix1m64_slack | kernels | select |
# agreement | context_parallel (CP_ARGS adds options, e.g. --queries 4096) |
# witness_timing (WT_ARGS adds options, e.g. --cases code1,code2 --widths 0,4096 --survivor-costs 1,2 --splits 0,2) |
# decode | decode32 | decode64 (decode: every row within its time budget; decode32/64: one H each) |
# decode_graphs (B = 1, 8 at N = 1M, 128K, H = 32, contiguous: every loop also compiled with
# benchmarks.decode.GRAPH_COMPILER_OPTIONS) |
# decode_parts (one decode step timed by part; PARTS_ARGS adds options, e.g. --B 1 --N 131072) |
# decode_loop (decode_parts' loop study at B = 1, N = 128K and 1M, and B = 8, N = 1M: the step in a
# 16-step lax.scan at five compiles, beside a do-nothing conditional and no conditional, where the
# idle time falls) |
# decode_loop_ab (the loop study in this tree and in AB_TREE, folders benchmarks/ab_tree.sh
# builds from other commits, alternating, B = 1 at 128K and B = 8 at 1M) |
# slack_train | slack_eval (the slack fine-tune in two calls: slack_train writes every λ's
# weights_lambda_<λ>.npz to $OUT; slack_eval measures the files in SLACK_WEIGHTS, a folder the
# call carries; SLACK_ARGS adds options, e.g. --lambdas 0,0.2,1,4)
# (matrix1m: the H = 32 cases at N = 1M; matrix1m_bw: the same with the block-witness
# variant, BLOCK_WITNESSES=W (default 4096); matrix1m64: the H = 64 cases; matrix128k: all 16 at
# N = 128K; matrix1m_slack / matrix1m64_slack: matrix1m / matrix1m64 with --weights slack, the
# slack-regularised indexers, tags 1m_h32_slack / 1m_h64_slack (the 16 cases in two calls:
# H = 32 takes about 3 min, H = 64 about 7); matrix: everything, longer than one 10-minute
# device call). Each stage
# runs under its own timeout (seconds; TESTS_TIMEOUT, HEADLINE_TIMEOUT, MATRIX_TIMEOUT) so a
# slow stage leaves the others' results. Files written to $OUT (few, for a remote runner that
# returns at most 8): gpu_log.txt (every stage's output), tests.txt, and each preset's
# <preset>.md / <preset>.json (rewritten after every row: a killed stage keeps its rows).
# Set DOSA_COMMIT=<sha> when the device copy has no usable git metadata. MATRIX_ARGS adds
# options to the matrix stages (e.g. --cases code2_H32,prose1_H64, or --survivor-cost 2: DoSA at
# that κ timed beside the default, or --weights PATH: the indexers of any weights file, e.g. a
# slack fine-tune's, the output names ending in the file's name).
set -o pipefail
OUT=${OUT:-bench_out}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)          # absolute: a stage may run in another folder
HERE=$(pwd)
HEAD_COMMIT=${DOSA_COMMIT:-}
export OUT PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
LOG=$OUT/gpu_log.txt
stages=${*:-tests headline matrix}
status=0
run() {   # run NAME TIMEOUT COMMAND...: the command's output to the log and stdout
  local name=$1 limit=$2
  shift 2
  echo "=== $name: $* (timeout ${limit}s) $(date -u +%H:%M:%S)" | tee -a "$LOG"
  timeout "$limit" "$@" 2>&1 | tee -a "$LOG"
  local rc=$?
  echo "=== $name: exit $rc $(date -u +%H:%M:%S)" | tee -a "$LOG"
  [ $rc -eq 0 ] || status=1
}
for s in $stages; do
  case $s in
    tests)   # one pytest per file holding GPU tests: a failure's report is written before a
             # later file can run into the stage's deadline (TESTS_TIMEOUT seconds, all files)
      deadline=$((SECONDS + ${TESTS_TIMEOUT:-480}))
      files=${TESTS_FILES:-$(grep -l "pytest.mark.gpu" tests/test_*.py)}
      echo "=== tests: python -m pytest -m gpu per file: $(echo $files)" | tee -a "$LOG"
      for f in $files; do
        left=$((deadline - SECONDS))
        if [ $left -le 0 ]; then
          echo "=== tests: $f not run (TESTS_TIMEOUT spent)" | tee -a "$LOG" "$OUT/tests.txt"
          status=1; continue
        fi
        JAX_PLATFORMS=cuda timeout "$left" python -m pytest -m gpu -o addopts= -q -rfE --tb=short \
          -p no:cacheprovider "$f" >> "$OUT/tests.txt" 2>&1
        rc=$?
        echo "=== tests: $f exit $rc: $(tail -1 "$OUT/tests.txt")" | tee -a "$LOG"
        [ $rc -eq 0 ] || [ $rc -eq 5 ] || status=1     # 5: no GPU test selected in the file
      done ;;
    headline) run headline "${HEADLINE_TIMEOUT:-400}" python -m benchmarks headline --out "$OUT" ;;
    matrix) run matrix "${MATRIX_TIMEOUT:-580}" python -m benchmarks matrix --out "$OUT" $MATRIX_ARGS ;;
    matrix1m) run matrix1m "${MATRIX_TIMEOUT:-580}" python -m benchmarks matrix --N 1m --cases H32 \
      --tag 1m_h32 --out "$OUT" $MATRIX_ARGS ;;
    matrix1m_bw) run matrix1m_bw "${MATRIX_TIMEOUT:-580}" python -m benchmarks matrix --N 1m \
      --cases H32 --tag 1m_h32_bw --block-witnesses "${BLOCK_WITNESSES:-4096}" --out "$OUT" $MATRIX_ARGS ;;
    matrix1m64) run matrix1m64 "${MATRIX_TIMEOUT:-580}" python -m benchmarks matrix --N 1m \
      --cases H64 --tag 1m_h64 --out "$OUT" $MATRIX_ARGS ;;
    matrix1m_slack) run matrix1m_slack "${MATRIX_TIMEOUT:-580}" python -m benchmarks matrix \
      --N 1m --cases H32 --weights slack --tag 1m_h32_slack --out "$OUT" $MATRIX_ARGS ;;
    matrix1m64_slack) run matrix1m64_slack "${MATRIX_TIMEOUT:-580}" python -m benchmarks matrix \
      --N 1m --cases H64 --weights slack --tag 1m_h64_slack --out "$OUT" $MATRIX_ARGS ;;
    matrix128k) run matrix128k "${MATRIX_TIMEOUT:-580}" python -m benchmarks matrix --N 128k \
      --tag 128k --out "$OUT" $MATRIX_ARGS ;;
    kernels) run kernels "${KERNELS_TIMEOUT:-300}" python -m benchmarks kernels --out "$OUT" ;;
    select) run select "${SELECT_TIMEOUT:-200}" python -m benchmarks select --out "$OUT" ;;
    agreement) run agreement "${AGREEMENT_TIMEOUT:-200}" python -m benchmarks.agreement ;;
    context_parallel) run context_parallel "${CP_TIMEOUT:-580}" python -m benchmarks.context_parallel \
      --out "$OUT" $CP_ARGS ;;
    witness_timing) run witness_timing "${WT_TIMEOUT:-580}" python -m benchmarks.witness_timing \
      --out "$OUT" $WT_ARGS ;;
    decode) run decode "${DECODE_TIMEOUT:-580}" python -m benchmarks decode --out "$OUT" ;;
    decode32) run decode32 "${DECODE_TIMEOUT:-580}" python -m benchmarks decode --cases H32 \
      --tag h32 --out "$OUT" ;;
    decode_graphs) run decode_graphs "${DECODE_TIMEOUT:-580}" python -m benchmarks decode \
      --N 1m,128k --cases code2_H32 --batches 1,8 --layouts contiguous --check-steps 0 --graphs \
      --tag graphs --out "$OUT" ;;
    decode_parts) run decode_parts "${DECODE_TIMEOUT:-300}" python -m benchmarks.decode_parts \
      --out "$OUT" $PARTS_ARGS ;;
    decode_loop)   # the loop study at B = 1 (128K, 1M) and B = 8 (1M), one run each
      for c in "1 131072 b1_128k" "1 1048576 b1_1m" "8 1048576 b8_1m"; do
        read -r nb nk tg <<< "$c"
        run "decode_loop_$tg" "${DECODE_TIMEOUT:-150}" python -m benchmarks.decode_parts \
          --studies loop --B "$nb" --N "$nk" --tag "loop_$tg" --out "$OUT" $PARTS_ARGS
      done ;;
    decode_loop_ab)   # the loop study in this tree and in each folder of $AB_TREE (one or
                      # more, benchmarks/ab_tree.sh), alternating, at B = 1 (128K) and B = 8
                      # (1M) or LOOP_AB_SHAPES ("B N tag;..."), LOOP_AB_ROUNDS rounds (default
                      # 2); LOOP_AB_COMPILES (default: default); the step part only beside it;
                      # tags ab_<shape>_<tree>_<round>
      for t in ${AB_TREE:-}; do
        [ -d "$t" ] || { echo "=== decode_loop_ab: $t (AB_TREE) is no folder" | tee -a "$LOG"
                         status=1; continue 2; }
        ln -sfn "$HERE/dosa_jax/data" "$t/dosa_jax/data"   # the working tree's data, not a copy
      done
      [ -n "${AB_TREE:-}" ] || { echo "=== decode_loop_ab: no AB_TREE" | tee -a "$LOG"
                                 status=1; continue; }
      IFS=';' read -r -a shapes <<< "${LOOP_AB_SHAPES:-1 131072 b1_128k;8 1048576 b8_1m}"
      for c in "${shapes[@]}"; do
        read -r nb nk tg <<< "$c"
        for r in $(seq 1 "${LOOP_AB_ROUNDS:-2}"); do
          for t in head $AB_TREE; do
            dir=$HERE; sha=$HEAD_COMMIT
            [ $t = head ] || { dir=$t; sha=$(cat "$t/COMMIT" 2>/dev/null); t=$(basename "$t"); }
            cd "$dir" || { status=1; continue; }
            run "decode_loop_ab_${tg}_${t}_$r" "${DECODE_TIMEOUT:-150}" \
              env DOSA_COMMIT="$sha" python -m benchmarks.decode_parts --parts step \
              --studies loop --loop-compiles "${LOOP_AB_COMPILES:-default}" --B "$nb" \
              --N "$nk" --tag "ab_${tg}_${t}_$r" --out "$OUT"
            cd "$HERE"
          done
        done
      done ;;
    decode64) run decode64 "${DECODE_TIMEOUT:-580}" python -m benchmarks decode --cases H64 \
      --tag h64 --out "$OUT" ;;
    slack_train) run slack_train "${SLACK_TIMEOUT:-580}" python -m benchmarks.slack_finetune \
      --train-only --budget-seconds "${SLACK_BUDGET:-540}" --out "$OUT" $SLACK_ARGS ;;
    slack_eval) run slack_eval "${SLACK_TIMEOUT:-580}" python -m benchmarks.slack_finetune \
      --evaluate "${SLACK_WEIGHTS:-slack_weights}" --budget-seconds "${SLACK_BUDGET:-540}" \
      --out "$OUT" $SLACK_ARGS ;;
    *) echo "gpu.sh: unknown stage $s (tests headline matrix matrix1m matrix1m_bw matrix1m64" \
         "matrix128k matrix1m_slack matrix1m64_slack kernels select agreement context_parallel" \
         "witness_timing decode decode32 decode64 decode_graphs decode_parts decode_loop slack_train" \
         "slack_eval)" >&2
       exit 2 ;;
  esac
done
exit $status
