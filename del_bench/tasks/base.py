"""What every task provides: its samples, the exact prompt text, and how an output is scored.

A task is one file here plus one YAML in configs/task/. The runner only calls `select`,
`prompt` (through `Sample.prompt`), `score` (or, for a task with `batch_scoring`, `scoring_info` and
`score_batch` after generation) and `aggregate`; the engine never sees a task.
Multi-turn tasks (Spec-Bench's MT-bench questions) give `Sample.turns` instead: the runner then calls
`bind_tokenizer` once and `render(sample, history)` before each turn, since a later turn's prompt holds the
model's own earlier answers.
"""

from __future__ import annotations

import random
from abc import ABC, abstractmethod
from dataclasses import MISSING, dataclass, field
from typing import Any

from hydra.utils import get_class

from del_bench.errors import TaskError  # noqa: F401  (re-exported: tasks and tests import it from here)
from del_bench.schema import key


@dataclass(kw_only=True)
class TaskConfig:
    """The keys of every task config (configs/task/*.yaml); a task's class declares its own as a subclass of this, its
    `config`: each key's type, default and range, checked before any weights load (del_bench/schema.py)."""

    _target_: str | None = key(None, "the task's class (null: a task its caller builds, as lm-eval's requests)")
    name: str = key(MISSING, "its name in records and out_dir")
    data_files: str | list[str] | None = key(None, "local data (JSONL) instead of the hub's or the package's")
    n: int | None = key(None, "samples drawn when the run gives no limit (null: all)", ge=1)
    stop_strings: list[str] = key([], "an output ends at any of these (besides EOS and max_new_tokens)")
    samples_per_prompt: int = key(1, "outputs per prompt (pass@k)", ge=1)
    generation: dict | None = key(None, "generation keys this task fixes, over the run's (the same keys and ranges)")
    lm_eval: dict | None = key(None, "lm-eval's version and gen_kwargs, where lm-eval asked for the run")

    @staticmethod
    def schema_for(node) -> type:
        """The schema of the task class `_target_` names."""
        target = node.get("_target_")
        return get_class(target).config if target else TaskConfig


@dataclass
class Sample:
    id: str  # stable across runs: resume and paired speedups match samples by it
    prompt: str  # the exact text the model is given
    reference: Any = None  # what `score` compares the output with
    meta: dict = field(default_factory=dict)
    turns: list[str] | None = None  # multi-turn: the user's messages, asked in order (prompt text: Task.render)
    category: str | None = None  # recorded with the sample (SampleRecord.category): tables group by it


class Task(ABC):
    name: str = "task"
    config = TaskConfig  # its keys (a TaskConfig subclass): what a config of it may say, typed and ranged
    version: str = "0"  # bump when prompts, selection or scoring change; stored in every record

    def __init__(self, data_files: str | None = None, stop_strings: list[str] | None = None,
                 name: str | None = None, n: int | None = None, **_: Any):
        self.data_files = data_files
        self.stop_strings = list(stop_strings or [])
        # One class can back several configs (humaneval, humaneval_pass10): records carry the config's name.
        self.name = name or type(self).name
        self.n = n  # samples drawn when the run gives no limit (the paper: 1,000); None = all

    @abstractmethod
    def load(self) -> list[Sample]:
        """Every sample of the evaluation split, in source order."""

    def select(self, limit: int | None, seed: int) -> list[Sample]:
        """`limit` samples drawn with `seed` (kept in source order); the task's `n` when limit is None;
        all when both are None or the count is at least the number of samples."""
        samples = self.load()
        count = limit if limit is not None else self.n
        if count is None or count >= len(samples):
            return samples
        keep = sorted(random.Random(seed).sample(range(len(samples)), count))
        return [samples[i] for i in keep]

    prompt_format: str | None = None  # multi-turn tasks: how render() formats a conversation (recorded)
    tokenizer: Any = None

    def bind_tokenizer(self, tokenizer) -> None:
        """Called by the runner once the model is loaded, before any render() (chat templates live there)."""
        self.tokenizer = tokenizer

    def render(self, sample: Sample, history: list[tuple[str, str]]) -> str:
        """Multi-turn samples: the prompt text of turn len(history), given [(user turn, model answer), …]."""
        raise NotImplementedError(f"task {self.name}: sample {sample.id} has turns but the task has no render()")

    def score(self, sample: Sample, output_text: str) -> dict[str, float]:
        """Per-sample quality metrics (empty when the task has no reference)."""
        return {}

    # True: the runner stores outputs unscored while it generates, then scores them all with `score_batch`
    # (HumanEval: programs run in a sandbox, several at once, outside the decode loop).
    batch_scoring: bool = False

    def score_batch(self, pairs: list[tuple[Sample, str]]) -> list[dict[str, float]]:
        """`score` of each (sample, output_text), in order; a task may run them concurrently."""
        return [self.score(sample, text) for sample, text in pairs]

    def scoring_info(self) -> dict[str, Any]:
        """What the runner records beside each output's scores (HumanEval: {"sandbox": "bwrap" | "fallback"});
        called before generation, so a scorer that cannot work here fails before any decoding."""
        return {}

    def aggregate(self, scored: list[dict[str, Any]]) -> dict[str, float]:
        """Run-level quality metrics from one dict per generated output.

        Each dict holds `sample_id`, `repeat` (0..n-1 when a prompt is sampled n times) and the metrics
        `score` returned. By default: the mean of each numeric metric over all outputs.
        """
        keys = sorted({k for s in scored for k, v in s.items()
                       if k not in ("sample_id", "repeat") and isinstance(v, (int, float))})
        return {k: sum(s[k] for s in scored if k in s) / sum(1 for s in scored if k in s) for k in keys}
