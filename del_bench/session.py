"""One setup for every entry point that decodes: a run config → model, task, method and sampling, ready to decode.

    ready = build(cfg)  # or build(cfg, load, task=…, method=…, run_dir=…)
    gen = ready.engine.generate(prompt_ids, ready.method, max_new_tokens, seed)

`build` does, in this order and untimed (what each step cost goes into `Session.setup`, the line the runner appends
to a run's setup.jsonl):

1. the model and its LayerStack: `load()`, or the config's model on its layer loop and product layouts
   (`load_model`); a run resumed in `run_dir` decodes in the layouts its first session chose (`products_before`);
2. the task bound to the tokenizer; the model's eos ids and the task's stop strings;
3. the sampling: the run's generation settings with the task's own over them (HumanEval pass@10 samples at T 0.6);
4. the engine: ours (`Engine`), or a peer's decoder where the method decodes by itself (methods/peers.py);
5. measured costs for a method that wants them (`Method.wants_costs`): those `run_dir` holds, else measured here;
6. the layer path (engine/path_choice.choose): the graph-captured steps `compile` asks for (auto | on | off,
   engine/compiled.py), made and checked here — CUDA graphs on a cache long enough for the longest of `samples`'
   prompts + max_new_tokens, at batch_size B per (B, width bucket) — held by the engine (`Engine.path`).

The warm-up is not part of it: the runner warms up before its timed samples, as a step of its own (runner.warm_up).
Entry points: runner.decode_all (every run), bench-engine's host-sync rows, bench-controller's twins; calibration and
the benches load a model once for many runs with `loader`; train-exits takes `eos_ids`.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Callable

from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from del_bench.engine import path_choice
from del_bench.engine.costs import measure_costs
from del_bench.engine.decode import Engine
from del_bench.engine.sampling import Sampling
from del_bench.errors import ConfigError
from del_bench.models import exit_adapters, loading, synthetic
from del_bench.models.layer_stack import LayerStack
from del_bench.models.products import Products
from del_bench.records import RunDir, cost_units
from del_bench.selection import calibration_samples, select_samples

log = logging.getLogger(__name__)

Load = Callable[[], tuple[loading.Loaded, LayerStack]]


@dataclass
class Session:
    """Model, task, method and sampling ready to decode: Engine.generate(prompt_ids, method, max_new_tokens, seed)."""

    loaded: loading.Loaded  # the model and its tokenizer
    stack: LayerStack  # the model as our engine runs it
    task: object  # a tasks.base.Task, bound to the tokenizer
    method: object  # a methods.base.Method, its measured costs set
    sampling: Sampling
    eos: set[int]
    stop: Callable | None  # the task's stop strings as a condition on the output ids (None: none)
    engine: object  # Engine (its layer path: Engine.path), or a peer's decoder (methods/peers.py PeerDecoder)
    costs: dict | None = None  # the measured costs the method was given (None: it wants none)
    setup: dict = field(default_factory=dict)  # what the setup chose and the seconds it took (setup.jsonl's line)

    @property
    def tokenizer(self):
        return self.loaded.tokenizer


def load_model(model_cfg, layers: str = "auto", products: str = "auto",
               calibration_texts: list[str] | None = None) -> tuple[loading.Loaded, LayerStack]:
    """The model and its LayerStack; layers: the decoder-layer loop (auto | fused | eager: models/fused.py); products:
    the matrix products' layout (auto | wt_x | x_wt: models/products.py); calibration_texts: a synthetic model's
    (calibration_texts)."""
    loaded = loading.load(model_cfg, calibration_texts)
    stack = path_choice.stack_of(loaded.model, layers=layers, products=products)
    exit_adapters.attach(stack, model_cfg)  # model.exit_adapters=D: the early-exit heads (else the own head)
    return loaded, stack


def loader(cfg: DictConfig, task=None) -> Load:
    """A zero-argument loader of the run config's model on its layer loop and product layouts (what `build` calls when
    given none; wrap it in functools.cache to load once for many runs). task: the run's Task where one is built
    already (a synthetic model calibrated on it draws its prompts there), else cfg.task's, built only if needed."""
    return lambda: load_model(cfg.model, cfg.layers, cfg.get("products", "auto"), calibration_texts(cfg, task))


def calibration_texts(cfg: DictConfig, task=None) -> list[str] | None:
    """What a synthetic model with model.calibrate_on=task calibrates on: the prompts (a multi-turn sample's first
    turn) of `model.calibration_prompts` records of the run's task outside its evaluation set (the draw of `calibrate`,
    seeded by the model's seed, so that a task's runs share one model) — where every record is evaluated (WMT14's
    local 1,000), a draw that meets the run's own prompts is made again without them; None: random text (or no
    synthetic model). calibrate_on=run: the prompts of the run's own selection (a multi-turn sample's first turn).
    task: the run's Task if built (None: cfg.task's, instantiated here)."""
    mode = cfg.model.get("calibrate_on", "random")
    if cfg.model.get("source") != "synthetic" or mode == "random":
        return None
    if mode == "run" and cfg.get("sample_set", "eval") != "eval":
        raise ConfigError("model.calibrate_on=run calibrates on an evaluation selection (limit, seed); `calibrate`'s "
                          "grid decodes calibration samples: use calibrate_on=task there")
    task = instantiate(cfg.task) if task is None else task
    own = select_samples(task, cfg)
    if mode == "run":  # the run's own prompts, as it decodes them: the agreement asked is the one it meets
        samples = own
    else:  # the task's calibration draw, never the run's own prompts
        samples = calibration_samples(task, int(cfg.model.calibration_prompts), int(cfg.model.get("seed", 0)), None,
                                      frozenset(s.id for s in own))
    return [s.prompt if s.turns is None else s.turns[0] for s in samples]


def prompt_ids(samples, task, tokenizer) -> list[list[int]]:
    """The ids each sample's first prompt is decoded from (a multi-turn sample: its first turn rendered)."""
    return [list(tokenizer(s.prompt if s.turns is None else task.render(s, []))["input_ids"]) for s in samples]


def eos_ids(model, tokenizer) -> set[int]:
    """The token ids that end an output: the model's generation config's eos ids and the tokenizer's."""
    ids = model.generation_config.eos_token_id
    ids = set(ids if isinstance(ids, list) else [ids] if ids is not None else [])
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(tokenizer.eos_token_id)
    return ids


def stop_strings(strings: list[str], tokenizer, tail_tokens: int = 16):
    """A stop condition for the engine: the decoded tail of the output contains one of `strings`.

    Only the last `tail_tokens` are decoded per check (stop strings are short; the check runs after
    every emitted token, so a string is caught the moment it completes)."""
    if not strings:
        return None

    def stop(output_ids: list[int]) -> bool:
        tail = tokenizer.decode(output_ids[-tail_tokens:], skip_special_tokens=True)
        return any(s in tail for s in strings)

    return stop


def sampling_of(cfg: DictConfig) -> Sampling:
    """The run's sampling: its generation settings, the task's own over them (a task may fix its decoding: HumanEval
    pass@10 samples at T = 0.6)."""
    generation = OmegaConf.to_container(cfg.generation, resolve=True)
    if cfg.task.get("generation"):
        generation.update(OmegaConf.to_container(cfg.task.generation, resolve=True))
    return Sampling(**generation)


def products_before(run_dir: RunDir, setting: str) -> Products | None:
    """The product layouts the first earlier session of this run chose under the same `products` setting (its setup
    line), or None: a fresh run, or one whose setting changed."""
    for line in run_dir.setup():
        recorded = line.get("products")
        if recorded and recorded["setting"] == setting:
            return Products.of(recorded)
    return None


def build(cfg: DictConfig, load: Load | None = None, *, task=None, method=None, run_dir: RunDir | None = None,
          shadow_with_acceptance: bool | None = None, samples=()) -> Session:
    """The run config's model, task, method and sampling, ready to decode (the module docstring: every step).

    cfg: a run config, validated (config.validate); load: () → (Loaded, LayerStack), e.g. a loader shared by many
    runs (None: `loader(cfg)`); task, method: instances to use (None: instantiated from cfg.task, cfg.method);
    run_dir: the run's directory, whose first session's product layouts and measured costs are reused (None: fresh);
    shadow_with_acceptance: the Engine's (None: as the device decides); samples: the samples it will decode (their
    longest prompt sizes the graphs' cache; none: 1,024 slots)."""
    task = instantiate(cfg.task) if task is None else task
    method = instantiate(cfg.method) if method is None else method
    t0 = time.perf_counter()
    loaded, stack = (load or loader(cfg, task))()
    setting = cfg.get("products", "auto")
    earlier = products_before(run_dir, setting) if run_dir is not None else None
    if earlier is not None:  # a resume decodes in its first session's layouts: one run, one layout's bits
        stack.use_products(earlier)
    setup = {"layer_path": stack.layer_path, "load_s": time.perf_counter() - t0, "layer_setup_s": stack.layer_setup_s,
             # the layouts chosen, and under auto the timings behind them (or an earlier session's, reused)
             "products": stack.products.as_dict(), "products_reused": earlier is not None}
    if getattr(loaded.model, "synthetic", None):  # a synthetic model's calibration: the agreement it reached by layer
        setup["synthetic"] = loaded.model.synthetic
    log.info("decoder layers: %s (built and checked in %.1f s)", stack.layer_path, stack.layer_setup_s)
    log.info("matrix products: %s (products=%s, timed in %.1f s)", stack.products.summary(), stack.products.setting,
             stack.products.setup_s)
    task.bind_tokenizer(loaded.tokenizer)  # multi-turn tasks render chat turns with it
    if samples and getattr(loaded.model, "synthetic", None):  # what the run's own prompts meet, beside calibration's
        tokens = int(cfg.model.get("calibration_tokens", 32))
        on_run = synthetic.agreement_on(loaded.model, prompt_ids(samples, task, loaded.tokenizer), tokens)
        setup["synthetic"] = {**loaded.model.synthetic, "on_run_prompts": on_run}
    eos, stop = eos_ids(loaded.model, loaded.tokenizer), stop_strings(task.stop_strings, loaded.tokenizer)
    sampling = sampling_of(cfg)
    peer = getattr(method, "decoder", None)  # a peer row (del_bench/methods/peers.py): transformers decodes, not ours
    engine = (peer(loaded.model, eos, stop, sampling) if peer
              else Engine(stack, sampling, eos, stop=stop, shadow_with_acceptance=shadow_with_acceptance))
    if not peer and method.wants_shadow:  # where DEL's statistics reach the host (engine/shadow.py)
        setup["shadow_with_acceptance"] = engine.shadow_with_acceptance
    if not peer:  # the layer path, graphs made and checked here (compile: auto | on | off), untimed
        reach = longest_sequence(samples, task, loaded.tokenizer, int(cfg.max_new_tokens)) + 1 if samples else 1024
        engine.path = path_choice.choose(stack, cfg.get("compile", "auto"), method, int(cfg.max_new_tokens), reach,
                                        int(cfg.get("batch_size", 1)))
        setup.update(engine.path.info)
    t0 = time.perf_counter()  # after the graphs: the costs are timed on the path that decodes
    costs, measured = measured_costs(method, engine, run_dir)  # a peer wants none: nothing measured
    setup["costs_s"] = time.perf_counter() - t0
    if costs is not None:
        setup.update(costs_device=costs["device"], costs_measured=measured)
    return Session(loaded, stack, task, method, sampling, eos, stop, engine, costs, setup)


def longest_sequence(samples, task, tokenizer, max_new_tokens: int) -> int:
    """The longest sequence the samples reach: a prompt + max_new_tokens; a multi-turn sample, at most its last turn
    rendered with empty answers + max_new_tokens a turn (the graphs' cache, the steady warm-up's reach)."""
    reach = 0
    for s in samples:
        last = s.prompt if s.turns is None else task.render(s, [(u, "") for u in s.turns[:-1]])
        reach = max(reach, len(tokenizer(last)["input_ids"]) + max_new_tokens * len(s.turns or [None]))
    return reach


def measured_costs(method, engine: Engine, run_dir: RunDir | None) -> tuple[dict | None, bool]:
    """(the calibrated cost model of a method that wants one, given to it (Method.set_costs), or None: it wants none;
    whether it was measured now). Measured once per run and device: the costs `run_dir` holds are reused where they
    were measured on this device (LayerStack.cost_device) and hold what the method needs (sublayer timings). Costs
    from another device (or from before costs.json named one) are never reused: a resume there measures again and
    says so."""
    if not method.wants_costs:
        return None, False
    costs, here = run_dir.costs() if run_dir is not None else None, engine.stack.cost_device()
    if costs is not None and costs.get("device") != here:
        log.warning("%s: costs.json was measured on %s, this session runs on %s: measuring them again", run_dir.path,
                    costs.get("device") or "an unrecorded device", here)
        costs = None
    measured = costs is None or bool(method.latency_contexts and "sublayer_s" not in costs)
    if measured:
        costs = measure_costs(engine, contexts=method.latency_contexts)
    method.set_costs(**cost_units(costs))
    return costs, measured
