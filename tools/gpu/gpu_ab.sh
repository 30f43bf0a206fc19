#!/bin/bash
# A/B of two native builds on the GPU host, in one run: tools/gpu/gpu_ab.sh OLD_TREE VARIANT:STEP...
# OLD_TREE holds the baseline's sources (native/, CMakeLists.txt, tutti_cluster/, tests/, tools/), e.g. from
# `git archive <commit>`. Each VARIANT:STEP runs tools/gpu/gpu_device_run.sh STEP on one build: old (the
# baseline tree) or new (this tree). Output under $OUT/<variant>-<n>; N (default 0) numbers on from a
# previous call.
OLD=$1; shift
# A baseline from before the scripts moved to tools/gpu/ has its run script in tests/.
OLD_RUN=tools/gpu/gpu_device_run.sh
[ -f "$OLD/$OLD_RUN" ] || OLD_RUN=tests/gpu_device_run.sh
n=${N:-0}
for vs in "$@"; do
  v=${vs%%:*}; step=${vs#*:}; n=$((n + 1))
  case $v in
  old) (cd "$OLD" && ln -sfn ../.whl .whl && ln -sfn ../.deb .deb && BUILD_DIR=/tmp/b-$(basename "$OLD") OUT=$OUT/$v-$n bash $OLD_RUN $step > "$OUT/$v-$n.log" 2>&1) ;;
  new) BUILD_DIR=/tmp/bn OUT=$OUT/$v-$n bash tools/gpu/gpu_device_run.sh $step > "$OUT/$v-$n.log" 2>&1 ;;
  *) echo "unknown variant '$v' (old or new)"; exit 1 ;;
  esac
  echo "== $v $step: $(grep -E '^(tutti|limits)|passed|failed' "$OUT/$v-$n.log" | tr -s ' ' | cut -c1-90 | paste -sd'|')"
done
