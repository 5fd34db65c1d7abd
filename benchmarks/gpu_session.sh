#!/usr/bin/env bash
# One lent GPU's quarter hour: the steps named on the command line, in that order, each bounded by the time
# left (BUDGET seconds, default 480), every result written under OUT (default runs/gpu-session) as it comes.
# gpu.json there starts as a copy of benchmarks/gpu.json, so that the rows measured merge with the earlier
# sections; copy it back (and regenerate gpu.md) once they are checked.
#
#     TEST_ARGS="-n 4" BUDGET=330 bash benchmarks/gpu_session.sh tests grid fixed-cost dynamics-1e6   # the plan of
#                                                                     # benchmarks/README.md, first call
#     BUDGET=480 OUT=runs/gpu-session bash benchmarks/gpu_session.sh                  # the default steps below
#     BUDGET=560 bash benchmarks/gpu_session.sh tests grid-1e6 dynamics-1e6 derivatives-1e6   # goals 1-3, 6 at 1e6
#     BUDGET=595 bash benchmarks/gpu_session.sh lipschitz-only-1e6                   # goal 4 at 1e6 (the call alone)
#     BUDGET=300 bash benchmarks/gpu_session.sh small tests                          # the small heads' kernels
#     BUDGET=200 bash benchmarks/gpu_session.sh fixed positions-1e6 grid-1e6-64     # what 2026-11-27 left unmeasured
#     BUDGET=300 bash benchmarks/gpu_session.sh series clusters-1e6                 # the series engine; goal 7's 1e6
#     BUDGET=300 bash benchmarks/gpu_session.sh lipschitz-series                    # goal 7's local constants at 1e6
#
# Steps, with the seconds each is expected to take on an H200 (from the rows of benchmarks/gpu.md, N^2 to 1e6):
#   tests            tests/test_cuda.py (68 tests; on a fresh machine 67 passed in 70 s with TEST_ARGS="-n 4" on
#                    2026-11-29, where one process once ran 39 of 63 in 140 s; up to 300 s)
#   derivatives      VJP / JVP at 1e4 and 1e5, d = 3 and 64, every engine (about 100 s)
#   small            the small heads' FMA kernels against the matrix-product kernels and SDPA, d = 3, 1e4 and 1e5,
#                    each mask: forward, JVP, VJP (55 s on 2026-11-29)
#   small-1e6        the same at 1e6, no mask and arbitrary positions (300 s on 2026-11-29, cut by the step's limit
#                    after those two masks: the matrix-product kernels take 6-24 s a call there)
#   fixed            fixed costs at 1e3 and 1e4 (about 20 s)
#   fixed-cost       bench_fixed_cost.py at 1e3 and 1e4: checked, deferred, naive; deferred dense vs before (about 40 s)
#   grid             attention forward at 1e3 .. 1e5 (about 25 s)
#   sinkhorn         Sinkhorn at 1e4 .. 1e5 (about 40 s)
#   grid-1e6         attention forward at 1e6, d = 3, each mask, one timed call per candidate (about 110 s)
#   derivatives-1e6  VJP and JVP at 1e6, d = 3, ours against SDPA's backward (about 250 s)
#   dynamics         simulate, rk4, 10 steps at 1e4 and 1e5 against the RK4 loop on SDPA (goal 6's small calls; about
#                    15 s: 2.56 s at 1e5 on 2026-11-27)
#   dynamics-1e6     simulate, rk4, 2 steps at 1e6 against the RK4 loop on SDPA (55 s on 2026-11-30: ours 5.85 s,
#                    the loop 49 s)
#   grid-1e6-64      attention forward at 1e6, d = 64, each mask (about 150 s)
#   positions-1e6    VJP and JVP at 1e6, d = 3, arbitrary positions only (about 60 s: 24 s and 20 s)
#   lipschitz-1e6    certified Lipschitz at 1e5, then at 1e6 if the N^2 extrapolation fits the time left
#                    (2026-11-30, auto on the small-head kernels: 1e5 1.64 s, 1e6 189 s; 191 s in all)
#   lipschitz-only-1e6  certified Lipschitz at 1e6 alone, after an untimed call at 1e4 (a call stops between two
#                    products when the next would not fit, its row saying how far it got). 2026-11-30, in
#                    lipschitz-1e6: 189 s at 1e6 (50 float32 products, 1.8 s and 3.1 s alternately, 125 s; 2 float64
#                    products 56 s; graph recordings 8 s), where 2026-11-27's matrix-product kernels took 28.75 s a
#                    Lanczos vector
#   series           bench_series.py: the series engine against auto's path before it, sphere tokens, d = 3, float32
#                    and float64, 1e4 .. 1e6 (37 s on 2026-11-29)
#   clusters-1e6     bench_series.py --clusters: the dynamics study's at-scale run (SA on the sphere, beta = 1, T = 30,
#                    120 RK4 steps, float64) at 1e5 and 1e6 (35 s on 2026-11-29: 5.1 s and 24.4 s)
#   studies-full     meanfield reproduce --only discrete_vs_meanfield dynamics --device cuda at the full level (goal 7:
#                    the at-scale grids up to N = 1e6, 3 samples of the local constants and 2 clustering starts per N),
#                    its report, figures and tables packed into $OUT/studies-full.tar.gz (a call brings back 8 files):
#                    186 s on 2026-11-30 (93 s each study). It needs POT (exact W2), absent from the H200 image: carry
#                    its wheel (below) and start the command with the device README's pip install line, else the
#                    step is skipped at once; a call of its own (590 s), whatever finished is packed
#   lipschitz-series bench_series.py --lipschitz: the discrete-versus-mean-field study's at-scale local constants
#                    through the series (local_lipschitz(attention="series")) at 1e4 .. 1e6, the exact path beside it
#                    where it fits (25 s on 2026-11-29: 1e6 in 6.4 s)
# Each step's rows are saved as they come; a row is replaced only by a new measurement of the same row. Rows at
# 1e6 run at 1e5 first (compilation; a warm-up and one timed call, not kept), then are timed once (--repeats 1,
# no warm-up call), each started only if the 1e5 time, scaled as N^2, fits the step's time left.
# It needs torch with CUDA (and Triton). POT and GeomLoss are optional peers, absent from the H200 image (their
# rows say n/a; the package imports POT only where exact W2 or the dense Sinkhorn runs, which studies-full needs);
# carry wheels (the device README: pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation
# cp --platform manylinux_2_28_x86_64 ... -d .whl pot, `echo /.whl/ >> .git/info/exclude`, carry [".whl"]) and start
# the command with: python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl &&
# export PYTHONPATH=/tmp/site; (POT 0.9.7.post1's wheel, 33 MB, on 2026-11-30; numpy and scipy are on the image).
# TEST_ARGS adds pytest options to the tests step: TEST_ARGS="-n 4" spreads the CUDA tests over 4 processes (the
# H200 image has pytest-xdist), so that their Triton compilations run side by side.
# Every step's output goes to one log, $OUT/steps.log (a call brings back a limited number of files): with
# smi.txt, gpu.json and gpu.md, four files whatever the steps.
set -u
export PYTHONUNBUFFERED=1   # every line reaches the log as it is printed, also from a step the timeout kills
STEPS="tests derivatives fixed small small-1e6 fixed-cost series clusters-1e6 lipschitz-series studies-full grid sinkhorn dynamics grid-1e6
derivatives-1e6 grid-1e6-64 positions-1e6 dynamics-1e6 lipschitz-1e6 lipschitz-only-1e6"
for step in "$@"; do   # every name checked before the first step spends any time
  case " $(echo $STEPS) " in *" $step "*) ;; *) echo "unknown step: $step (steps: $(echo $STEPS))"; exit 2 ;; esac
done
END=$((SECONDS + ${BUDGET:-480}))
OUT=${OUT:-runs/gpu-session}
mkdir -p "$OUT"
left() { echo $((END - SECONDS)); }
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv | tee "$OUT/smi.txt"
python3 -c "import ot" 2>/dev/null && echo "POT: $(python3 -c 'import ot; print(ot.__version__)')" ||
  echo "POT: absent (its rows say n/a)"
[ -f "$OUT/gpu.json" ] || cp benchmarks/gpu.json "$OUT/gpu.json"
LOG="$OUT/steps.log"; touch "$LOG"
# log STEP CMD...: CMD's output appended to the session's log under a header, its exit status after it, the tail
# shown here
log() {
  local step=$1; shift
  local from=$(( $(wc -l < "$LOG") + 1 ))
  echo "== $step" >> "$LOG"
  "$@" >> "$LOG" 2>&1
  local rc=$?
  case $rc in 0) echo "rc=0" ;; 124|137) echo "rc=$rc: killed by the step's timeout" ;; *) echo "rc=$rc: failed" ;;
  esac >> "$LOG"
  tail -n +$((from + 1)) "$LOG" | tail -${TAIL:-30}
}
# limit MOST: the seconds a direct step may take, min(MOST, time left); 0 when 20 s or less are left
limit() { local T=$(( $(left) < $1 ? $(left) : $1 )); [ $T -gt 20 ] && echo $T || echo 0; }
B=(python3 benchmarks/bench_gpu.py --out "$OUT/gpu.md" --json "$OUT/gpu.json")
# run STEP SECONDS_AT_MOST RESERVE ARGS...: the bench within min(SECONDS_AT_MOST, time left - RESERVE) seconds; it
# starts no row after --until (an absolute time: its own start-up counts) 15 s before the timeout
run() {
  local step=$1 most=$2 reserve=$3; shift 3
  local T=$(( $(left) - reserve )); [ $T -gt $most ] && T=$most
  echo "== $step ($(left) s left, $T s for it)"
  if [ $T -gt 20 ]; then
    log "$step" timeout -k 10 $T "${B[@]}" "$@" --until $(( $(date +%s) + T - 15 ))
  else
    echo "not run: too little time left"
  fi
}
[ $# -eq 0 ] && set -- tests derivatives fixed grid sinkhorn
for step in "$@"; do
  case $step in
    tests)
      T=$(limit 300); echo "== tests ($(left) s left, $T s for it)"
      # SIGINT, not SIGTERM: pytest stopped by an interrupt still prints its failures and the summary of what ran
      [ $T -gt 0 ] && TAIL=14 log tests timeout -s INT -k 15 $T python3 -m pytest tests/test_cuda.py -q \
        -p no:cacheprovider -rA ${TEST_ARGS:-} ;;
    derivatives) run derivatives 220 100 --sections derivatives --quick --cap 10 ;;
    fixed) run fixed 75 0 --sections fixed ;;
    small) run small 150 0 --sections small --quick --cap 10 ;;
    small-1e6) run small-1e6 300 0 --sections small --sizes 1e6 --masks none positions --repeats 1 --cap 60 ;;
    fixed-cost)
      T=$(limit 90); echo "== fixed-cost ($(left) s left, $T s for it)"
      [ $T -gt 0 ] && TAIL=11 log fixed-cost timeout -k 5 $T python3 benchmarks/bench_fixed_cost.py --device cuda \
        --sizes 1000 10000 --repeats 7 ;;
    series)
      T=$(limit 150); echo "== series ($(left) s left, $T s for it)"
      [ $T -gt 0 ] && TAIL=12 log series timeout -k 5 $T python3 benchmarks/bench_series.py --device cuda \
        --sizes 1e4 1e5 1e6 --cap 20 ;;
    clusters-1e6)
      T=$(limit 400); echo "== clusters-1e6 ($(left) s left, $T s for it)"
      # --cap: 1e6 runs only if 1e5's time, scaled by N, fits what the step has left
      [ $T -gt 0 ] && TAIL=6 log clusters-1e6 timeout -k 5 $T python3 benchmarks/bench_series.py --device cuda \
        --clusters 1e5 1e6 --cap $((T * 2 / 3)) ;;
    lipschitz-series)
      T=$(limit 400); echo "== lipschitz-series ($(left) s left, $T s for it)"
      [ $T -gt 0 ] && TAIL=6 log lipschitz-series timeout -k 5 $T python3 benchmarks/bench_series.py --device cuda \
        --lipschitz 1e4 1e5 1e6 --cap 60 ;;
    studies-full)
      if ! python3 -c "import ot" 2>/dev/null; then   # exact W2: every study's first grid point needs it (2026-11-30)
        echo "== studies-full skipped: the studies need POT, absent here (carry its wheel: the header says how)"; continue
      fi
      T=$(limit 590); echo "== studies-full ($(left) s left, $T s for it)"
      # the report of what finished is written as each study ends; whatever is there is packed, also after a timeout
      [ $T -gt 30 ] && TAIL=30 log studies-full timeout -s INT -k 15 $((T - 15)) python3 -m studies.cli reproduce \
        --only discrete_vs_meanfield dynamics --device cuda --out /tmp/studies-full --no-progress
      [ -d /tmp/studies-full ] && tar czf "$OUT/studies-full.tar.gz" -C /tmp studies-full ;;
    grid) run grid 150 60 --sections grid --quick --cap 10 ;;
    sinkhorn) run sinkhorn 100 5 --sections sinkhorn --quick --cap 20 ;;
    grid-1e6) run grid-1e6 200 0 --sections grid --sizes 1e6 --dims 3 --repeats 1 --cap 60 ;;
    derivatives-1e6) run derivatives-1e6 400 0 --sections derivatives --sizes 1e6 --dims 3 --repeats 1 --cap 60 ;;
    grid-1e6-64) run grid-1e6-64 220 0 --sections grid --sizes 1e6 --dims 64 --repeats 1 --cap 60 ;;
    positions-1e6) run positions-1e6 120 0 --sections derivatives --sizes 1e6 --dims 3 --masks positions --repeats 1 --cap 60 ;;
    dynamics) run dynamics 60 0 --sections dynamics --quick --cap 20 ;;
    dynamics-1e6) run dynamics-1e6 200 0 --sections dynamics --sizes 1e6 --steps 2 --repeats 1 --cap 120 ;;
    lipschitz-1e6) run lipschitz-1e6 590 0 --sections lipschitz --sizes 1e5 1e6 --repeats 1 ;;
    lipschitz-only-1e6) run lipschitz-only-1e6 595 0 --sections lipschitz --sizes 1e6 --repeats 1 ;;
  esac
done
echo "== done ($(left) s left); results in $OUT"
