"""WMT14 German->English (newstest2014), 0-shot instruction prompt.

Prompt (docs/design.md §5.1, with its "English:" cue): "You are a professional translator. Translate the following
German sentence into English.\nGerman: {de}\nEnglish:".
Metrics: BLEU (sacrebleu) of the translation = the output's first non-empty line, since generation is not
stopped at the end of the sentence by default: `sentence_bleu` per sample, corpus `bleu` per run; `rouge2`
of the whole output against the reference, as the paper's code scores every task.
"""

from __future__ import annotations

from typing import Any

from del_bench.errors import TaskError
from del_bench.metrics.bleu import bleu_stats, corpus_bleu
from del_bench.metrics.rouge import rouge2
from del_bench.metrics.text import first_line
from del_bench.tasks.base import Sample
from del_bench.tasks.hub import HubTask

INSTRUCTION = "You are a professional translator. Translate the following German sentence into English."


class Wmt14DeEn(HubTask):
    name = "wmt14_de_en"
    version = "1"
    hub_id = "wmt/wmt14"
    hub_config = "de-en"
    split = "test"
    fields = ("translation",)

    def make_sample(self, index: int, record: dict) -> Sample:
        pair = record["translation"]
        if not isinstance(pair, dict) or not pair.get("de") or not pair.get("en"):
            raise TaskError(f"task {self.name}: record {index} of {self.source()} needs "
                            '{"translation": {"de": ..., "en": ...}}; fix the file or point task.data_files= '
                            "at another")
        return Sample(id=self.record_id(index, record), prompt=f"{INSTRUCTION}\nGerman: {pair['de']}\nEnglish:",
                      reference=pair["en"])

    def score(self, sample: Sample, output_text: str) -> dict[str, float]:
        return {**bleu_stats(first_line(output_text), sample.reference),
                "rouge2": rouge2(output_text, sample.reference)}

    def aggregate(self, scored: list[dict[str, Any]]) -> dict[str, float]:
        means = super().aggregate(scored)
        summary = {k: means[k] for k in ("sentence_bleu", "rouge2") if k in means}
        return {"bleu": corpus_bleu(scored), **summary} if scored else summary
