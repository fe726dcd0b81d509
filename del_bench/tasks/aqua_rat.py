"""AQuA-RAT, 5-shot chain of thought with the SIRIUS exemplars (Zhou et al. 2024), as the DEL paper.

Prompt = the SIRIUS prompt file (`fewshot_file`), cleaned as Sirius does (literal "\\n" sequences and
backslashes removed), ending in one blank line, then
"Q: {question}\nOptions: (a) {o1} (b) {o2} (c) {o3} (d) {o4} (e) {o5}\nA:" where each option drops its "A)"
label. Sirius tokenises the exemplars and the question separately and joins the ids; here the runner
tokenises this one string, which can differ by a token at the seam.

The file `aqua_cot_prompts_5shot.txt` repeats one exemplar (3rd and 5th: the "k-2 members" question, ending
"So the answer is (c)" and then "(a)"). Sirius and the DEL paper ran with it as it is, so it is used
unchanged; `aqua_cot_prompts_5shot_old.txt` is the variant without the repeat. The file is not on the HF hub
and has no stated licence, so it is not shipped: `fewshot_file` must point at it.

Metrics: `correct` = the option letter after "so the answer is" (output cut at the next "Q:", Sirius'
stopping string) equals `correct`; `rouge2` against the rationale.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from del_bench.errors import TaskError
from del_bench.metrics.accuracy import aqua_letter
from del_bench.metrics.rouge import rouge2
from del_bench.schema import key
from del_bench.tasks.base import Sample
from del_bench.tasks.hub import HubTask, HubTaskConfig

OFFLINE_SHOTS = "../shared/data/aqua_rat/fewshot_sirius/aqua_cot_prompts_5shot.txt"


def clean_cot(text: str) -> str:
    """Sirius' clean-up of its prompt files, then exactly one blank line before the question."""
    text = text.replace("\\n", "").replace("\\", "")
    return text.rstrip("\n") + "\n\n"


@dataclass(kw_only=True)
class AquaRatConfig(HubTaskConfig):
    fewshot_file: str | None = key(None, "the SIRIUS 5-shot prompt file (required to run; not on the hub)")


class AquaRat(HubTask):
    config = AquaRatConfig
    name = "aqua_rat"
    version = "1"
    hub_id = "deepmind/aqua_rat"
    hub_config = "raw"
    split = "test"
    fields = ("question", "options", "rationale", "correct")

    def __init__(self, fewshot_file: str | None = None, **kwargs: Any):
        super().__init__(**kwargs)
        self.fewshot_file = fewshot_file
        self._cot: str | None = None

    def cot(self) -> str:
        if self._cot is None:
            if not self.fewshot_file:
                raise TaskError(f"task {self.name}: needs the SIRIUS 5-shot CoT prompt file (not on the HF hub); "
                                f"set task.fewshot_file={OFFLINE_SHOTS}")
            path = Path(self.fewshot_file).expanduser()
            try:
                self._cot = clean_cot(path.read_text(encoding="utf-8"))
            except OSError as err:
                raise TaskError(f"task {self.name}: cannot read task.fewshot_file={str(path.resolve())!r} "
                                f"({err}); point it at {OFFLINE_SHOTS}") from err
        return self._cot

    def make_sample(self, index: int, record: dict) -> Sample:
        options = record["options"]
        if not isinstance(options, list) or len(options) != 5 or str(record["correct"]) not in "ABCDE":
            raise TaskError(f"task {self.name}: record {index} of {self.source()} needs 5 options and a "
                            f"correct letter A-E; fix the file or point task.data_files= at another")
        listed = " ".join(f"({letter}) {option[2:]}" for letter, option in zip("abcde", options))
        prompt = f"{self.cot()}Q: {record['question']}\nOptions: {listed}\nA:"
        return Sample(id=self.record_id(index, record), prompt=prompt, reference=record["rationale"],
                      meta={"correct": record["correct"].lower()})

    def score(self, sample: Sample, output_text: str) -> dict[str, float]:
        return {"correct": float(aqua_letter(output_text) == sample.meta["correct"]),
                "rouge2": rouge2(output_text, sample.reference)}
