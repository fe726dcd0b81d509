"""CNN/DailyMail abstractive summarisation, 1-shot (LayerSkip `prepare_cnn_dm_summarization_format`).

Prompt: per shot "Article: {article}\nSummary: {highlights without newlines}\n", then "\n", then
"Article: {article}\nSummary:". The shot is train `.shuffle(seed=42).select(range(1))` on the hub.
Offline there is no CNN/DM train file (docs/design.md §5.2): pass the evaluation file as
`task.shots_files` too; the shot is then drawn from it with the same seeded shuffle and that article is
left out of the samples. ROUGE-2 against the highlights.
"""

from __future__ import annotations

from dataclasses import dataclass

from del_bench.metrics.rouge import rouge2
from del_bench.tasks.base import Sample
from del_bench.tasks.hub import FewShotConfig, FewShotTask, n_shot_key


@dataclass(kw_only=True)
class CnnDmSumConfig(FewShotConfig):
    n_shot: int = n_shot_key(1)


def summary_shot(article: str, summary: str) -> str:
    # LayerSkip removes the newlines between HF highlights without adding a space ("... .\nNext" -> "... .Next").
    return f"Article: {article}\nSummary: {summary.replace(chr(10), '')}\n"


class CnnDmSum(FewShotTask):
    config = CnnDmSumConfig
    name = "cnndm_sum"
    version = "1"
    hub_id = "abisee/cnn_dailymail"
    hub_config = "3.0.0"
    split = "test"
    fields = ("article", "highlights")
    shot_fields = ("article", "highlights")
    shot_key = "article"

    def __init__(self, n_shot: int = 1, **kwargs):
        super().__init__(n_shot=n_shot, **kwargs)

    def make_sample(self, index: int, record: dict) -> Sample:
        shots = "".join(summary_shot(s["article"], s["highlights"]) for s in self.shots())
        header = shots + "\n" if shots else ""
        return Sample(id=self.record_id(index, record), prompt=f"{header}Article: {record['article']}\nSummary:",
                      reference=record["highlights"])

    def score(self, sample: Sample, output_text: str) -> dict[str, float]:
        return {"rouge2": rouge2(output_text, sample.reference)}
