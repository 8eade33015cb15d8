#!/usr/bin/env bash
# The GPU checks of one lent-machine call, with logs that come back: run there as
#   bash .gpu/session.sh          (device tool: carry [".gpu"], timeout_s ~560; scripts/prepare_gpu.sh first)
# 1. pytest -m gpu on the machine's torch; 2. make test-gpu's CLI stages (LoRA, QLoRA, Liger, compile);
# 3. benchmarks/rollout_engines.py (generate vs paged) on a tiny model and on the 1B shape; 4. benchmarks/gpu_throughput.py
# rows (ROWS=..., STEPS=15). Each stage has its own time limit (T_PYTEST, T_STAGES, T_ROLL, T_BENCH seconds) so that
# the call ends within its limit; logs are written under $OUT/logs as they come, so a call cut short still brings back
# what ran. Seen on an H100 (2026-11-28): the first call's setup 47 s, pytest -m gpu 95 s, each CLI stage ~36 s, the
# rollout stage 100 s, 4 throughput rows of 15 steps 130 s: the defaults below fit a 560 s call.
L="${OUT:-/tmp}/logs"; mkdir -p "$L"
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
timeout -k 5 "${T_STAGES:-150}" python3 scripts/test_gpu.py --only "${STAGES:-lora,qlora,liger,compile}" --out /tmp/stages > "$L/stages.txt" 2>&1
echo "stages rc $?"
mkdir -p "$L/stages" && cp /tmp/stages/*.log "$L/stages/" 2>/dev/null
grep -E "^(lora|qlora|liger|compile|test-gpu)" "$L/stages.txt" | cut -c1-300
el "rollout engines"
{ timeout -k 5 "${T_ROLL:-50}" python3 benchmarks/rollout_engines.py --model none --prompts 64 --max-new 64
  timeout -k 5 "${T_ROLL:-50}" python3 benchmarks/rollout_engines.py --model /tmp/llama1b --prompts 64 --max-new 64
} > "$L/rollout.log" 2>&1
echo "rollout rc $?"
grep -vE "^\s*$" "$L/rollout.log" | grep -E "model:|tokens/s|paged /|Error|error" | cut -c1-300 | tail -12
el "throughput"
timeout -k 5 "${T_BENCH:-160}" python3 benchmarks/gpu_throughput.py --steps "${STEPS:-15}" \
  --rows "${ROWS:-default,trl-wrapped,liger,compile}" --logs "$L/bench" > "$L/bench.log" 2>&1
echo "bench rc $?"
cut -c1-400 "$L/bench.log"
el "done"
find "$L" -name '*.safetensors' -delete
