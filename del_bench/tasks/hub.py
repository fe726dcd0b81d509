"""Tasks whose records are a HuggingFace dataset: the hub id by default, a local JSONL with the same field
names when `task.data_files=PATH` is set. Both go through `datasets.load_dataset`; every failure becomes one
TaskError naming the task, the source and the override that fixes it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from del_bench.errors import TaskError
from del_bench.schema import key
from del_bench.tasks.base import Sample, Task, TaskConfig


def _files(files: Any) -> str | list[str] | None:
    """Hydra hands lists over as ListConfig; datasets wants str or list[str]."""
    if files is None or isinstance(files, str):
        return files
    return [str(f) for f in files]


def _describe(files: str | list[str]) -> str:
    names = [files] if isinstance(files, str) else files
    return ", ".join(repr(str(Path(f).expanduser().resolve())) for f in names)


def _reason(err: BaseException) -> str:
    # datasets wraps parse errors ("JSON parse error ... in row 3") in a generic DatasetGenerationError.
    cause = err.__cause__
    detail = f"{type(err).__name__}: {err}"
    return f"{detail} ({type(cause).__name__}: {cause})" if cause else detail


def load_records(task: str, files: Any, hub: tuple[str, str | None, str], key: str = "data_files",
                 fields: tuple[str, ...] = ()):
    """The split as a `datasets.Dataset`: from `files` (JSONL) when given, else `hub` = (id, config, split)."""
    import datasets  # heavy; only tasks that read data pay for it

    files = _files(files)
    field_note = f" (one JSON object per line with fields {', '.join(fields)})" if fields else ""
    if files:
        try:
            return datasets.load_dataset("json", data_files=files, split="train")
        except Exception as err:  # FileNotFoundError, DatasetGenerationError, ...: all mean "cannot read"
            raise TaskError(f"task {task}: cannot read task.{key}={_describe(files)}: {_reason(err)}; "
                            f"point task.{key}= at a readable JSONL file{field_note}") from err
    hub_id, config, split = hub
    try:
        return datasets.load_dataset(hub_id, config, split=split)
    except Exception as err:  # ConnectionError when the hub is unreachable or offline mode is on
        where = f"{hub_id!r}" + (f" (config {config!r})" if config else "") + f" split {split!r}"
        raise TaskError(f"task {task}: cannot load {where} from the HF hub: {_reason(err)}; "
                        f"for an offline run add data=local (the copies under data_dir, e.g. ../shared/data) or set "
                        f"task.{key}=PATH.jsonl{field_note}") from err


def check_records(task: str, records: list[dict], fields: tuple[str, ...], source: str, key: str) -> None:
    """Every record has every field, non-null: else name the first bad record."""
    for index, record in enumerate(records):
        missing = [f for f in fields if record.get(f) is None]
        if missing:
            raise TaskError(f"task {task}: record {index} of {source} has no {', '.join(missing)} "
                            f"(fields needed: {', '.join(fields)}); fix the file or point task.{key}= "
                            "at another")


@dataclass(kw_only=True)
class HubTaskConfig(TaskConfig):
    hub_id: str | None = key(None, "the HF dataset (null: the task's own)")
    hub_config: str | None = key(None, "its configuration")
    split: str | None = key(None, "the split evaluated (null: the task's own, test)")


def n_shot_key(default: int) -> int:
    """`n_shot`, whose default is each task's own (GSM8K: 5, CNN/DM: 1)."""
    return key(default, "exemplars before each question", ge=0)


@dataclass(kw_only=True)
class FewShotConfig(HubTaskConfig):
    n_shot: int = n_shot_key(0)
    shot_seed: int = key(42, "the exemplars' own draw")
    shots_split: str = key("train", "the hub split the exemplars come from")
    shots_files: str | list[str] | None = key(None, "local exemplars (JSONL) instead of the hub's")


class HubTask(Task):
    """Loads `split` of `hub_id`/`hub_config`, or `data_files`; subclasses turn one record into a Sample."""

    config = HubTaskConfig

    hub_id: str = ""
    hub_config: str | None = None
    split: str = "test"
    fields: tuple[str, ...] = ()  # what every record must have

    def __init__(self, hub_id: str | None = None, hub_config: str | None = None, split: str | None = None,
                 **kwargs: Any):
        super().__init__(**kwargs)
        self.hub_id = hub_id or type(self).hub_id
        self.hub_config = hub_config if hub_config is not None else type(self).hub_config
        self.split = split or type(self).split
        self._records: list[dict] | None = None

    def source(self) -> str:
        return f"task.data_files={_describe(_files(self.data_files))}" if self.data_files else \
            f"hub {self.hub_id!r} split {self.split!r}"

    def records(self) -> list[dict]:
        if self._records is None:  # read once per task object: select() may be called repeatedly
            data = load_records(self.name, self.data_files, (self.hub_id, self.hub_config, self.split),
                                "data_files", self.fields)
            records = data.to_list()
            check_records(self.name, records, self.fields, self.source(), "data_files")
            self._records = records
        return self._records

    def load(self) -> list[Sample]:
        return [self.make_sample(i, r) for i, r in enumerate(self.records())]

    def make_sample(self, index: int, record: dict) -> Sample:
        raise NotImplementedError

    @staticmethod
    def record_id(index: int, record: dict) -> str:
        """The dataset's own id when it has one (CNN/DM, XSum), else the record's position in the split."""
        return str(record["id"]) if record.get("id") is not None else str(index)


class FewShotTask(HubTask):
    """A HubTask whose prompt starts with `n_shot` exemplars: the `shots_split` of the same hub dataset, or
    `shots_files`, shuffled with `shot_seed` and the first `n_shot` taken — LayerSkip's
    `.shuffle(seed=42).select(range(n_shot))`, so hub runs get the authors' exemplars. The shot RNG is its own:
    the run's sample-selection seed does not move the shots."""

    config = FewShotConfig
    shot_fields: tuple[str, ...] = ()
    shot_key: str = ""  # the field that identifies a record: a sample identical to a shot is dropped

    def __init__(self, n_shot: int = 0, shot_seed: int = 42, shots_split: str = "train",
                 shots_files: Any = None, **kwargs: Any):
        super().__init__(**kwargs)
        self.n_shot = int(n_shot)
        self.shot_seed = int(shot_seed)
        self.shots_split = shots_split
        self.shots_files = shots_files
        self._shots: list[dict] | None = None

    def shots(self) -> list[dict]:
        if self._shots is None:
            self._shots = self._draw_shots() if self.n_shot > 0 else []
        return self._shots

    def _draw_shots(self) -> list[dict]:
        pool = load_records(self.name, self.shots_files, (self.hub_id, self.hub_config, self.shots_split),
                            "shots_files", self.shot_fields)
        if len(pool) < self.n_shot:
            raise TaskError(f"task {self.name}: needs {self.n_shot} shots but the shot source has "
                            f"{len(pool)} records; point task.shots_files= at a larger file")
        # keep_in_memory: no indices cache file written next to the data for a 1-row selection
        chosen = pool.shuffle(seed=self.shot_seed, keep_in_memory=True).select(range(self.n_shot)).to_list()
        source = f"task.shots_files={_describe(_files(self.shots_files))}" if self.shots_files else \
            f"hub {self.hub_id!r} split {self.shots_split!r}"
        check_records(self.name, chosen, self.shot_fields, source, "shots_files")
        return chosen

    def load(self) -> list[Sample]:
        # Offline, the shots may come from the evaluation file itself (CNN/DM has no train file here):
        # a sample whose record is a shot would see its own reference, so it is left out.
        records = self.records()  # first: a bad evaluation file is reported before any shot source
        taken = {s[self.shot_key] for s in self.shots()} if self.shot_key else set()
        return [self.make_sample(i, r) for i, r in enumerate(records)
                if not (self.shot_key and r[self.shot_key] in taken)]
