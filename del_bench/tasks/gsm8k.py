"""GSM8K, 5-shot: exemplars from the train split (seeded shuffle, seed 42), accuracy on the "#### N" number.

Prompt (docs/design.md §5.1): per shot "Question: {question}\nAnswer: {answer}\n", then "\n", then
"Question: {question}\nAnswer:". Shot answers keep GSM8K's "<<48/2=24>>" calculator notes and the final
"#### N" line, so the model learns to end with "#### N".
Metrics: `correct` = the first "#### N" of the output (cut at the next "Question:") equals the reference
number (lm-eval's strict match, compared as numbers); `correct_flexible` = the output's last number does
(lm-eval's flexible extract); `rouge2` against the reference solution.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from del_bench.errors import TaskError
from del_bench.metrics.accuracy import gsm8k_flexible, gsm8k_reference, gsm8k_strict
from del_bench.metrics.rouge import rouge2
from del_bench.tasks.base import Sample
from del_bench.tasks.hub import FewShotConfig, FewShotTask, n_shot_key


@dataclass(kw_only=True)
class GSM8KConfig(FewShotConfig):
    n_shot: int = n_shot_key(5)


class GSM8K(FewShotTask):
    config = GSM8KConfig
    name = "gsm8k"
    version = "1"
    hub_id = "openai/gsm8k"
    hub_config = "main"
    split = "test"
    fields = ("question", "answer")
    shot_fields = ("question", "answer")
    shot_key = "question"

    def __init__(self, n_shot: int = 5, **kwargs: Any):
        super().__init__(n_shot=n_shot, **kwargs)

    def make_sample(self, index: int, record: dict) -> Sample:
        shots = "".join(f"Question: {s['question']}\nAnswer: {s['answer']}\n" for s in self.shots())
        header = shots + "\n" if shots else ""
        try:
            number = gsm8k_reference(record["answer"])
        except ValueError as err:
            raise TaskError(f"task {self.name}: record {index} of {self.source()}: {err}; "
                            "fix the file or point task.data_files= at another") from err
        return Sample(id=self.record_id(index, record),
                      prompt=f"{header}Question: {record['question']}\nAnswer:",
                      reference=record["answer"], meta={"answer_number": str(number)})

    def score(self, sample: Sample, output_text: str) -> dict[str, float]:
        target = gsm8k_reference(sample.reference)
        return {"correct": float(gsm8k_strict(output_text) == target),
                "correct_flexible": float(gsm8k_flexible(output_text) == target),
                "rouge2": rouge2(output_text, sample.reference)}
