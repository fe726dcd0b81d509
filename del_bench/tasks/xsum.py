"""XSum abstractive summarisation, 0-shot (LayerSkip `prepare_xsum_summarization_format`, n_shot=0).

Prompt: "Article: {document}\nSummary:". ROUGE-2 against `summary`.
"""

from __future__ import annotations

from del_bench.metrics.rouge import rouge2
from del_bench.tasks.base import Sample
from del_bench.tasks.hub import HubTask


class XSum(HubTask):
    name = "xsum"
    version = "1"
    hub_id = "EdinburghNLP/xsum"
    split = "test"
    fields = ("document", "summary")

    def make_sample(self, index: int, record: dict) -> Sample:
        return Sample(id=self.record_id(index, record), prompt=f"Article: {record['document']}\nSummary:",
                      reference=record["summary"])

    def score(self, sample: Sample, output_text: str) -> dict[str, float]:
        return {"rouge2": rouge2(output_text, sample.reference)}
