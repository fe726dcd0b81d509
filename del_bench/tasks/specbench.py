"""Spec-Bench: the speculative-decoding field's benchmark (Xia et al., 2024), 480 questions in 13 categories.

`task=specbench` reads Spec-Bench's own question file (data/spec_bench/question.jsonl: `question_id`, `category`,
`turns`, optional `reference`); `task.data_files=` points at a user's copy. One sample per question, id =
str(question_id). The 80 MT-bench questions have two turns: the second is asked after the model's own first
answer, as Spec-Bench does, so the task cannot precompute that prompt. It gives the runner the user turns
(`Sample.turns`) and `render(sample, history)`, the prompt text of the next turn given [(user, answer), …]; the
runner generates turn by turn, each turn a fresh generation over the whole rendered conversation (Spec-Bench
re-encodes the conversation every turn), with `max_new_tokens` per turn (Spec-Bench: 1024).

Rendering (`chat`): `auto` uses the tokenizer's chat template when it has one (SmolLM2-Instruct does) and
otherwise a plain "User: …\\nAssistant:" conversation (LayerSkip's base checkpoints have no template);
`template` / `plain` force one. What was used is recorded with every sample (`prompt_format`:
"chat_template:<digest of the template>" or "plain"). `system_prompt` (null = the template's own default)
is given as a system message. Spec-Bench scores speed only: no quality metric here.

Selection: `categories` (null = all 13; a list of category names, "mt_bench" meaning its 8), then
`per_category` (null = all; N = N questions per category, drawn with `seed`, kept in source order), then the
run's `limit` as for every task.
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from del_bench.errors import TaskError
from del_bench.schema import key
from del_bench.specbench import CATEGORIES, MT_BENCH
from del_bench.tasks.base import Sample, Task, TaskConfig

CHAT_MODES = ("auto", "template", "plain")


def plain_prompt(history: list[tuple[str, str]], user: str, system: str | None = None) -> str:
    """The fallback conversation for models without a chat template."""
    text = f"{system}\n\n" if system else ""
    for past, answer in history:
        text += f"User: {past}\nAssistant: {answer}\n"
    return text + f"User: {user}\nAssistant:"


@dataclass(kw_only=True)
class SpecBenchConfig(TaskConfig):
    categories: list[str] | None = key(None, f"null: all; some of {', '.join(CATEGORIES)} (mt_bench: its 8)")
    per_category: int | None = key(None, "questions per category (null: all)", ge=1)
    chat: Literal[CHAT_MODES] = key("auto", "auto: the chat template if the tokenizer has one; template | plain")
    system_prompt: str | None = key(None, "a system message (null: the template's default)")


class SpecBench(Task):
    name = "specbench"
    config = SpecBenchConfig
    version = "1"

    def __init__(self, categories=None, per_category: int | None = None, chat: str = "auto",
                 system_prompt: str | None = None, **kwargs):
        super().__init__(**kwargs)
        self.categories = self._categories(categories)
        if per_category is not None and (not isinstance(per_category, int) or per_category < 1):
            raise TaskError(f"task specbench: per_category={per_category!r} must be a positive integer or null")
        if chat not in CHAT_MODES:
            raise TaskError(f"task specbench: chat={chat!r}; choose one of {', '.join(CHAT_MODES)}")
        self.per_category = per_category
        self.chat = chat
        self.system_prompt = system_prompt
        self.tokenizer = None
        self.prompt_format: str | None = None

    @staticmethod
    def _categories(categories) -> tuple[str, ...]:
        if categories is None:
            return CATEGORIES
        names = [categories] if isinstance(categories, str) else list(categories)
        chosen: list[str] = []
        for name in names:
            expanded = MT_BENCH if name == "mt_bench" else (name,)
            unknown = [c for c in expanded if c not in CATEGORIES]
            if unknown:
                raise TaskError(f"task specbench: unknown category {name!r} in task.categories; choose from "
                                f"{', '.join(CATEGORIES)} (or mt_bench for its 8 categories)")
            chosen += [c for c in expanded if c not in chosen]
        if not chosen:
            raise TaskError("task specbench: task.categories is empty; leave it null for all 13 categories")
        return tuple(c for c in CATEGORIES if c in chosen)

    # ---------------------------------------------------------------- samples

    def load(self) -> list[Sample]:
        if not self.data_files:
            raise TaskError("task specbench: needs Spec-Bench's question file — add data=local (../shared/data) "
                            "or task.data_files=PATH/question.jsonl")
        path = Path(self.data_files)
        if not path.is_file():
            raise TaskError(f"task specbench: no such file {str(path)!r}; set task.data_files=PATH/question.jsonl "
                            "(or data=local with data_dir holding spec_bench/question.jsonl)")
        samples, seen = [], {}
        for line_no, line in enumerate(path.read_text().splitlines(), start=1):
            if not line.strip():
                continue
            where = f"task specbench: {path}:{line_no}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise TaskError(f"{where} is not JSON ({err})") from err
            if not isinstance(record, dict):
                raise TaskError(f"{where} is not a JSON object")
            qid, category, turns = record.get("question_id"), record.get("category"), record.get("turns")
            if qid is None or isinstance(qid, bool) or not isinstance(qid, (int, str)) or str(qid).strip() == "":
                raise TaskError(f"{where} has no question_id")
            if category not in CATEGORIES:
                raise TaskError(f"{where}: unknown category {category!r} (Spec-Bench's: {', '.join(CATEGORIES)})")
            if not isinstance(turns, list) or not turns or not all(isinstance(t, str) and t for t in turns):
                raise TaskError(f"{where}: missing turns (question {qid} needs \"turns\": a non-empty list of "
                                "non-empty strings)")
            if str(qid) in seen:
                raise TaskError(f"{where}: question_id {qid} repeats line {seen[str(qid)]}")
            seen[str(qid)] = line_no
            if category in self.categories:
                samples.append(Sample(id=str(qid), prompt=turns[0], reference=record.get("reference"),
                                      turns=list(turns), category=category))
        return samples

    def select(self, limit: int | None, seed: int) -> list[Sample]:
        samples = self.load()
        if self.per_category is not None:
            rng = random.Random(f"specbench:{seed}")
            keep: set[str] = set()
            for category in self.categories:
                ids = [s.id for s in samples if s.category == category]
                keep.update(rng.sample(ids, min(self.per_category, len(ids))))
            samples = [s for s in samples if s.id in keep]
        count = limit if limit is not None else self.n
        if count is None or count >= len(samples):
            return samples
        picked = sorted(random.Random(seed).sample(range(len(samples)), count))
        return [samples[i] for i in picked]

    # ---------------------------------------------------------------- prompts

    def bind_tokenizer(self, tokenizer) -> None:
        """Choose the rendering for this model's tokenizer (called by the runner before the first turn)."""
        template = getattr(tokenizer, "chat_template", None)
        if self.chat == "template" and not template:
            raise TaskError("task specbench: chat=template, but this model's tokenizer has no chat template; "
                            "use chat=auto or chat=plain")
        self.tokenizer = tokenizer
        if template and self.chat != "plain":
            self.prompt_format = f"chat_template:{hashlib.sha1(str(template).encode()).hexdigest()[:8]}"
        else:
            self.prompt_format = "plain"

    def render(self, sample: Sample, history: list[tuple[str, str]]) -> str:
        """The prompt text of turn len(history): the conversation so far (the model's own answers) + the next
        user turn, with the assistant's reply to come."""
        if self.prompt_format is None:
            raise RuntimeError("task specbench: render() before bind_tokenizer()")
        user = sample.turns[len(history)]
        if self.prompt_format == "plain":
            return plain_prompt(history, user, self.system_prompt)
        messages = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        for past, answer in history:
            messages += [{"role": "user", "content": past}, {"role": "assistant", "content": answer}]
        messages.append({"role": "user", "content": user})
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        bos = getattr(self.tokenizer, "bos_token", None)
        if bos and text.startswith(bos) and self._adds_bos():  # the tokenizer adds it again when encoding
            text = text[len(bos):]
        return text

    def _adds_bos(self) -> bool:
        bos_id = getattr(self.tokenizer, "bos_token_id", None)
        ids = self.tokenizer("x")["input_ids"]
        return bos_id is not None and len(ids) > 0 and ids[0] == bos_id
