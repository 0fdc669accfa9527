#!/bin/bash
# Session 4, first device call: where the dense scan and DoSA's kernels spend their time.
#   1. ablation timings (benchmarks.profile_kernels) at T=4096, N=1M on the trained indexer;
#   2. Nsight Compute: every kernel's duration in one dense and one DoSA call (one pass);
#   3. Nsight Compute full sections + SASS source counters of the dense scan, screen, refine.
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false JAX_PLATFORMS=cuda
export XLA_FLAGS="--xla_gpu_enable_command_buffer="
T=${T:-4096}; N=${N:-1048576}
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv | tee $OUT/log.txt
timeout ${ABL_TIMEOUT:-200} python -m benchmarks.profile_kernels --T $T --N $N ${ABL_ARGS:-} \
  > $OUT/ablation.jsonl 2> $OUT/ablation_err.txt; echo "ablation exit $?" | tee -a $OUT/log.txt
cat $OUT/ablation.jsonl; tail -3 $OUT/ablation_err.txt
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
echo "ncu: $NCU" | tee -a $OUT/log.txt
timeout ${LIST_TIMEOUT:-120} $NCU --clock-control none --metrics gpu__time_duration.sum --csv \
  python -m benchmarks.profile_kernels --T $T --N $N --ncu --runs dense,dosa \
  > $OUT/kernels.csv 2> $OUT/kernels_err.txt; echo "ncu list exit $?" | tee -a $OUT/log.txt
python - <<'PY' $OUT/kernels.csv | tee -a $OUT/log.txt
import csv, sys, collections
rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) > 10]
if not rows: print("no kernel rows"); sys.exit()
h = rows[0]; ki = h.index("Kernel Name"); vi = h.index("Metric Value"); ui = h.index("Metric Unit")
tot = collections.defaultdict(float); n = collections.Counter()
for r in rows[1:]:
    try: v = float(r[vi].replace(",", ""))
    except ValueError: continue
    v = v / 1e6 if r[ui] == "nsecond" else (v / 1e3 if r[ui] == "usecond" else v)
    tot[r[ki][:90]] += v; n[r[ki][:90]] += 1
for kname, v in sorted(tot.items(), key=lambda x: -x[1])[:25]:
    print(f"{v:10.3f} ms  x{n[kname]:4d}  {kname}")
PY
timeout ${FULL_TIMEOUT:-240} $NCU --clock-control none --set full --import-source no \
  -k regex:"dense_scan|screen|refine" --launch-count ${LAUNCHES:-4} -o $OUT/prof \
  python -m benchmarks.profile_kernels --T $T --N $N --ncu --runs dense,dosa \
  > $OUT/ncu_full.txt 2>&1; echo "ncu full exit $?" | tee -a $OUT/log.txt
tail -5 $OUT/ncu_full.txt
if [ -f $OUT/prof.ncu-rep ]; then
  $NCU -i $OUT/prof.ncu-rep --page details > $OUT/details.txt 2>&1
  for kk in dense_scan screen refine; do
    $NCU -i $OUT/prof.ncu-rep --page source --print-source sass --csv -k regex:$kk \
      > $OUT/sass_$kk.csv 2>&1
  done
  grep -E "^  [a-z_]+|Duration|Throughput|Registers|Achieved Occupancy|Theoretical Occupancy|Warp Cycles Per Issued|Issue Slots Busy|Executed Ipc|Block Limit|Shared Memory Configuration Size|Dynamic Shared" $OUT/details.txt | head -120
  ls -la $OUT
fi
