"""The LayerSkip training loop: data → model (from scratch or continued from a HF Llama) → AdamW with warmup +
cosine LR → periodic validation of every exit → resumable checkpoints → a HF-format directory.

out_dir layout:
  config.json, model.safetensors (save_dtype), tokenizer files, generation_config.json   the trained model
  train_config.yaml    the resolved config plus corpus / environment facts
  train_log.jsonl      one line per logged train step and per validation ({"split": "train" | "val", ...})
  init_from/           with init_from= a checkpoint trained here: its train_config.yaml and train_log.jsonl
                       (and its own init_from/), so a continued model carries its whole training history
  work/                checkpoint.pt (+ the tokenised corpus): resumable state, not part of the model (.gitignore)

Re-running the same command resumes from work/checkpoint.pt; the batch and the exits of step s are functions of
s (see data.batch_indices, layerskip.enabled_exits) and the dropout RNG is checkpointed, so a resumed run
computes what an uninterrupted one would.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import shutil
import sys
import time
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from del_bench.errors import ConfigError
from del_bench.models.loading import REPO_ROOT
from del_bench.train import data as corpus
from del_bench.train.layerskip import (
    dropout_rates,
    enabled_exits,
    evaluate_exits,
    exit_weights,
    layerskip_loss,
    normalised_scales,
)

log = logging.getLogger("del_bench.train")

SAVE_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# A checkpoint may only be resumed by a run that trains the same thing; other keys (max_steps, stop_at, logging,
# threads) may change between invocations.
IDENTITY_KEYS = ("seed", "init_from", "model", "data", "batch_size", "seq_len", "layer_dropout", "early_exit", "optim")
# options added after checkpoints were written: left out of the identity at the value that means "as before", so
# those checkpoints still resume (and setting one to anything else is a different training)
ADDED_OPTIONS = {("early_exit", "distill"): 0.0, ("data", "val_seed"): None}


class TrainLog:
    """train_log.jsonl, appended line by line (flushed: a killed run keeps what it logged)."""

    def __init__(self, path: Path):
        self.path = path

    def keep_until(self, step: int) -> None:
        """Drop lines after `step`: a resumed run re-does them (step 0 = start afresh)."""
        lines = self.path.read_text().splitlines() if self.path.is_file() else []
        kept = [line for line in lines if line.strip() and json.loads(line)["step"] <= step]
        self.path.write_text("".join(line + "\n" for line in kept))

    def write(self, record: dict) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")


# ---- data and model -------------------------------------------------------------------------------------------
def resolve_source(name: str) -> str:
    """A local directory (as given, else relative to the repo root) or a hub id."""
    for path in (Path(name), REPO_ROOT / name):
        if path.is_dir():
            return str(path)
    return name


def prepare_data(cfg: DictConfig, work: Path):
    """→ (tokenizer, train tokens [N], val tokens [M], facts). The tokenizer (trained BPE, or init_from's own) and
    the tokenised corpus are cached in work/ under a key of everything they depend on."""
    from transformers import AutoTokenizer

    root = corpus.corpus_root(cfg.data.root)
    files = corpus.corpus_files(root, list(cfg.data.exclude_dirs), list(cfg.data.exclude_files))
    val_seed = corpus.val_seed(cfg)
    train_files, val_files = corpus.split_files(files, cfg.data.val_files, val_seed)
    fp = corpus.fingerprint(root, files)
    tok_source = resolve_source(cfg.init_from) if cfg.init_from else f"bpe-{cfg.data.vocab_size}"
    key = hashlib.sha1(f"{fp}:{cfg.data.val_files}:{val_seed}:{tok_source}".encode()).hexdigest()[:12]
    cache = work / f"data-{key}"
    if not (cache / "tokens.pt").is_file():
        log.info("tokenising %d train + %d val files from %s", len(train_files), len(val_files), root)
        if cfg.init_from:
            tokenizer = AutoTokenizer.from_pretrained(tok_source)
        else:
            tokenizer = corpus.train_tokenizer(train_files, cfg.data.vocab_size)
        tokens = {
            "train": corpus.encode_files(tokenizer, train_files),
            "val": corpus.encode_files(tokenizer, val_files),
        }
        tmp = cache.with_name(cache.name + ".tmp")
        tokenizer.save_pretrained(tmp)
        torch.save(tokens, tmp / "tokens.pt")
        tmp.rename(cache)  # atomic: an interrupted run never leaves a half-written cache
    tokenizer = AutoTokenizer.from_pretrained(cache)
    tokens = torch.load(cache / "tokens.pt", weights_only=True)
    facts = {
        "corpus_root": str(root),
        "corpus_fingerprint": fp,
        "train_files": len(train_files),
        "val_files": len(val_files),
        "train_tokens": tokens["train"].numel(),
        "val_tokens": tokens["val"].numel(),
    }
    return tokenizer, tokens["train"], tokens["val"], facts


def build_model(cfg: DictConfig, tokenizer):
    """From scratch: a Llama with a tied head sized by the config and the tokenizer. init_from: that checkpoint."""
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    if cfg.init_from:
        # sdpa: run_layers relies on its causal flag (see layerskip._check_attention)
        return AutoModelForCausalLM.from_pretrained(
            resolve_source(cfg.init_from), dtype=torch.float32, attn_implementation="sdpa"
        )
    m = cfg.model
    if m.hidden_size % m.num_heads or m.num_heads % m.num_kv_heads:
        raise ConfigError(
            f"model: hidden_size={m.hidden_size} must divide by num_heads={m.num_heads}, "
            f"and num_heads by num_kv_heads={m.num_kv_heads}"
        )
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=m.hidden_size,
        intermediate_size=m.intermediate_size,
        num_hidden_layers=m.num_layers,
        num_attention_heads=m.num_heads,
        num_key_value_heads=m.num_kv_heads,
        head_dim=m.hidden_size // m.num_heads,
        max_position_embeddings=m.max_position_embeddings,
        initializer_range=m.init_std,
        rope_parameters={"rope_type": "default", "rope_theta": float(m.rope_theta)},
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        attn_implementation="sdpa",
    )
    torch.manual_seed(cfg.seed)
    return LlamaForCausalLM(config)


# ---- optimisation ---------------------------------------------------------------------------------------------
def lr_factor(step: int, warmup: int, max_steps: int, min_ratio: float) -> float:
    """Linear warmup to 1 over `warmup` steps, then cosine down to min_ratio at max_steps (step is 0-based)."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min((step - warmup) / max(max_steps - warmup, 1), 1.0)
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def build_optimizer(cfg: DictConfig, model):
    """AdamW; weight decay on matrices only (norm gains stay undecayed, as in nanoGPT / Llama)."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.optim.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    o = cfg.optim
    opt = torch.optim.AdamW(groups, lr=o.lr, betas=tuple(o.betas))
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: lr_factor(s, o.warmup_steps, cfg.max_steps, o.min_lr_ratio)
    )
    return opt, sched


def identity(cfg: DictConfig) -> dict:
    out = {
        k: OmegaConf.to_container(cfg[k], resolve=True) if isinstance(cfg[k], DictConfig) else cfg[k]
        for k in IDENTITY_KEYS
    }
    for (section, key), as_before in ADDED_OPTIONS.items():
        if key in out[section] and out[section][key] == as_before:
            del out[section][key]
    return out


def save_checkpoint(path: Path, cfg, model, opt, sched, gen: torch.Generator, step: int) -> None:
    state = {
        "model": model.state_dict(),
        "optimizer": opt.state_dict(),
        "scheduler": sched.state_dict(),
        "rng": {"dropout": gen.get_state(), "torch": torch.get_rng_state()},
        "step": step,
        "samples_seen": step * cfg.batch_size,
        "identity": json.dumps(identity(cfg), sort_keys=True),
        "max_steps": cfg.max_steps,
    }
    tmp = path.with_name(path.name + ".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)  # atomic: a kill mid-save keeps the previous checkpoint


def load_checkpoint(path: Path, cfg, model, opt, sched, gen: torch.Generator) -> int:
    state = torch.load(path, weights_only=True)
    if state["identity"] != json.dumps(identity(cfg), sort_keys=True):
        raise ConfigError(
            f"{path} was written by a different training config (a key among {IDENTITY_KEYS} "
            "changed); use another out_dir or delete that checkpoint"
        )
    if state["max_steps"] != cfg.max_steps:
        log.warning(
            "max_steps changed from %d to %d: the LR schedule from step %d on follows the new length",
            state["max_steps"],
            cfg.max_steps,
            state["step"],
        )
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["optimizer"])
    sched.load_state_dict(state["scheduler"])
    gen.set_state(state["rng"]["dropout"])
    torch.set_rng_state(state["rng"]["torch"])
    return state["step"]


# ---- the loop -------------------------------------------------------------------------------------------------
def validation_batches(cfg: DictConfig, val_tokens: torch.Tensor):
    """The first eval_batches × batch_size validation sequences, in order (the same ones at every evaluation)."""
    n = min(corpus.num_sequences(val_tokens, cfg.seq_len), cfg.eval_batches * cfg.batch_size)
    if n < 1:
        raise ConfigError(
            f"the validation files hold under one sequence of {cfg.seq_len} tokens: "
            "raise data.val_files or lower seq_len"
        )
    return [
        corpus.sequences(val_tokens, list(range(i, min(i + cfg.batch_size, n))), cfg.seq_len)
        for i in range(0, n, cfg.batch_size)
    ]


def train_step(cfg, model, opt, sched, train_tokens, n_seq, weights, gen, step: int) -> dict:
    """One optimiser step at 0-based `step` → its train-log record."""
    t0 = time.perf_counter()
    num_layers = model.config.num_hidden_layers
    ids, labels = corpus.sequences(
        train_tokens, corpus.batch_indices(step, cfg.batch_size, n_seq, cfg.seed), cfg.seq_len
    )  # [B, T] each
    exits = enabled_exits(cfg.early_exit, num_layers, step, cfg.max_steps, cfg.seed)
    d = cfg.layer_dropout
    rates = dropout_rates(num_layers, d.p_max, d.scale, d.first_layer_zero, step, cfg.max_steps, d.time_scale)
    model.train()
    loss, ce = layerskip_loss(model, ids, labels, normalised_scales(exits, weights), rates, gen,
                              cfg.early_exit.distill)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip)
    lr = sched.get_last_lr()[0]
    opt.step()
    sched.step()
    # layers are 1-based in records (exit layer E ∈ [1, L−1], docs/design.md §2.1)
    return {
        "step": step + 1,
        "split": "train",
        "loss": loss.item(),
        "ce": {str(i + 1): v for i, v in ce.items()},
        "lr": lr,
        "grad_norm": float(grad_norm),
        "seconds": time.perf_counter() - t0,
    }


def export(cfg: DictConfig, model, tokenizer, out: Path) -> None:
    """The HF-format model in save_dtype (float16 keeps the testbed committable), with its tokenizer."""
    model.to(SAVE_DTYPES[cfg.save_dtype])
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def write_config(cfg: DictConfig, out: Path, facts: dict) -> None:
    import transformers

    facts = {
        **facts,
        "python": sys.version.split()[0],
        "torch": str(torch.__version__),
        "transformers": transformers.__version__,
    }
    flat = {**OmegaConf.to_container(cfg, resolve=True), "facts": facts}  # cfg is struct-locked under Hydra
    OmegaConf.save(OmegaConf.create(flat), out / "train_config.yaml")


def trained_parent(cfg: DictConfig) -> Path | None:
    """The directory init_from names when it holds a checkpoint trained here (its train_config.yaml); else None."""
    if not cfg.init_from:
        return None
    parent = Path(resolve_source(cfg.init_from))
    return parent if (parent / "train_config.yaml").is_file() else None


def parent_config(cfg: DictConfig) -> DictConfig | None:
    """The train_config.yaml of the checkpoint init_from names, when it was trained here (None otherwise)."""
    parent = trained_parent(cfg)
    return OmegaConf.load(parent / "train_config.yaml") if parent else None


def check_same_heldout_files(cfg: DictConfig) -> None:
    """Continuing a checkpoint trained here on the same corpus: hold out exactly its validation files. Another
    draw would train on the parent's held-out files and hold out files the parent trained on (its validation
    and the benches' held-out code prompts would leak)."""
    parent = parent_config(cfg)
    if parent is None or any(parent.data.get(k) != cfg.data.get(k) for k in ("root", "exclude_dirs", "exclude_files")):
        return
    theirs, ours = (corpus.val_seed(parent), parent.data.val_files), (corpus.val_seed(cfg), cfg.data.val_files)
    if theirs != ours:
        raise ConfigError(
            f"init_from={cfg.init_from} held out other files of this corpus (data.val_seed={theirs[0]}, "
            f"data.val_files={theirs[1]}); a continued run must hold out the same ones: "
            f"add data.val_seed={theirs[0]} data.val_files={theirs[1]}")


def keep_parent_records(cfg: DictConfig, out: Path) -> None:
    """out/init_from/ ← the training records of the checkpoint this run continues (nothing for hub models)."""
    parent = trained_parent(cfg)
    if parent is None:
        return
    dest = out / "init_from"
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir()
    for name in ("train_config.yaml", "train_log.jsonl"):
        shutil.copy2(parent / name, dest / name)
    if (parent / "init_from").is_dir():
        shutil.copytree(parent / "init_from", dest / "init_from")


def train(cfg: DictConfig) -> Path | None:
    """Train (or resume) to max_steps and export the model to out_dir → out_dir; None if stopped at stop_at."""
    from tqdm import tqdm

    if not 0.0 <= cfg.early_exit.distill <= 1.0:
        raise ConfigError(f"early_exit.distill={cfg.early_exit.distill} must be in [0, 1]")
    check_same_heldout_files(cfg)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    out = Path(cfg.out_dir)
    work = out / "work"
    work.mkdir(parents=True, exist_ok=True)
    (out / ".gitignore").write_text("work/\n")
    tokenizer, train_tokens, val_tokens, facts = prepare_data(cfg, work)
    model = build_model(cfg, tokenizer)
    n_seq = corpus.num_sequences(train_tokens, cfg.seq_len)
    facts |= {
        "num_parameters": sum(p.numel() for p in model.parameters()),
        "vocab_size": model.config.vocab_size,
        "num_layers": model.config.num_hidden_layers,
        "train_sequences": n_seq,
    }
    write_config(cfg, out, facts)
    keep_parent_records(cfg, out)
    opt, sched = build_optimizer(cfg, model)
    gen = torch.Generator().manual_seed(cfg.seed + 1)  # layer dropout's own stream: checkpointed with the model
    ckpt, train_log = work / "checkpoint.pt", TrainLog(out / "train_log.jsonl")
    start = load_checkpoint(ckpt, cfg, model, opt, sched, gen) if ckpt.is_file() else 0
    train_log.keep_until(start)
    if start:
        log.info("resuming from %s at step %d", ckpt, start)
    stop = min(cfg.stop_at or cfg.max_steps, cfg.max_steps)
    early = exit_weights(model.config.num_hidden_layers, cfg.early_exit.loss_scale, cfg.early_exit.e_scale)
    val = validation_batches(cfg, val_tokens)
    bar = tqdm(total=cfg.max_steps, initial=start, desc="layerskip", dynamic_ncols=True)
    for step in range(start, stop):
        record = train_step(cfg, model, opt, sched, train_tokens, n_seq, early, gen, step)
        done = step + 1
        bar.update(1)
        bar.set_postfix(loss=f"{record['loss']:.3f}", last=f"{record['ce'][str(model.config.num_hidden_layers)]:.3f}")
        if done % cfg.log_every == 0 or done == stop:
            train_log.write(record)
        if done % cfg.eval_every == 0 or done == cfg.max_steps:
            model.eval()
            train_log.write({"step": done, "split": "val", **evaluate_exits(model, val)})
        if done % cfg.checkpoint_every == 0 or done == stop:
            save_checkpoint(ckpt, cfg, model, opt, sched, gen, done)
    bar.close()
    if stop < cfg.max_steps:
        return None
    export(cfg, model, tokenizer, out)
    return out
