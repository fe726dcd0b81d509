"""Your own prompts: `task=prompts task.data_files=FILE.jsonl`, one {"id": ..., "prompt": ...} per line."""

from __future__ import annotations

import json
from dataclasses import MISSING, dataclass
from pathlib import Path

from del_bench.errors import TaskError
from del_bench.schema import key
from del_bench.tasks.base import Sample, Task, TaskConfig


@dataclass(kw_only=True)
class PromptsConfig(TaskConfig):
    data_files: str = key(MISSING, 'a JSONL file, one {"id": …, "prompt": …} per line')


class Prompts(Task):
    name = "prompts"
    config = PromptsConfig
    version = "1"

    def load(self) -> list[Sample]:
        if not self.data_files:
            raise TaskError("task prompts: needs a file — add task.data_files=FILE.jsonl "
                            '(one {"id": ..., "prompt": ...} per line)')
        path = Path(self.data_files)
        if not path.is_file():
            raise TaskError(f"task prompts: no such file {str(path)!r}; set task.data_files=FILE.jsonl")
        samples = []
        for line_no, line in enumerate(path.read_text().splitlines(), start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                samples.append(Sample(id=str(record["id"]), prompt=str(record["prompt"])))
            except (json.JSONDecodeError, KeyError, TypeError) as err:
                raise TaskError(f"task prompts: {path}:{line_no} is not a JSON object with "
                                f'"id" and "prompt" ({err})') from err
        ids = [s.id for s in samples]
        if len(set(ids)) != len(ids):
            raise TaskError(f"task prompts: {path} has duplicate ids; every id must be unique")
        return samples
