"""Training: the LayerSkip recipe (layer dropout + early-exit loss) on a local corpus (`python -m del_bench
train-layerskip`): layerskip.py (schedules, curricula, loss), data.py (corpus, BPE, packing), trainer.py (loop)."""
