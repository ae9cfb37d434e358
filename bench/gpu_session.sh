#!/usr/bin/env bash
# The GPU checks of the project in one call: the CUDA tests, then bench/gpu.py, each under its own
# timeout, their output printed and kept under $OUT (default: a folder under /tmp).
#
# On a machine with network, from the project's root, ready the wheels a GPU machine without
# network lacks (into .whl/, ignored by git):
#     bash ../shared/gpu/prepare.sh && bash bench/gpu_session.sh --prepare
# Then on the GPU machine, with .whl/ carried along (about 35 MiB):
#     bash bench/gpu_session.sh                   # about 5 minutes on an H100
#     bash bench/gpu_session.sh --quick           # tiny sizes: a check that it all runs (any machine)
# Where .whl/ is absent, the current Python environment is used as it is.
set -uo pipefail
cd "$(dirname "$0")/.."

if [[ "${1:-}" == "--prepare" ]]; then
    # What ../shared/gpu/prepare.sh leaves out and the store needs: zstandard (compression at rest).
    grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
    python3 -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d .whl zstandard 2>&1 | grep -v WARNING
    du -sh .whl
    exit 0
fi

quick=()
bench_args=(--budget-s "${BENCH_BUDGET_S:-200}")
if [[ "${1:-}" == "--quick" ]]; then
    quick=(--quick)
    bench_args=(--budget-s 60)
fi
out="${OUT:-$(mktemp -d /tmp/gpu-session.XXXXXX)}"
mkdir -p "$out"
python=python3
if [[ -d .whl ]]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
    [[ -d service/migrations ]] || cp -r migrations service/migrations  # importable as installed
    export PYTHONPATH="/tmp/site:$PWD"
elif [[ -x .venv/bin/python ]]; then
    python=.venv/bin/python
fi
export PYTHONUNBUFFERED=1

{
    echo "## $(date -u +%FT%TZ), $(git rev-parse --short HEAD 2>/dev/null || echo 'no git head')"
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "no nvidia-smi"
    echo "cores: $(nproc)"
    "$python" -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())"
} 2>&1 | tee "$out/machine.txt"

device=cuda
"$python" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" || device=cpu
echo "## CUDA tests" | tee "$out/cuda-tests.txt"
if [[ $device == cuda ]]; then
    # --noconftest: the suite's conftest needs what a GPU machine lacks (moto, a database server).
    timeout 180 "$python" -m pytest -q -p no:cacheprovider --noconftest -m cuda tests/client/test_cuda.py 2>&1 \
        | tee -a "$out/cuda-tests.txt"
    tests_status=${PIPESTATUS[0]}
else
    echo "not run: torch sees no CUDA device" | tee -a "$out/cuda-tests.txt"
    tests_status=0
fi
echo "## bench/gpu.py --device $device ${quick[*]} ${bench_args[*]}" | tee "$out/gpu-bench.txt"
timeout 330 "$python" bench/gpu.py --device "$device" "${quick[@]}" "${bench_args[@]}" 2>&1 | tee -a "$out/gpu-bench.txt"
bench_status=${PIPESTATUS[0]}

echo "## done: CUDA tests exit $tests_status, bench exit $bench_status; output in $out"
[[ $tests_status -eq 0 && $bench_status -eq 0 ]]
