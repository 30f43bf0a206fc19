#!/bin/bash
# A/B of two native builds on the GPU host, in one run: tests/gpu_ab.sh OLD_TREE VARIANT:STEP...
# OLD_TREE holds the baseline's sources (native/, CMakeLists.txt, tutti_cluster/, tests/), e.g. from
# `git archive <commit>`. Each VARIANT:STEP runs tests/gpu_device_run.sh STEP on one build: old (the
# baseline tree), new (this tree), new3 (this tree with TUTTI_IO_UNROLL=3). Output under $OUT/<variant>-<n>.
OLD=$1; shift
n=0
for vs in "$@"; do
  v=${vs%%:*}; step=${vs#*:}; n=$((n + 1))
  case $v in
  old) (cd "$OLD" && ln -sfn ../.whl .whl && ln -sfn ../.deb .deb && OUT=$OUT/$v-$n bash tests/gpu_device_run.sh $step > "$OUT/$v-$n.log" 2>&1) ;;
  new) BUILD_DIR=/tmp/bn OUT=$OUT/$v-$n bash tests/gpu_device_run.sh $step > "$OUT/$v-$n.log" 2>&1 ;;
  new3) BUILD_DIR=/tmp/bn3 CMAKE_EXTRA=-DCMAKE_CUDA_FLAGS=-DTUTTI_IO_UNROLL=3 OUT=$OUT/$v-$n \
      bash tests/gpu_device_run.sh $step > "$OUT/$v-$n.log" 2>&1 ;;
  esac
  echo "== $v $step: $(grep -E '^(tutti|limits)' "$OUT/$v-$n.log" | tr -s ' ' | cut -c1-90 | paste -sd'|')"
done
