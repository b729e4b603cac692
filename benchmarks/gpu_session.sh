#!/usr/bin/env bash
# Everything autopar measures on a lent GPU, in one run (device time is short): the preset's
# efficiency table measured on this GPU, the one-GPU step against eager (planned from the shipped
# tables, no profile), the CUDA paths' tests, then torch.compile beside autopar on the small model.
# Each part has its own time limit, so that one that hangs leaves the rest their time.
#
#   OUT=/tmp/gpu bash benchmarks/gpu_session.sh
#   PARTS=runtime,tests OUT=/tmp/gpu bash benchmarks/gpu_session.sh   # some parts (tables,runtime,tests,compiled,ring)
#
# Wheels the GPU machine lacks (ortools) may be carried in .whl/; they are installed to /tmp/site.
set -u
OUT=${OUT:-/tmp/autopar_gpu}
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site
fi
# PYTHONFAULTHANDLER: a process that dies of a signal prints its Python stack (spawned ranks too)
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1 AUTOPAR_PROGRESS=0 PYTHONFAULTHANDLER=1
nvidia-smi -L
python3 -c "import torch, ortools; print('torch', torch.__version__, 'CUDA', torch.version.cuda, 'ortools', ortools.__version__)"
preset=$(python3 -c "from autopar.core.mesh import hardware_for_device; print(hardware_for_device('cuda'))")
echo "preset: $preset"
PARTS=${PARTS:-tables,runtime,tests,compiled}
part() {   # part SECONDS LOG COMMAND...: run COMMAND (if PARTS names LOG's stem), output to the terminal and $OUT/LOG
    local limit=$1 log=$2; shift 2
    [[ ",$PARTS," == *",${log%.log},"* ]] || return 0
    echo "== $* (limit ${limit} s)"
    local t0=$SECONDS
    timeout "$limit" "$@" 2>&1 | tee "$OUT/$log"
    echo "== exit ${PIPESTATUS[0]} after $((SECONDS - t0)) s"
}
part 120 ring.log python3 benchmarks/gpu_ring.py --out "$OUT/gpu_ring.json"
part 110 tables.log python3 benchmarks/gpu_op_tables.py --preset "$preset" --out "$OUT/$preset.json"
part 190 runtime.log python3 benchmarks/gpu_runtime.py --rounds 3 --variants "eager;eager, autocast;autopar" \
    --out "$OUT/gpu_runtime.json"
part 240 tests.log python3 -m pytest -q -rfE -p no:cacheprovider tests/test_cuda.py
part 140 compiled.log python3 benchmarks/gpu_runtime.py --models gpt2-125m:8x1024 --rounds 3 \
    --out "$OUT/gpu_runtime_compiled.json"
