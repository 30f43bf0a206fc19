#!/bin/bash
# Builds the native module with the CUDA backend on the GPU host and runs the GPU tests and
# benchmarks there. Usage: tests/gpu_device_run.sh PHASE (check | full | x2 | final), from the repository root,
# with the Debian liburing packages in .deb/ and the wheels the image lacks in .whl/.
# Writes logs and JSON under $OUT (or ./gpu-out). Phase final reads PAIR (1: K and V as one I/O),
# QD (agent queue depth on /dev/shm), FINAL_BUDGET_S, DISK_BASELINES=0 and OTHER_MODE=0 (skip steps).
set -u
PHASE=${1:-check}
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
log() { echo "== $(date -u +%H:%M:%S) $*"; }

log "machine"
{ nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv; nproc; free -g; df -h / /dev/shm /var/tmp; uname -r; } 2>&1

log "wheels and liburing"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
mkdir -p /tmp/uring && for f in .deb/*.deb; do dpkg -x "$f" /tmp/uring; done

log "build"
cmake -S . -B /tmp/b -G Ninja -DTUTTI_CUDA=on -DPython_EXECUTABLE="$(which python3)" \
  -Dpybind11_DIR="$(python3 -m pybind11 --cmakedir)" -DLIBURING_INCLUDE=/tmp/uring/usr/include \
  -DLIBURING_LIB=/tmp/uring/usr/lib/x86_64-linux-gnu/liburing.a > "$OUT/build.log" 2>&1 &&
  ninja -C /tmp/b >> "$OUT/build.log" 2>&1 || { tail -40 "$OUT/build.log"; exit 1; }
cp /tmp/b/_native*.so tutti_cluster/
export PYTHONPATH=$PWD:/tmp/site
python3 -c "from tutti_cluster import _native; print('has_cuda', _native.has_cuda)"

BENCH='import sys; from tutti_cluster.bench import main; sys.exit(main(sys.argv[1:]))'
SHM="/dev/shm/tb0 /dev/shm/tb1 /dev/shm/tb2 /dev/shm/tb3"
mkdir -p /dev/shm/tb0 /dev/shm/tb1 /dev/shm/tb2 /dev/shm/tb3 /var/tmp/tutti-disk

if [ "$PHASE" = check ]; then
  log "gpu tests"
  TUTTI_STRESS_IOCTX=${TUTTI_STRESS_IOCTX:-500000} timeout 300 python3 -m pytest -q -x -m gpu --timeout=150 \
    tests/test_gpu.py 2>&1 | tee "$OUT/tests.log" | tail -25
  log "driver 128K"
  timeout 150 python3 tests/gpu_bench_driver.py --paths $SHM --tokens 128K --json "$OUT/driver.json" 2>&1 | tail -40
  log "bench tutti 128K shm"
  timeout 150 python3 -c "$BENCH" --device cuda --paths $SHM --systems tutti --prefix-tokens 128K --limit-gb 2 \
    --json "$OUT/bench_check.json" 2>&1 | grep -v "it/s\]" | tail -15
fi

if [ "$PHASE" = full ]; then
  log "gpu tests"
  TUTTI_CUDA_TRACE=1 timeout 100 python3 -m pytest -q -m gpu --timeout=90 tests/test_gpu.py 2>&1 | tee "$OUT/tests.log" | tail -6
  log "bench /dev/shm (stand-in for an NVMe array)"
  TUTTI_CUDA_TRACE=1 timeout 200 python3 -c "$BENCH" --device cuda --paths $SHM --prefix-tokens 16K,32K,64K,128K \
    --json "$OUT/bench_shm.json" 2>&1 | grep -v "it/s\]" | tail -26
  log "driver 640K"
  TUTTI_CUDA_TRACE=1 timeout 90 python3 tests/gpu_bench_driver.py --paths $SHM --tokens 640K --json "$OUT/driver.json" 2>&1 | grep -v "^ \"/dev\|^ \]\|paths" | tail -28
  log "bench disk (O_DIRECT, caches dropped)"
  timeout 80 python3 -c "$BENCH" --device cuda --paths /var/tmp/tutti-disk --prefix-tokens ${DISK_PREFIXES:-16K,128K} \
    --systems tutti --drop-caches --limit-gb 2 --json "$OUT/bench_disk.json" 2>&1 | grep -v "it/s\]" | tail -12
fi
if [ "$PHASE" = x2 ]; then
  log "two processes, two GPUs; concurrent requests"
  timeout 90 python3 -m pytest -q -m gpu --timeout=80 -k "two_processes or concurrent or compute" tests/test_gpu.py 2>&1 | tee "$OUT/tests_x2.log" | tail -4
  for qd in 64 24; do
    log "bench tutti 128K, staging 2 GiB, queue depth $qd"
    TUTTI_STAGING_MB=2048 TUTTI_QUEUE_DEPTH=$qd TUTTI_CUDA_TRACE=1 timeout 75 python3 -c "$BENCH" --device cuda --paths $SHM \
      --systems tutti --prefix-tokens 128K --limit-gb 4 --json "$OUT/bench_shm_2g_qd$qd.json" 2>&1 | grep -v "it/s\]" | tail -9
  done
fi
if [ "$PHASE" = final ]; then
  # One run for the figures: /dev/shm with a 2 GiB staging area (the same-run limits read into a
  # buffer of that size, so they are not served from the CPU caches), then the real disk, then
  # 640K tokens and the other K/V I/O mode, while the time allows (FINAL_BUDGET_S seconds).
  # PAIR=1 takes the figures with K and V of a unit-layer as one I/O (TUTTI_CUDA_PAIR=1).
  export TUTTI_CUDA_PAIR=${PAIR:-0}
  BUDGET=${FINAL_BUDGET_S:-480}
  QD=${QD:-24}
  log "gpu tests"
  TUTTI_CUDA_TRACE=1 timeout 120 python3 -m pytest -q -m gpu --timeout=90 tests/test_gpu.py 2>&1 | tee "$OUT/tests.log" | tail -6
  log "bench /dev/shm (stand-in for an NVMe array), staging 2 GiB, queue depth $QD"
  TUTTI_STAGING_MB=2048 TUTTI_QUEUE_DEPTH=$QD TUTTI_CUDA_TRACE=1 timeout 240 python3 -c "$BENCH" --device cuda --paths $SHM \
    --prefix-tokens 16K,32K,64K,128K --limit-gb 4 --json "$OUT/bench_shm.json" 2>&1 | grep -v "it/s\]" | tail -30
  rm -rf /dev/shm/tb?/*
  log "bench disk (O_DIRECT, caches dropped): tutti"
  TUTTI_CUDA_TRACE=1 timeout 100 python3 -c "$BENCH" --device cuda --paths /var/tmp/tutti-disk --prefix-tokens 16K,128K \
    --systems tutti --drop-caches --limit-gb 2 --json "$OUT/bench_disk.json" 2>&1 | grep -v "it/s\]" | tail -14
  if [ "${DISK_BASELINES:-1}" = 1 ] && [ $SECONDS -lt $((BUDGET - 150)) ]; then
    log "bench disk: baselines at 16K"
    timeout 90 python3 -c "$BENCH" --device cuda --paths /var/tmp/tutti-disk --prefix-tokens 16K \
      --systems per-block per-chunk kvikio --drop-caches --limit-gb 1 --json "$OUT/bench_disk_base.json" 2>&1 | grep -v "it/s\]" | tail -12
  fi
  rm -rf /var/tmp/tutti-disk/*
  if [ $SECONDS -lt $((BUDGET - 100)) ]; then
    log "driver 640K"
    TUTTI_CUDA_TRACE=1 timeout 100 python3 tests/gpu_bench_driver.py --paths $SHM --tokens 640K --json "$OUT/driver.json" 2>&1 | grep -v "^ \"/dev\|^ \]\|paths" | tail -28
  fi
  rm -rf /dev/shm/tb?/*
  if [ "${OTHER_MODE:-1}" = 1 ] && [ $SECONDS -lt $((BUDGET - 45)) ]; then
    log "bench /dev/shm 128K, tutti, the other K/V I/O mode (TUTTI_CUDA_PAIR=$((1 - TUTTI_CUDA_PAIR)))"
    TUTTI_CUDA_PAIR=$((1 - TUTTI_CUDA_PAIR)) TUTTI_STAGING_MB=2048 TUTTI_QUEUE_DEPTH=$QD TUTTI_CUDA_TRACE=1 timeout 45 python3 -c "$BENCH" --device cuda \
      --paths $SHM --systems tutti --prefix-tokens 128K --limit-gb 4 --json "$OUT/bench_shm_other_mode.json" 2>&1 | grep -v "it/s\]" | tail -10
  fi
fi
rm -rf /dev/shm/tb0 /dev/shm/tb1 /dev/shm/tb2 /dev/shm/tb3 /var/tmp/tutti-disk
log "done"
