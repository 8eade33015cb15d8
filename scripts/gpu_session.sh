#!/usr/bin/env bash
# The GPU checks of one lent-machine call, with logs that come back: run there as
#   bash .gpu/session.sh          (device tool: carry [".gpu"], timeout_s ~560; scripts/prepare_gpu.sh first)
# 1. pytest -m gpu on the machine's torch; 2. make test-gpu's CLI stages (LoRA, QLoRA, Liger, compile);
# 3. benchmarks/gpu_throughput.py rows (ROWS=..., STEPS=20). Each stage has its own time limit (T_PYTEST, T_STAGES,
# T_BENCH seconds) so that the logs are tarred into $OUT/logs.tgz before the call's limit.
L=/tmp/logs; mkdir -p "$L"
t0=$(date +%s); el() { echo "[$(( $(date +%s) - t0 ))s] $*"; }
. .gpu/setup.sh > "$L/setup.log" 2>&1 || { cat "$L/setup.log"; exit 1; }
cat "$L/setup.log"
{ nvidia-smi; python3 -c "import torch, transformers, peft, liger_kernel, triton; print(torch.__version__, torch.version.cuda, transformers.__version__, peft.__version__, triton.__version__)"; python3 -c "import trl, bitsandbytes; print('trl', trl.__version__, 'bnb', bitsandbytes.__version__)"; } > "$L/env.txt" 2>&1
tail -3 "$L/env.txt"
python3 .gpu/make_llama1b.py /tmp/llama1b > "$L/make.log" 2>&1 &
el "pytest -m gpu"
timeout -k 5 "${T_PYTEST:-150}" python3 -m pytest -m gpu -q -rfEs -n 4 -p no:cacheprovider ${PYTEST_ARGS:-} > "$L/pytest.log" 2>&1
echo "pytest rc $?"
grep -E "^(FAILED|ERROR|SKIPPED)|passed|failed" "$L/pytest.log" | cut -c1-300 | tail -25
wait
el "CLI stages"
timeout -k 5 "${T_STAGES:-120}" python3 scripts/test_gpu.py --only "${STAGES:-lora,qlora,liger,compile}" --out "$L/stages" > "$L/stages.txt" 2>&1
echo "stages rc $?"
grep -E "^(lora|qlora|liger|compile|test-gpu)" "$L/stages.txt" | cut -c1-300
el "throughput"
timeout -k 5 "${T_BENCH:-250}" python3 benchmarks/gpu_throughput.py --steps "${STEPS:-20}" \
  --rows "${ROWS:-default,trl-wrapped,liger,compile,padded16,trl-padded,long,long-sdpa-mask}" --logs "$L/bench" > "$L/bench.log" 2>&1
echo "bench rc $?"
cut -c1-400 "$L/bench.log"
el "done"
find "$L" -name '*.safetensors' -delete
tar czf "$OUT/logs.tgz" -C /tmp logs
