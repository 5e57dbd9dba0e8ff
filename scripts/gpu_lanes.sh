#!/usr/bin/env bash
# Run kvchunk's three CUDA-only conformance lanes (gpu_copy, e2e, vllm_spec) on a GPU machine.
#
#   bash scripts/gpu_lanes.sh            # from the repo root; reports go to $OUT
#   bash scripts/gpu_lanes.sh --dry-run  # print each lane's command and timeout; run nothing
#
# gpu_copy and e2e are `python -m conformance --require-cuda -m "gpu_copy or e2e"`,
# split into one run per lane so that each lane has its own timeout (a slow engine
# start cannot starve the copy lane).  vllm_spec runs the byte lanes (data, tiered,
# tiered_faults) with `--spec` set to vLLM's own TieringOffloadingSpec, whose worker
# needs CUDA (without it those cases skip with the reason).  --require-cuda makes a
# run without CUDA fail at start with one line instead of skipping every case.
# docs/gpu-ci.md is the CI recipe around this script (tests/test_gpu_ci.py checks
# that the two agree).
#
# Environment (all optional):
#   OUT                 where reports go (default: reports/gpu)
#   PYTHON              interpreter holding CUDA torch + vllm (default: python3)
#   KVCHUNK_WHEELS      folder of carried wheels to install first (default: .whl)
#   GPU_COPY_TIMEOUT    seconds for the gpu_copy lane (default: 200)
#   E2E_TIMEOUT         seconds for the e2e lane (default: 360)
#   VLLM_SPEC_TIMEOUT   seconds for the vllm_spec lane (default: 600)
#   KVCHUNK_GPU_LANES_ANYWAY=1  run the lanes even without CUDA (no --require-cuda:
#                       they then skip; for checking this script on a CPU machine)
#   KVCHUNK_VLLM_RULES  a known release whose rules a dev/rc/post vLLM build runs
#                       (default: the newest known release's; see conformance/protocol/versions.py)
#
# What the machine must already have: a CUDA build of torch and vllm built against
# it, importable by $PYTHON: a known release (0.33.0, 0.34.0) or any build of
# vLLM main (its geometry fixtures are then derived live; never tried on a GPU).
# Neither can be carried: the device tool carries at most 64 MiB, and a CUDA
# torch wheel with its nvidia-* libraries is about 1 GiB, the vllm wheel about
# 0.4 GiB.  This workplace's H200 image (device/KINDS.md, 2026-11) has python3
# 3.12 with torch 2.11 and no vllm: there the script stops at the check below
# and says so in $OUT/gpu_lanes.md.
#
# Small pure-Python packages can be carried as wheels: on the dev machine,
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#       --implementation cp --platform manylinux2014_x86_64 -d .whl NAME==VERSION
# and pass carry=[".whl"] to the device tool.  (pytest and hypothesis are
# already on the H200 image.)  kvchunk itself needs no install: the repo root
# goes on PYTHONPATH, and the e2e engine runs in-process
# (VLLM_ENABLE_V1_MULTIPROCESSING=0, set by the lane), so
# kv_connector_module_path=vllm_adapter.connector resolves to this checkout.
#
# Files written to $OUT (at most 7, the device tool returns 8):
#   env.txt        GPU, python, torch/vllm versions, /dev/shm space
#   gpu_lanes.md   what ran, exit codes, or why nothing ran
#   <lane>.log     pytest output of the lane (all three lanes)
#   <lane>.md      its conformance table (gpu_copy and e2e only: vllm_spec runs
#                  plain pytest, which writes no report)

set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
ROOT=$PWD
OUT=${OUT:-$ROOT/reports/gpu}
PY=${PYTHON:-python3}
WHEELS=${KVCHUNK_WHEELS:-.whl}
LANES="gpu_copy e2e vllm_spec"
VLLM_SPEC=vllm.v1.kv_offload.tiering.spec:TieringOffloadingSpec
BYTE_LANES="conformance/lanes/test_data.py conformance/lanes/test_tiered.py conformance/lanes/test_tiered_faults.py"
REQUIRE_CUDA=--require-cuda
[ -n "${KVCHUNK_GPU_LANES_ANYWAY:-}" ] && REQUIRE_CUDA=""

lane_limit() {  # seconds each lane may take
    case $1 in
        gpu_copy) echo "${GPU_COPY_TIMEOUT:-200}" ;;
        e2e) echo "${E2E_TIMEOUT:-360}" ;;
        vllm_spec) echo "${VLLM_SPEC_TIMEOUT:-600}" ;;
    esac
}

lane_command() {  # the one command that runs a lane
    case $1 in
        vllm_spec) echo "$PY -m pytest -p conformance.plugin${REQUIRE_CUDA:+ $REQUIRE_CUDA} --spec $VLLM_SPEC $BYTE_LANES" ;;
        *) echo "$PY -m conformance${REQUIRE_CUDA:+ $REQUIRE_CUDA} -m $1" ;;
    esac
}

case "${1:-}" in
    --dry-run)
        for lane in $LANES; do
            echo "lane $lane: timeout $(lane_limit "$lane") s: $(lane_command "$lane")"
        done
        exit 0 ;;
    "") ;;
    *) echo "usage: bash scripts/gpu_lanes.sh [--dry-run]" >&2; exit 2 ;;
esac
mkdir -p "$OUT"
SUMMARY=$OUT/gpu_lanes.md
echo "# kvchunk GPU lanes" >"$SUMMARY"

# 1. Carried wheels (if any) into a private site dir.
if compgen -G "$WHEELS/*.whl" >/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/kvchunk-site "$WHEELS"/*.whl || { echo "wheel install failed" >>"$SUMMARY"; exit 1; }
    export PYTHONPATH=/tmp/kvchunk-site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false

# 2. What is here.
{
    if command -v nvidia-smi >/dev/null; then nvidia-smi -L 2>&1; else echo "nvidia-smi: not found"; fi
    "$PY" -V 2>&1
    "$PY" -c 'import torch; print("torch", torch.__version__, "cuda", torch.cuda.is_available())' 2>&1 | tail -1
    "$PY" -c 'import vllm; print("vllm", vllm.__version__)' 2>&1 | tail -1
    df -h /dev/shm 2>&1 | tail -1
} >"$OUT/env.txt"

# 3. Stop early, with the reason, when the lanes cannot run.
if ! "$PY" - >>"$SUMMARY" 2>&1 <<'EOF'; then
import importlib.util, os, sys
missing = [m for m in ("torch", "vllm", "pytest", "hypothesis") if importlib.util.find_spec(m) is None]
if missing:
    sys.exit(f"Not run: {', '.join(missing)} not importable by this python "
             "(torch + a CUDA build of vllm must be installed on the machine; they are too big to carry).")
import torch, vllm
if not torch.cuda.is_available() and not os.environ.get("KVCHUNK_GPU_LANES_ANYWAY"):
    sys.exit("Not run: torch.cuda.is_available() is False.")
gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA (lanes will skip)"
print(f"torch {torch.__version__}, vllm {vllm.__version__}, {gpu}")
EOF
    cat "$SUMMARY"
    exit 2
fi

# 4. The lanes, one run each, each under its own timeout.
status=0
for lane in $LANES; do
    limit=$(lane_limit "$lane")
    start=$(date +%s)
    stamp=$(mktemp)  # reports/conformance.md is tracked: never delete it, copy it only if this run wrote it
    # shellcheck disable=SC2046  # the command is words by design (lane_command)
    timeout -k 15 "$limit" $(lane_command "$lane") >"$OUT/$lane.log" 2>&1
    rc=$?
    # only `python -m conformance` writes the report; vllm_spec (plain pytest) keeps its log only
    [ "$lane" != vllm_spec ] && [ reports/conformance.md -nt "$stamp" ] && cp reports/conformance.md "$OUT/$lane.md"
    rm -f "$stamp"
    note=""
    [ "$rc" = 124 ] || [ "$rc" = 137 ] && note=" (timed out after ${limit}s)"
    echo "- $lane: exit $rc$note, $(($(date +%s) - start)) s" >>"$SUMMARY"
    [ "$rc" = 0 ] || status=1
done
cat "$SUMMARY"
exit $status
