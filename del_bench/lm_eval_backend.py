"""del-bench as an lm-evaluation-harness model: `--model del_bench` (lm-eval 0.4.x, the optional extra `lm-eval`).

    python -m del_bench lm-eval --model_args model=testbed,method=ls --tasks gsm8k_local --limit 5

`--model_args` are Hydra overrides of configs/run.yaml: the model and method groups and their keys
(`model=testbed,method=ls,method.exit_layer=4`), seed, threads, layers, products, compile, warmup_tokens,
records_root, data_dir; where the model runs is `model.device=…` there (lm-eval's --device is not read: its command
line always sends one, cuda:0 by default). How to decode is lm-eval's to say (a task's generation_kwargs,
`--gen_kwargs`), so `generation.*`, `max_new_tokens`, `limit`, `task` and `out_dir` are refused there.

generate_until   Each lm-eval task's generation requests are one del-bench run, made by the runner as any run is
                 (runner.run: untimed warm-up, records, summary, resume): samples.jsonl, rounds.jsonl and summary.json
                 in <records_root>/lm_eval/<model>/<task>/<method tag>/<decoding>-max<N>-seed<S>, with task = the
                 lm-eval task's name, task_version = "lm-eval <version>", sample id = the request's doc_id (".<idx>"
                 added where a document makes several requests: the document's index in its split, or under --samples
                 its position among those chosen), repeat = which of its `repeats`, prompt = the request's context
                 verbatim. Greedy, or speculative sampling when the request's gen_kwargs sample (do_sample,
                 temperature, top_p; anything else is refused); `until` are the run's stop strings and the text handed
                 back is cut at the first of them, as lm-eval's HF backend cuts it; at most `max_gen_toks` new tokens
                 (lm-eval's default 256). Rerun with the same settings, an interrupted run resumes: finished
                 generations are read back from samples.jsonl, never decoded twice or duplicated, and a request whose
                 prompt differs from the one recorded under its id is refused (RunConflict).
loglikelihood,   The full model: all L layers of the LayerStack over context + continuation (Vanilla's prefill),
loglikelihood_   batch 1, with lm-eval's tokenisation and windows (TemplateLM, get_rolling_token_windows). A draft never
rolling          changes a likelihood — speculative decoding only changes how tokens are generated, never the model's
                 distribution — so every method gives these the same scores.

lm-eval 0.4.x finds a model by name in its own registry only (it reads no entry points), so `--model del_bench` works
where this module was imported: `python -m del_bench lm-eval …` (lm-eval's own CLI after the import, then `link`) or,
in Python, `import del_bench.lm_eval_backend` before `lm_eval.simple_evaluate(model="del_bench", …)` and
`link(results)`. lm-eval's results name our run directories (config.del_bench.runs: get_model_info) and `link` puts
the results file, lm-eval's metrics and its per-document scores into those runs' records.
"""

from __future__ import annotations

import copy
import json
import logging
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import lm_eval
import lm_eval.models  # noqa: F401  lm-eval's own backends first: its get_model imports them only into an empty registry
import torch
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import normalize_gen_kwargs, postprocess_generated_text
from lm_eval.utils import get_rolling_token_windows, hash_string, make_disjoint_window
from omegaconf import DictConfig, OmegaConf, open_dict
from tqdm import tqdm

from del_bench import jobs, session
from del_bench.config import compose_checked, validate
from del_bench.errors import ConfigError, RunConflict
from del_bench.lm_eval_tasks import TASKS_DIR
from del_bench.numerics import widened
from del_bench.records import RunDir, key_of, read_jsonl, write_json
from del_bench.tasks.base import Sample, Task

log = logging.getLogger(__name__)

# run.yaml keys lm-eval decides, with what to use instead
REFUSED = {
    "generation": "lm-eval's gen_kwargs decide how to decode (the task's generation_kwargs, or --gen_kwargs)",
    "max_new_tokens": "lm-eval's max_gen_toks is the limit (the task's, or --gen_kwargs max_gen_toks=N)",
    "limit": "use lm-eval's --limit",
    "task": "use lm-eval's --tasks",
    "out_dir": "each lm-eval task gets its own run directory under records_root (set records_root=)",
}
SAMPLING_KEYS = {"until", "max_gen_toks", "do_sample", "temperature", "top_p"}  # what our engine can honour
DEFAULT_MAX_GEN_TOKS = 256  # lm-eval's HF backend's default
DEFAULT_OUTPUT = "results/runs/lm_eval/results"  # `python -m del_bench lm-eval`'s --output_path unless given


def compose(model_args: dict[str, Any]) -> DictConfig:
    """configs/run.yaml with `model_args` as Hydra overrides, checked as `run` checks them (ConfigError)."""
    overrides = []
    for key, value in model_args.items():
        refused = REFUSED.get(key.lstrip("+~").split(".")[0])
        if refused:
            raise ConfigError(f"--model_args {key}=…: {refused}")
        overrides.append(f"{key}={_hydra_value(value)}")
    try:
        return compose_checked("run", overrides)
    except ConfigError as err:
        raise ConfigError(f"--model_args {','.join(overrides)}: {err}") from None


def _hydra_value(value: Any) -> str:
    """lm-eval parses model_args values (true → True, 4 → 4); Hydra reads them back from these strings."""
    if isinstance(value, bool):
        return str(value).lower()
    return "null" if value is None else str(value)


class LmEvalTask(Task):
    """An lm-eval task's generation requests as a del-bench task: one Sample per request (id: doc_id, plus ".<idx>"
    where a document makes several requests), its prompt lm-eval's context verbatim. lm-eval scores the outputs, so
    `score` is empty until `link` brings lm-eval's per-document scores into the records."""

    def __init__(self, name: str, samples: list[Sample], stop_strings: list[str]):
        super().__init__(name=name, stop_strings=stop_strings)
        self.version = f"lm-eval {lm_eval.__version__}"  # prompt_digest tells apart what the task's prompts were
        self.samples = samples

    def load(self) -> list[Sample]:
        return list(self.samples)


def request_keys(requests: list) -> list[tuple[str, int]]:
    """(sample_id, repeat) of each request, in order: lm-eval lists a request `repeats` times, once per output."""
    seen: Counter = Counter()
    keys = []
    for request in requests:
        sample_id = str(request.doc_id) if not request.idx else f"{request.doc_id}.{request.idx}"
        keys.append((sample_id, seen[sample_id]))
        seen[sample_id] += 1
    return keys


@register_model("del_bench")
class DelBenchLM(TemplateLM):
    """lm-eval's model interface over del-bench: generate_until through our engine (any method), the likelihoods
    through the full model. Batch 1 (lm-eval's --batch_size must be 1)."""

    def __init__(self, batch_size: int | str = 1, max_batch_size: int | None = None, device: str | None = None,
                 trust_remote_code: bool | None = None, **model_args: Any):
        super().__init__()
        if str(batch_size) != "1":
            raise ConfigError(f"--batch_size {batch_size}: del_bench decodes one request at a time (batch 1, as "
                              "speculative decoding is measured); leave --batch_size out")
        # max_batch_size, device and trust_remote_code are lm-eval's to send and unused: batch 1; the model config says
        # where the model runs (model.device=… in model_args; lm-eval's command line always sends a device, cuda:0 by
        # default); our loaders run no remote code
        self.cfg = compose(model_args)
        self._model = None  # (Loaded, LayerStack), loaded on first use: a run that only resumes never loads it
        self._device = self.cfg.model.get("device", "cpu")
        self.max_gen_toks = DEFAULT_MAX_GEN_TOKS
        self.runs: dict[str, str] = {}  # lm-eval task → the run directory of its generations
        self._cache = None  # the KV cache the likelihood passes reuse
        self._truncated = 0

    def _load(self):
        """(Loaded, LayerStack), loaded once: the one piece of decoding setup here (threads, model, LayerStack);
        everything else — method, costs, sampling, stop strings, engine, graph-captured steps, warm-up — is the
        runner's (runner.run → session.build), as for any run."""
        if self._model is None:
            if self.cfg.threads:
                torch.set_num_threads(int(self.cfg.threads))
            self._model = session.loader(self.cfg)()
        return self._model

    @property
    def loaded(self):
        return self._load()[0]

    @property
    def stack(self):
        return self._load()[1]

    @property
    def tokenizer(self):
        return self.loaded.tokenizer

    # ---- what lm-eval reads about the model -------------------------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        """What an empty context conditions on (lm-eval's HF backend: BOS, else EOS)."""
        bos = self.tokenizer.bos_token_id
        return bos if bos is not None else self.eot_token_id

    @property
    def max_length(self) -> int:
        return int(getattr(self.loaded.model.config, "max_position_embeddings", None) or 2048)

    @property
    def tokenizer_name(self) -> str:
        return str(self.tokenizer.name_or_path).replace("/", "__")

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **_: Any) -> list[int]:
        """The tokenizer's own default (as our runner tokenizes prompts, and lm-eval's HF backend by default)."""
        options = {} if add_special_tokens is None else {"add_special_tokens": add_special_tokens}
        return list(self.tokenizer(string, **options)["input_ids"])

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        return self.tokenizer.apply_chat_template(chat_history, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt,
                                                  continue_final_message=not add_generation_prompt)

    def get_model_info(self) -> dict:
        """Merged into lm-eval's results["config"]: which del-bench runs hold this evaluation's generations."""
        return {"del_bench": {"model": self.cfg.model.name, "method_tag": self.cfg.method.tag, "runs": dict(self.runs)}}

    # ---- generation: our engine, our records ------------------------------------------------------------------
    def generate_until(self, requests: list, disable_tqdm: bool = False) -> list[str]:
        by_task: dict[str, list[int]] = {}
        for i, request in enumerate(requests):
            by_task.setdefault(request.task_name, []).append(i)
        texts = [""] * len(requests)
        for task, positions in by_task.items():
            for i, text in zip(positions, self._generate_task(task, [requests[i] for i in positions])):
                texts[i] = text
                self.cache_hook.add_partial("generate_until", requests[i].args, text)
        return texts

    def _generate_task(self, task: str, requests: list) -> list[str]:
        """One lm-eval task's requests as one run (resumed where its records already hold some); the texts handed
        back, in request order, cut at the task's `until`."""
        settings = self._settings(task, requests)
        keys = request_keys(requests)
        repeats = Counter(sample_id for sample_id, _ in keys)
        if len(set(repeats.values())) != 1:
            raise ConfigError(f"lm-eval task {task}: its documents ask for different numbers of repeats")
        prompts = {sample_id: request.args[0] for (sample_id, _), request in zip(keys, requests)}
        cfg = self._run_config(task, settings, len(prompts), next(iter(repeats.values())))
        run_dir = RunDir(cfg.out_dir)
        try:
            run_dir.claim(OmegaConf.to_container(cfg, resolve=True))
        except RunConflict as err:  # its way out names out_dir, which lm-eval's model_args leave to records_root
            raise RunConflict(f"{err} (here: another records_root=)") from err
        _check_prompts(run_dir, prompts)
        samples = [Sample(id=sample_id, prompt=prompt) for sample_id, prompt in prompts.items()]
        lm_task = LmEvalTask(task, samples, list(settings["until"]))
        jobs.run_once(cfg, load=self._load, task=lm_task)
        self.runs[task] = str(run_dir.path)
        outputs = {key_of(r): r["output_text"] for r in run_dir.finished()}
        return [postprocess_generated_text(outputs[key], settings["until"], None) for key in keys]

    def _settings(self, task: str, requests: list) -> dict:
        """The task's generation settings, lm-eval's normalisation of its gen_kwargs (one set per task)."""
        settings = normalize_gen_kwargs(requests[0].args[1], self.max_gen_toks)
        if any(normalize_gen_kwargs(r.args[1], self.max_gen_toks) != settings for r in requests):
            raise ConfigError(f"lm-eval task {task}: its requests ask for different generation settings; a run "
                              "decodes with one")
        unknown = sorted(set(settings) - SAMPLING_KEYS)
        if unknown:
            raise ConfigError(f"lm-eval task {task}: gen_kwargs {', '.join(unknown)} cannot be honoured (our engine "
                              f"takes {', '.join(sorted(SAMPLING_KEYS))})")
        return settings

    def _run_config(self, task: str, settings: dict, count: int, repeats: int) -> DictConfig:
        """The run config of one lm-eval task: ours with the task, decoding and length lm-eval asked for, in
        <records_root>/lm_eval/… (the path `run` would give it, under lm_eval/)."""
        cfg = copy.deepcopy(self.cfg)
        sampled = bool(settings["do_sample"])
        with open_dict(cfg):
            cfg.task = {"name": task, "stop_strings": list(settings["until"]), "samples_per_prompt": repeats,
                        "lm_eval": {"version": lm_eval.__version__, "gen_kwargs": dict(settings)}}
            cfg.generation = {"do_sample": sampled, "temperature": float(settings["temperature"]) if sampled else 1.0,
                              "top_p": float(settings.get("top_p", 1.0)) if sampled else 1.0}
            cfg.max_new_tokens = int(settings["max_gen_toks"])
            cfg.limit = count  # every request (and summary.json's selection says how many)
            root = Path(cfg.scale.root)
            cfg.out_dir = str(root / "lm_eval" / Path(cfg.out_dir).relative_to(root))
        validate(cfg)
        return cfg

    # ---- likelihoods: the full model --------------------------------------------------------------------------
    @torch.inference_mode()
    def _loglikelihood_tokens(self, requests: list, disable_tqdm: bool = False, **_: Any) -> list[tuple[float, bool]]:
        """(log P(continuation | context), whether greedy decoding gives the continuation) per request
        ((context, continuation) or None, context ids, continuation ids), each through all L layers."""
        out = []
        for request, context_ids, continuation_ids in tqdm(requests, disable=disable_tqdm, desc="loglikelihood"):
            answer = self._score(context_ids, continuation_ids)
            out.append(answer)
            if request is not None:  # rolling windows come without one
                self.cache_hook.add_partial("loglikelihood", request, answer)
        return out

    def _score(self, context_ids: list[int], continuation_ids: list[int]) -> tuple[float, bool]:
        """One request: the continuation's log-probability and whether it is the greedy one (lm-eval's HF backend's
        semantics, its left truncation included)."""
        if not continuation_ids:  # nothing to predict (an empty context's continuation can be its prefix token alone)
            return 0.0, True
        ids = context_ids + continuation_ids
        if len(ids) > self.max_length + 1:  # lm-eval's HF backend: keep the newest max_length tokens
            self._truncated += 1
            log.warning("a likelihood request of %d tokens exceeds the model's %d: its context is cut from the left "
                        "(%d so far)", len(ids), self.max_length, self._truncated)
        inputs = ids[-(self.max_length + 1):][:-1]  # the last continuation token is predicted, never fed
        n = len(continuation_ids)
        logits = self._logits(inputs)[-n:]  # [n, V]: the rows predicting the continuation
        logprobs = torch.log_softmax(widened(logits), dim=-1)  # [n, V]
        target = torch.tensor(continuation_ids, device=logprobs.device)  # [n]
        chosen = logprobs.gather(-1, target[:, None])[:, 0]  # [n]
        return float(chosen.sum()), bool((logprobs.argmax(-1) == target).all())

    def _logits(self, ids: list[int]) -> torch.Tensor:
        """ids [T] through all L layers of the LayerStack (as Vanilla's prefill) → logits [T, V]."""
        st = self.stack
        if self._cache is None or self._cache.max_len < len(ids):
            self._cache = st.new_cache(max(len(ids), self.max_length))
        self._cache.crop(0)
        tokens = torch.tensor([ids], device=st.embed_weight.device)  # [1, T]
        h = st.forward_layers(st.embed(tokens), 0, st.num_layers, 0, self._cache)  # [1, T, D]
        return st.logits(h)[0]  # [T, V]

    def loglikelihood_rolling(self, requests: list, disable_tqdm: bool = False) -> list[float]:
        """log P(text) of each whole text, in lm-eval's disjoint windows of at most max_length tokens (the first
        conditioned on prefix_token_id), summed."""
        totals = []
        for (text,) in tqdm([r.args for r in requests], disable=disable_tqdm, desc="loglikelihood_rolling"):
            windows = map(make_disjoint_window, get_rolling_token_windows(
                token_list=self.tok_encode(text), prefix_token=self.prefix_token_id, max_seq_len=self.max_length,
                context_len=1))
            total = sum(logprob for logprob, _ in self._loglikelihood_tokens(
                [(None, context, continuation) for context, continuation in windows], disable_tqdm=True))
            totals.append(total)
            self.cache_hook.add_partial("loglikelihood_rolling", (text,), total)
        return totals


def _check_prompts(run_dir: RunDir, prompts: dict[str, str]) -> None:
    """A resumed run must be asked the same prompts under the same ids (else its records answer other questions)."""
    for record in run_dir.finished():
        prompt = prompts.get(record["sample_id"])
        if prompt is not None and prompt != record["prompt"]:
            raise RunConflict(f"{run_dir.path}: lm-eval's request {record['sample_id']} now has another prompt than "
                              "the one recorded for it (another --num_fewshot, task version or data?); resume only "
                              "continues the same requests: set another records_root= or remove that directory")


# ---- lm-eval's results ↔ our records ------------------------------------------------------------------------------
def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def task_metrics(entry: dict) -> dict[str, float]:
    """A task's entry of lm-eval's results: its "metric,filter" numbers, without their stderr (nor sample_len)."""
    return {k: float(v) for k, v in entry.items() if "," in k and "_stderr" not in k and _number(v)}


def document_scores(samples: list[dict], key: str = "doc_id") -> dict[str, dict[str, float]]:
    """lm-eval's per-document scores ({doc_id or another field of the sample, e.g. prompt_hash: {"metric,filter":
    value}}) from its logged samples (one line per document and filter); metrics a corpus aggregates (chrf, bleu: the
    sample holds its pair of texts) have none."""
    out: dict[str, dict[str, float]] = {}
    for sample in samples:
        scores = {f"{m},{sample['filter']}": float(sample[m]) for m in sample.get("metrics", [])
                  if _number(sample.get(m))}
        out.setdefault(str(sample[key]), {}).update(scores)
    return out


def link(results: dict, results_file: str | Path | None = None) -> list[str]:
    """Point our runs at lm-eval's results (which name them already, config.del_bench.runs): each run's summary.json
    gets `lm_eval` (the results file, lm-eval's version and the task's metrics) and, as its `quality`, those metrics;
    each sample's `scores` become lm-eval's scores of its document where samples were logged (results["samples"],
    --log_samples). Returns the run directories updated."""
    runs = ((results.get("config") or {}).get("del_bench") or {}).get("runs") or {}
    linked = []
    for task, out_dir in runs.items():
        run_dir = RunDir(out_dir)
        metrics = task_metrics(results.get("results", {}).get(task, {}))
        # matched by prompt: a logged sample's doc_id is the document's index in the split, a request's (our sample
        # id) its position among the documents evaluated, which differ under --samples
        documents = document_scores((results.get("samples") or {}).get(task) or [], key="prompt_hash")
        if documents:
            run_dir.set_scores({key_of(r): {"scores": documents[hash_string(r["prompt"])]} for r in run_dir.finished()
                                if hash_string(r["prompt"]) in documents})
        summary = json.loads(run_dir.summary_path.read_text())
        summary["quality"] = metrics
        summary["lm_eval"] = {"results": str(results_file) if results_file else None,
                              "version": results.get("lm_eval_version") or lm_eval.__version__, "task": task,
                              "n_shot": (results.get("n-shot") or {}).get(task), "metrics": metrics,
                              "documents_scored": len(documents)}
        write_json(run_dir.summary_path, summary)
        linked.append(str(run_dir.path))
    return linked


def saved_results(output_path: str | Path, since: float) -> tuple[dict, Path] | None:
    """The newest results file lm-eval saved under output_path at or after `since` (a time.time()), with its logged
    samples (samples_<task>_<date>.jsonl beside it) as results["samples"]; None when there is none."""
    path = Path(output_path)
    found = path.parent.glob(f"{path.stem}_*.json") if path.suffix == ".json" else path.glob("*/results_*.json")
    fresh = [p for p in found if p.stat().st_mtime >= since]
    if not fresh:
        return None
    newest = max(fresh, key=lambda p: p.stat().st_mtime)
    return read_results(newest), newest


def read_results(path: str | Path) -> dict:
    """An lm-eval results file, with the samples it logged beside it (samples_<task>_<date>.jsonl: [] where none)
    as results["samples"]."""
    path = Path(path)
    results = json.loads(path.read_text())
    date = path.stem.rsplit("_", 1)[-1]
    results["samples"] = {task: read_jsonl(path.parent / f"samples_{task}_{date}.jsonl")
                          for task in results.get("results", {})}
    return results


# ---- python -m del_bench lm-eval --------------------------------------------------------------------------------
def _has(argv: list[str], *flags: str) -> bool:
    return any(a in flags or a.split("=", 1)[0] in flags for a in argv)


def _value(argv: list[str], *flags: str) -> str | None:
    for i, arg in enumerate(argv):
        name, eq, value = arg.partition("=")
        if name in flags:
            return value if eq else (argv[i + 1] if i + 1 < len(argv) else None)
    return None


def with_defaults(argv: list[str]) -> list[str]:
    """lm-eval's arguments with ours where they are missing: --include_path (this package's offline tasks; for `ls` and
    `validate` too), and to `run`: --model del_bench, --output_path results/runs/lm_eval/results and --log_samples (so
    the per-document scores reach our records)."""
    args = list(argv)
    if not _has(args, "--include_path"):  # `ls` and `validate` take it too
        args += ["--include_path", str(TASKS_DIR)]
    if args[0] in ("ls", "validate"):
        return args
    if not _has(args, "--model", "-M"):
        args += ["--model", "del_bench"]
    if not _has(args, "--output_path", "-o"):
        args += ["--output_path", DEFAULT_OUTPUT]
    if not _has(args, "--log_samples", "-s", "--predict_only", "-x"):
        args += ["--log_samples"]
    return args


def cli(argv: list[str]) -> int:
    """`python -m del_bench lm-eval ARGS`: lm-eval's own command line (`lm-eval run …`; `ls` and `validate` too)
    with `--model del_bench` registered and our defaults (with_defaults), then `link` of what it saved."""
    from lm_eval.__main__ import cli_evaluate

    args = with_defaults(argv)
    started = time.time()
    sys.argv = ["lm-eval", *args]
    cli_evaluate()
    if _value(args, "--model", "-M") != "del_bench" or args[0] in ("ls", "validate"):
        return 0
    output = _value(args, "--output_path", "-o")
    saved = saved_results(output, started)
    if saved is None:
        log.warning("no lm-eval results file under %s: our runs are not linked to one", output)
        return 0
    results, path = saved
    for run_dir in link(results, path):
        print(f"records: {run_dir} (linked to {path})")
    return 0
