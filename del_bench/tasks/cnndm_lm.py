"""CNN/DailyMail as language modelling: the first 100 whitespace words of an article; reference = the rest.

Prompt (LayerSkip `prepare_cnn_dm_lm_format`): " ".join(article.split()[:100]), nothing else. ROUGE-2 of the
output against " ".join(article.split()[100:]).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from del_bench.metrics.rouge import rouge2
from del_bench.schema import key
from del_bench.tasks.base import Sample
from del_bench.tasks.hub import HubTask, HubTaskConfig


@dataclass(kw_only=True)
class CnnDmLMConfig(HubTaskConfig):
    prefix_words: int = key(100, "the article's first words: the prompt", ge=1)


class CnnDmLM(HubTask):
    config = CnnDmLMConfig
    name = "cnndm_lm"
    version = "1"
    hub_id = "abisee/cnn_dailymail"
    hub_config = "3.0.0"
    split = "test"
    fields = ("article",)

    def __init__(self, prefix_words: int = 100, **kwargs: Any):
        super().__init__(**kwargs)
        self.prefix_words = int(prefix_words)

    def make_sample(self, index: int, record: dict) -> Sample:
        words = record["article"].split()
        return Sample(id=self.record_id(index, record), prompt=" ".join(words[:self.prefix_words]),
                      reference=" ".join(words[self.prefix_words:]))

    def score(self, sample: Sample, output_text: str) -> dict[str, float]:
        return {"rouge2": rouge2(output_text, sample.reference)}
