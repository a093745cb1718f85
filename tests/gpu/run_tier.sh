#!/usr/bin/env bash
# The GPU tier in one command: `bash tests/gpu/run_tier.sh [pytest options]` from the repo root.
# The tests that share the device run side by side in GPU_TIER_WORKERS pytest-xdist workers
# (default 6; 0 runs them one at a time), those marked gpu_alone (they measure the device's
# memory or take every GPU) after them, alone. Both phases share one NVRAY_CACHE_DIR, so Triton
# compiles a kernel once for the run. Each file prints `[gpu tier] tests/gpu/<file>: ...` as its
# last test ends (tests/gpu/conftest.py): a run cut by a time limit still says what passed.
set -uo pipefail
workers=${GPU_TIER_WORKERS:-6}
export NVRAY_CACHE_DIR=${NVRAY_CACHE_DIR:-$(mktemp -d -t nvray-gpu-tier-XXXXXX)}
export TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
side_by_side=(-p no:cacheprovider)
if [ "$workers" != 0 ] && python -c "import xdist" 2>/dev/null; then
  side_by_side+=(-n "$workers" --dist loadgroup)
elif [ "$workers" != 0 ]; then
  echo "[gpu tier] pytest-xdist is not installed: the tests run one at a time" >&2
fi
start=$SECONDS
python -m pytest -m "gpu and not gpu_alone" "${side_by_side[@]}" tests/gpu "$@"; shared=$?
python -m pytest -m "gpu and gpu_alone" -p no:cacheprovider tests/gpu "$@"; alone=$?
echo "[gpu tier] both phases in $((SECONDS - start)) s (exit codes $shared, $alone)"
[ "$shared" = 0 ] && [ "$alone" = 0 ]
