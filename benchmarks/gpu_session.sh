#!/usr/bin/env bash
# One lent GPU's quarter hour, in order of need: the CUDA tests, then the benchmarks the open goals wait for
# (derivatives, the forward grid and fixed costs, Sinkhorn),
# each bounded by the time left (BUDGET seconds, default 480), every result written under OUT (default
# runs/gpu-session) as it comes. gpu.json there starts as a copy of benchmarks/gpu.json, so that the rows
# measured merge with the earlier sections; copy it back (and regenerate gpu.md) once they are checked.
#
#     BUDGET=480 OUT=runs/gpu-session bash benchmarks/gpu_session.sh
#
# It needs torch with CUDA (and Triton); POT and GeomLoss are optional peers (their rows say n/a without them).
set -u
END=$((SECONDS + ${BUDGET:-480}))
OUT=${OUT:-runs/gpu-session}
mkdir -p "$OUT"
left() { echo $((END - SECONDS)); }
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv | tee "$OUT/smi.txt"
cp benchmarks/gpu.json "$OUT/gpu.json"
B="python3 benchmarks/bench_gpu.py --out $OUT/gpu.md --json $OUT/gpu.json"
echo "== tests ($(left) s left)"
timeout 140 python3 -m pytest tests/test_cuda.py -q -p no:cacheprovider -rA > "$OUT/test_cuda.txt" 2>&1
echo "rc=$?" >> "$OUT/test_cuda.txt"; grep -E "passed|failed|relative error|rc=" "$OUT/test_cuda.txt" | tail -12
echo "== derivatives ($(left) s left)"
T=$(( $(left) - 150 )); [ $T -gt 220 ] && T=220
[ $T -gt 20 ] && timeout $T $B --sections derivatives --quick --cap 10 --deadline $((T - 15)) > "$OUT/derivatives.txt" 2>&1
tail -34 "$OUT/derivatives.txt" 2>/dev/null
echo "== fixed and grid at N <= 1e5 ($(left) s left)"
timeout 75 $B --sections fixed --deadline 60 > "$OUT/fixed.txt" 2>&1; tail -10 "$OUT/fixed.txt"
T=$(( $(left) - 110 )); [ $T -gt 150 ] && T=150
[ $T -gt 20 ] && timeout $T $B --sections grid --quick --cap 10 --deadline $((T - 15)) > "$OUT/grid.txt" 2>&1
tail -26 "$OUT/grid.txt" 2>/dev/null
echo "== sinkhorn ($(left) s left)"
T=$(( $(left) - 5 )); [ $T -gt 100 ] && T=100
[ $T -gt 20 ] && timeout $T $B --sections sinkhorn --quick --cap 20 --deadline $((T - 20)) > "$OUT/sinkhorn.txt" 2>&1
tail -5 "$OUT/sinkhorn.txt" 2>/dev/null
echo "== done ($(left) s left); results in $OUT"
