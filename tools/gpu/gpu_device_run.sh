#!/bin/bash
# Runs steps on the lent GPU host, from the repository root: tools/gpu/gpu_device_run.sh STEP...
# Steps: tests (GPU tests), memory (host memory copy bandwidth by thread count; the storage read
# limit alone and while the GPU copies from pinned memory), shm (bench, all
# systems, /dev/shm as a stand-in for an NVMe array, tutti-mapped included),
# disk (bench on the real disk, O_DIRECT, caches dropped), driver (640K tokens through the fixed
# staging area), cpudisk and cpushm (the bench with the KV cache in host memory: the CPU backend on
# this host's disk and on /dev/shm), cluster (the cluster benchmark; needs .cdeb/ with etcd-server
# and the Mooncake and python3-etcd3 wheels in .cwhl/ or .whl/; CLUSTER_DEVICE=cuda: the requesting
# engine on the GPU, after the GPU cluster tests; CLUSTER_RUNS: owner store and units, default "shm:16 shm:64 tmp:16"),
# memcheck (GPU tests selected by MEMCHECK_K, default "skipped or scatter", under compute-sanitizer's
# memcheck; $OUT/memcheck.log), none (build only). The native module is built first (CUDA on, sm_90; CUDA off when the only step
# is cluster), with liburing from the Debian packages in .deb/ and the wheels the image lacks in
# .whl/. Logs and JSON go to $OUT (or ./gpu-out). Environment: STAGING_MB and QD for the /dev/shm
# bench (default 2048 and 64), REPEAT (rounds per /dev/shm cell, default 3), SHM_SYSTEMS (default:
# all), PREFIXES (default 16K,32K,64K,128K), DISK_PREFIXES (default 16K,128K), BUDGET_S (later
# steps get what is left of it; default 570 s).
# pipeline: `tutti bench --pipeline` (TTFT of a Llama-3-8B-shaped prefill, prefix restored layer by
# layer) from /dev/shm, then the disk while more than DISK_MIN_S (default 150) s are left; JSON and
# PNG in $OUT. PIPE_MODEL (llama3-8b), PIPE_INPUTS (64K,128K), PIPE_PREFIXES (16K,32K,64K,96K,-1u),
# PIPE_REPEAT (1), PIPE_SYSTEMS (all), PIPE_ARGS (more flags), PIPE_DISK (1; 0 skips the disk),
# PIPE_DISK_INPUTS (64K), PIPE_DISK_PREFIXES (16K,32K,-1u), PIPE_GLM=1 adds the GLM-4-9B-1M shape
# (PIPE_GLM_INPUTS 128K,640K, prefix -1u, no recompute or per-chunk, 512-token units); PIPE_TEST=1
# runs the pipeline's GPU tests first.
# pipeline_tp: the GLM-4-9B-1M shape tensor-parallel (issue 18): for each size in TP_SIZES (default
# "2 1"), prefixes of TP_PREFIXES tokens (default 128K,256K,512K,640K; the input one 512-token unit
# longer) from /dev/shm, systems ideal, tutti, load-all, split attention; NCCL with a GPU per rank,
# gloo with the ranks sharing the GPU where the host has fewer (TP_BACKEND overrides; such a run
# checks the code path, its times are not a TP run's). TP_TEST=1 runs the two-rank GPU test first.
# tiers: issue 46's memory-tier figures, memory tier on /dev/shm, storage tier on the disk
# (/var/tmp, O_DIRECT), each ratio against limits of the same run: `tutti bench tiers --figures` (a hot
# set from memory against the host-to-GPU limit at TIER_PREFIXES, default 16K,128K; a request mixing
# both tiers against its halves alone and stores into memory during a flush, against the mapped store,
# at the smallest prefix; that flush of TIER_FLUSH_GB, default 4, against the disk's write limit;
# TIER_REPEAT rounds, default 2), then `tutti bench --pipeline --memory-paths` (TTFT and ITL with the
# memory tier and no unit in memory against no memory tier, and with every unit in memory against the
# HBM ideal, its storage tier on /dev/shm, read through io_uring beside a memory tier; TIER_PIPE_INPUTS 32K, TIER_PIPE_PREFIXES 50%,-1u, TIER_PIPE_REPEAT 3, ideal and tutti
# only; once per copy_engine_mb in TIER_PIPE_COPY_MB, default 0); JSON in $OUT. About 210 s on an H100.
# TIER_FIGURES=0 skips the figures, TIER_PIPE=0 the pipeline; TIER_COPY_MB: the figures'
# copy_engine_mb (default 0).
# copyab: a hot set in memory (`tutti-mapped` on /dev/shm, AB_PREFIXES default 16K,128K) through the
# kernel's loads against the copy engine's stage, alternating copy_engine_mb 0 and 1024 at each of
# AB_SMS (default "8 16") I/O SMs, AB_ROUNDS rounds (default 2); AB_MBS: the copy_engine_mb values
# (default "0 1024"); about 30 s a cell on an H100.
# hotdiag: where a hot set in memory loses time against host-to-GPU (tools/diag/hot_set_timeline.py:
# each layer's arrival on the GPU, for each of HOT_VARIANTS, default "copy_engine_mb=1024
# copy_engine_mb=0"), then the flush against write passes beside it (tools/diag/flush_bandwidth.py,
# FLUSH_UNITS 32 MiB units, default 128, FLUSH_ROUNDS, default 3, on /var/tmp; HOT_FLUSH=0 skips it).
set -u
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
log() { echo "== $(date -u +%H:%M:%S) $*"; }
left() { local n=$(( ${BUDGET_S:-570} - SECONDS )); echo $(( n > 1 ? n : 1 )); }

log "machine"
{ nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv; nproc; free -g; df -h / /dev/shm /var/tmp; uname -r; } 2>&1

log "wheels and liburing"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
mkdir -p /tmp/uring && for f in .deb/*.deb; do dpkg -x "$f" /tmp/uring; done

CUDA=on
[ "$*" = cluster ] && [ "${CLUSTER_DEVICE:-cpu}" = cpu ] && CUDA=off
log "build (CUDA $CUDA)"
cmake -S . -B ${BUILD_DIR:-/tmp/b} -G Ninja -DTUTTI_CUDA=$CUDA -DPython_EXECUTABLE="$(which python3)" \
  -Dpybind11_DIR="$(python3 -m pybind11 --cmakedir)" -DLIBURING_INCLUDE=/tmp/uring/usr/include \
  -DLIBURING_LIB=/tmp/uring/usr/lib/x86_64-linux-gnu/liburing.a ${CMAKE_EXTRA:-} > "$OUT/build.log" 2>&1 &&
  ninja -C ${BUILD_DIR:-/tmp/b} >> "$OUT/build.log" 2>&1 || { tail -40 "$OUT/build.log"; exit 1; }
cp ${BUILD_DIR:-/tmp/b}/_native*.so tutti_cluster/
export PYTHONPATH=$PWD:/tmp/site
python3 -c "from tutti_cluster import _native; print('has_cuda', _native.has_cuda)"

BENCH='import sys; from tutti_cluster.bench import main; sys.exit(main(sys.argv[1:]))'
SHM="/dev/shm/tb0 /dev/shm/tb1 /dev/shm/tb2 /dev/shm/tb3"
PREFIXES=${PREFIXES:-16K,32K,64K,128K}
bench() { timeout "$(left)" python3 -c "$BENCH" --device cuda "$@" 2>&1 | grep -v "it/s\]\|step/s\]"; }
cpubench() { timeout "$(left)" python3 -c "$BENCH" --device cpu "$@" 2>&1 | grep -v "it/s\]\|step/s\]"; }

for step in "$@"; do
  case $step in
  tests)
    log "gpu tests"
    TUTTI_CUDA_TRACE=1 timeout 240 python3 -m pytest -q -m gpu --timeout=90 tests/test_gpu.py 2>&1 | tee "$OUT/tests.log" | tail -6 ;;
  memory)
    log "host memory copy bandwidth"
    timeout "$(left)" python3 tools/diag/host_copy_bandwidth.py --json "$OUT/copy.json"
    timeout "$(left)" python3 tools/diag/limit_under_h2d.py --path /dev/shm/lim --json "$OUT/limit_h2d.json"
    rm -rf /dev/shm/lim ;;
  shm)
    log "bench /dev/shm (stand-in for an NVMe array), staging ${STAGING_MB:-2048} MiB, queue depth ${QD:-64}"
    mkdir -p $SHM
    TUTTI_STAGING_MB=${STAGING_MB:-2048} TUTTI_QUEUE_DEPTH=${QD:-64} bench --paths $SHM --repeat ${REPEAT:-3} \
      --prefix-tokens $PREFIXES --limit-gb 4 ${SHM_SYSTEMS:+--systems $SHM_SYSTEMS} --json "$OUT/bench_shm.json" | tail -32
    rm -rf $SHM ;;
  disk)
    log "bench disk (O_DIRECT, caches dropped)"
    mkdir -p /var/tmp/tutti-disk
    bench --paths /var/tmp/tutti-disk --prefix-tokens ${DISK_PREFIXES:-16K,128K} --systems tutti \
      --drop-caches --limit-gb 2 --json "$OUT/bench_disk.json" | tail -12
    [ "$(left)" -gt 120 ] && bench --paths /var/tmp/tutti-disk --prefix-tokens 16K \
      --systems per-block per-chunk kvikio --drop-caches --limit-gb 1 --json "$OUT/bench_disk_base.json" | tail -12
    rm -rf /var/tmp/tutti-disk ;;
  cpudisk)
    log "bench, CPU backend, disk (O_DIRECT, caches dropped)"
    mkdir -p /var/tmp/tutti-disk
    cpubench --paths /var/tmp/tutti-disk --prefix-tokens ${DISK_PREFIXES:-16K,32K,64K,128K} --drop-caches \
      --systems ${CPU_SYSTEMS:-tutti} --json "$OUT/bench_cpu_disk.json" | tail -16
    rm -rf /var/tmp/tutti-disk ;;
  cpushm)
    log "bench, CPU backend, /dev/shm"
    mkdir -p $SHM
    cpubench --paths $SHM --prefix-tokens $PREFIXES --systems tutti tutti-mapped per-block \
      --json "$OUT/bench_cpu_shm.json" | tail -20
    rm -rf $SHM ;;
  driver)
    log "driver 640K"
    mkdir -p $SHM
    timeout $(left) python3 tools/gpu/gpu_bench_driver.py --paths $SHM --tokens 640K --json "$OUT/driver.json" 2>&1 | tail -28
    rm -rf $SHM ;;
  cluster)
    log "cluster: etcd and the Transfer Engine's libraries from .cdeb/"
    mkdir -p /tmp/cdeb /tmp/clibs && for f in .cdeb/*.deb; do dpkg -x "$f" /tmp/cdeb; done
    for lib in /tmp/cdeb/usr/lib/x86_64-linux-gnu/*.so.*; do
      ldconfig -p | grep -q "$(basename "$lib") " || ln -sf "$lib" /tmp/clibs/
    done
    export PATH=/tmp/cdeb/usr/bin:$PATH LD_LIBRARY_PATH=/tmp/clibs:${LD_LIBRARY_PATH:-}
    [ -d .cwhl ] && { python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site .cwhl/*.whl || exit 1; }
    python3 -c "import mooncake.engine; print('mooncake ok')" || exit 1
    if [ "${CLUSTER_DEVICE:-cpu}" = cuda ]; then
      log "GPU engine cluster tests"
      timeout 240 python3 -m pytest -q -m gpu --timeout=120 tests/test_gpu_cluster.py 2>&1 | tee "$OUT/cluster_tests.log" | tail -6
    fi
    for run in ${CLUSTER_RUNS:-shm:16 shm:64 tmp:16}; do
      set -- ${run/:/ }
      owner=$([ $1 = shm ] && echo /dev/shm/owner || echo /var/tmp/owner)
      log "cluster bench, $2 units, owner store on $owner"
      mkdir -p $owner
      timeout $(left) python3 -m tutti_cluster.bench.cluster --only fetch --owner-path $owner --units $2 \
        --device ${CLUSTER_DEVICE:-cpu} --json "$OUT/cluster_$1_$2.json" 2>&1 | grep -v "^[IWE][0-9]\{4\} " | tail -8
      rm -rf $owner
    done ;;
  pipeline_tp)
    if [ "${TP_TEST:-0}" = 1 ]; then
      log "two-rank pipeline gpu test"
      timeout 300 python3 -m pytest -q -m gpu -rs tests/test_pipeline_tp.py 2>&1 | tee "$OUT/pipeline_tp_tests.log" | tail -6
    fi
    gpus=$(nvidia-smi -L | wc -l)
    inputs=$(python3 -c "import sys; from tutti_cluster.bench.options import parse_tokens as p; \
      print(','.join(str(p(t) + 512) for t in sys.argv[1].split(',')))" "${TP_PREFIXES:-128K,256K,512K,640K}")
    for tp in ${TP_SIZES:-2 1}; do
      backend=${TP_BACKEND:-$([ "$gpus" -ge "$tp" ] && echo nccl || echo gloo)}
      log "bench --pipeline glm4-9b-1m, TP=$tp ($backend, $gpus GPUs), inputs $inputs, from /dev/shm"
      mkdir -p $SHM
      TUTTI_UNIT_TOKENS=512 TUTTI_STAGING_MB=${STAGING_MB:-2048} TUTTI_QUEUE_DEPTH=${QD:-64} bench --pipeline \
        --tp $tp --tp-backend $backend --paths $SHM --model glm4-9b-1m --inputs $inputs --prefix-tokens=-1u \
        --systems ideal tutti load-all --attention split --decode-steps 4 ${PIPE_ARGS:-} \
        --json "$OUT/pipeline_tp$tp.json" | grep -v "step/s\]" | tail -30
      rm -rf $SHM
    done ;;
  pipeline)
    if [ "${PIPE_TEST:-0}" = 1 ]; then
      log "pipeline gpu tests"
      timeout 240 python3 -m pytest -q -m gpu -rs tests/test_pipeline.py 2>&1 | tee "$OUT/pipeline_tests.log" | tail -6
    fi
    log "bench --pipeline ${PIPE_MODEL:-llama3-8b} from /dev/shm (stand-in for an NVMe array)"
    mkdir -p $SHM
    TUTTI_STAGING_MB=${STAGING_MB:-2048} TUTTI_QUEUE_DEPTH=${QD:-64} bench --pipeline --paths $SHM \
      --model ${PIPE_MODEL:-llama3-8b} --inputs ${PIPE_INPUTS:-64K,128K} \
      --prefix-tokens=${PIPE_PREFIXES:-16K,32K,64K,96K,-1u} --repeat ${PIPE_REPEAT:-1} \
      ${PIPE_SYSTEMS:+--systems $PIPE_SYSTEMS} ${PIPE_ARGS:-} \
      --json "$OUT/pipeline_shm.json" --plot "$OUT/pipeline_shm.png" | grep -v "step/s\]" | tail -60
    rm -rf $SHM
    if [ "${PIPE_GLM:-0}" = 1 ]; then
      log "bench --pipeline glm4-9b-1m from /dev/shm"
      mkdir -p $SHM
      TUTTI_UNIT_TOKENS=512 TUTTI_STAGING_MB=${STAGING_MB:-2048} TUTTI_QUEUE_DEPTH=${QD:-64} bench --pipeline \
        --paths $SHM --model glm4-9b-1m --inputs ${PIPE_GLM_INPUTS:-128K,640K} --prefix-tokens=-1u \
        --systems ideal tutti naive load-all --decode-steps 4 ${PIPE_ARGS:-} \
        --json "$OUT/pipeline_glm_shm.json" --plot "$OUT/pipeline_glm_shm.png" | grep -v "step/s\]" | tail -30
      rm -rf $SHM
    fi
    if [ "${PIPE_DISK:-1}" = 1 ] && [ "$(left)" -gt "${DISK_MIN_S:-150}" ]; then
      log "bench --pipeline from the disk (O_DIRECT)"
      mkdir -p /var/tmp/tutti-pipe
      bench --pipeline --paths /var/tmp/tutti-pipe --model ${PIPE_MODEL:-llama3-8b} \
        --inputs ${PIPE_DISK_INPUTS:-64K} --prefix-tokens=${PIPE_DISK_PREFIXES:-16K,32K,-1u} \
        --repeat 1 ${PIPE_SYSTEMS:+--systems $PIPE_SYSTEMS} ${PIPE_ARGS:-} \
        --json "$OUT/pipeline_disk.json" --plot "$OUT/pipeline_disk.png" | grep -v "step/s\]" | tail -40
      rm -rf /var/tmp/tutti-pipe
    fi ;;
  tiers)
    mkdir -p /dev/shm/tutti-tmem /var/tmp/tutti-tiers
    if [ "${TIER_FIGURES:-1}" = 1 ]; then
      log "memory-tier figures: memory tier on /dev/shm, storage on /var/tmp (O_DIRECT)"
      TUTTI_COPY_ENGINE_MB=${TIER_COPY_MB:-0} TUTTI_STAGING_MB=${STAGING_MB:-2048} TUTTI_QUEUE_DEPTH=${QD:-64} \
        timeout "$(left)" python3 -c \
        'import sys; from tutti_cluster.bench.tiers import main; sys.exit(main(sys.argv[1:]))' --figures \
        --device cuda --paths /var/tmp/tutti-tiers --memory-paths /dev/shm/tutti-tmem \
        --prefix-tokens ${TIER_PREFIXES:-16K,128K} --repeat ${TIER_REPEAT:-2} --flush-gb ${TIER_FLUSH_GB:-4} \
        --limit-gb 2 --json "$OUT/tiers_figures.json" 2>&1 | grep -v "it/s\]\|step/s\]" | tail -20
    fi
    if [ "${TIER_PIPE:-1}" = 1 ]; then
      for mb in ${TIER_PIPE_COPY_MB:-0}; do
        log "bench --pipeline ${PIPE_MODEL:-llama3-8b} with the memory tier (copy_engine_mb $mb): storage on /dev/shm (a stand-in for NVMe, read through io_uring), memory tier on /dev/shm"
        mkdir -p /dev/shm/tutti-tsto /dev/shm/tutti-tmem
        TUTTI_COPY_ENGINE_MB=$mb TUTTI_STAGING_MB=${STAGING_MB:-2048} TUTTI_QUEUE_DEPTH=${QD:-64} bench --pipeline \
          --paths /dev/shm/tutti-tsto --memory-paths /dev/shm/tutti-tmem --model ${PIPE_MODEL:-llama3-8b} \
          --inputs ${TIER_PIPE_INPUTS:-32K} --prefix-tokens=${TIER_PIPE_PREFIXES:-50%,-1u} --systems ideal tutti \
          --no-writeback --repeat ${TIER_PIPE_REPEAT:-3} --json "$OUT/pipeline_tiers_m$mb.json" | grep -v "step/s\]" | tail -16
        rm -rf /dev/shm/tutti-tsto /dev/shm/tutti-tmem
      done
    fi
    rm -rf /dev/shm/tutti-tmem /dev/shm/tutti-tsto /var/tmp/tutti-tiers ;;
  copyab)
    for r in $(seq ${AB_ROUNDS:-2}); do for sms in ${AB_SMS:-8 16}; do for mb in ${AB_MBS:-0 1024}; do
      log "copy engine A/B: round $r, $sms I/O SMs, copy_engine_mb $mb"
      mkdir -p $SHM
      TUTTI_IO_SMS=$sms TUTTI_COPY_ENGINE_MB=$mb TUTTI_STAGING_MB=${STAGING_MB:-2048} TUTTI_QUEUE_DEPTH=${QD:-64} \
        bench --paths $SHM --systems tutti-mapped --prefix-tokens ${AB_PREFIXES:-16K,128K} --repeat 2 \
        --limit-gb 2 --json "$OUT/copyab_r${r}_s${sms}_m${mb}.json" | grep -E "retrieve|host-to-GPU"
      rm -rf $SHM
    done; done; done ;;
  hotdiag)
    log "hot set timeline: ${HOT_VARIANTS:-copy_engine_mb=1024 copy_engine_mb=0}"
    V=""; for v in ${HOT_VARIANTS:-copy_engine_mb=1024 copy_engine_mb=0}; do V="$V --variant $v"; done
    timeout "$(left)" python3 tools/diag/hot_set_timeline.py --paths $SHM --prefix-tokens ${HOT_PREFIXES:-16K 128K} \
      --rounds ${HOT_ROUNDS:-5} $V --json "$OUT/hot_timeline.json" 2>&1 | grep -v "it/s\]"
    rm -rf $SHM
    if [ "${HOT_FLUSH:-1}" = 1 ]; then
      log "flush against the write passes beside it"
      timeout "$(left)" python3 tools/diag/flush_bandwidth.py --path /var/tmp/fb --memory-path /dev/shm/fb \
        --units ${FLUSH_UNITS:-128} --rounds ${FLUSH_ROUNDS:-3} --json "$OUT/flush.json" 2>&1 | grep -E "round|x_write|flush_gbps|write_limit"
    fi
    rm -rf /var/tmp/fb /dev/shm/fb ;;
  memcheck)
    log "compute-sanitizer memcheck: GPU tests -k '${MEMCHECK_K:-skipped or scatter}'"
    CS=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
    timeout "$(left)" "$CS" --tool memcheck --error-exitcode 9 python3 -m pytest -q -m gpu -p no:cacheprovider \
      tests/test_gpu.py -k "${MEMCHECK_K:-skipped or scatter}" > "$OUT/memcheck.log" 2>&1
    echo "memcheck exit $?"; grep -E "ERROR SUMMARY|passed|failed" "$OUT/memcheck.log" ;;
  none) ;;
  esac
done
log "done"
