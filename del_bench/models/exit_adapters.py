"""Exit adapters: a learned d×d map per layer in front of the frozen LM head (AdaDecode §2.1, docs/design.md §4.6).

Head at layer ℓ (1-based, ℓ < L):  logits_ℓ = head(norm(h_ℓ) @ A_ℓ + b_ℓ)
  norm  = the model's frozen final RMSNorm (applied to the layer state first, as the model does before its head),
  A_ℓ   = [D, D] stored as [in, out] (x @ A), b_ℓ = [D] (zero when trained without bias),
  head  = the model's frozen LM head (E*).
AdaDecode writes E^(i) = E*·T^(i) on the raw state; putting the final norm first keeps the adapter's input on the
scale the head was trained for, and with A = I, b = 0 the adapter *is* the model's own early-exit head, so "own
head" and "adapters" differ only in (A, b).

A directory D written by `python -m del_bench train-exits` holds
  adapters.safetensors   weight [n, D, D] (x @ weight[i]), bias [n, D], layers [n] (1-based, int64)
  adapters.json          how they were trained: base model (name, weights digest), data, steps, the fit,
                         per-layer agreement with the last layer before/after on held-out text
  work/                  resumable state (collected states, KL checkpoint); not needed to load the adapters

Cost: applying A_ℓ to one row is D² multiply-adds, the LM head D·V, a decoder layer ≈ 4D² + 3·D·I (SmolLM2:
0.33M vs 28.3M vs 3.5M, so an adapter row ≈ 0.09 layer ≈ 1% of a head row).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch

WEIGHTS_FILE = "adapters.safetensors"
RECORD_FILE = "adapters.json"


@dataclass
class ExitAdapters:
    layers: list[int]  # 1-based layers that have an adapter
    weight: torch.Tensor  # [n, D, D]: row x ↦ x @ weight[i]
    bias: torch.Tensor  # [n, D]
    record: dict | None = None  # adapters.json (how they were trained), when loaded from a directory

    def __post_init__(self):
        self.index = {layer: i for i, layer in enumerate(self.layers)}

    @classmethod
    def identity(cls, layers: list[int], dim: int, dtype=torch.float32) -> "ExitAdapters":
        n = len(layers)
        return cls(list(layers), torch.eye(dim, dtype=dtype).repeat(n, 1, 1), torch.zeros(n, dim, dtype=dtype))

    def to(self, dtype: torch.dtype, device=None) -> "ExitAdapters":
        return ExitAdapters(self.layers, self.weight.to(dtype=dtype, device=device).contiguous(),
                            self.bias.to(dtype=dtype, device=device), self.record)

    def apply(self, x: torch.Tensor, layer: int) -> torch.Tensor:
        """x: [..., D] normed state of 1-based `layer` → the head's input [..., D] (unchanged without an adapter)."""
        i = self.index.get(layer)
        if i is None:
            return x
        return torch.addmm(self.bias[i], x.reshape(-1, x.shape[-1]), self.weight[i]).view(x.shape)

    def save(self, out_dir: str | Path, record: dict) -> None:
        from safetensors.torch import save_file

        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        tensors = {"weight": self.weight.float().contiguous(), "bias": self.bias.float().contiguous(),
                   "layers": torch.tensor(self.layers, dtype=torch.int64)}
        tmp = out / (WEIGHTS_FILE + ".tmp")
        save_file(tensors, str(tmp), metadata={"format": "del_bench.exit_adapters/1"})
        tmp.replace(out / WEIGHTS_FILE)
        (out / RECORD_FILE).write_text(json.dumps(record, indent=2) + "\n")


def load(path: str | Path) -> ExitAdapters:
    """Read a train-exits directory (offline; float32 tensors)."""
    from safetensors.torch import load_file

    path = Path(path)
    file = path / WEIGHTS_FILE
    if not file.is_file():
        raise FileNotFoundError(f"no exit adapters at {path} ({WEIGHTS_FILE} missing): train them with "
                                f"`python -m del_bench train-exits out_dir={path}`")
    tensors = load_file(str(file))
    record = json.loads((path / RECORD_FILE).read_text()) if (path / RECORD_FILE).is_file() else None
    return ExitAdapters([int(x) for x in tensors["layers"].tolist()], tensors["weight"], tensors["bias"], record)


def digest(path: str | Path) -> str:
    """sha256 (16 hex) of the adapter weights file; 'missing' when there is none."""
    file = Path(path) / WEIGHTS_FILE
    if not file.is_file():
        return "missing"
    return hashlib.sha256(file.read_bytes()).hexdigest()[:16]


def variant_weights(base_weights: str, adapters_path: str | None) -> str:
    """A run's `weights` (RunKey): the base model's digest, or with adapters a digest of base + adapters, so adapter
    runs are their own model variant (never paired with, nor averaged into, own-head runs)."""
    if not adapters_path:
        return base_weights
    return hashlib.sha256(f"{base_weights}|exit_adapters:{digest(adapters_path)}".encode()).hexdigest()[:16]


def resolve(path: str | Path) -> Path:
    """An adapters directory as given (absolute, or relative to the working directory), else under the repo root."""
    from del_bench.models.loading import REPO_ROOT

    path = Path(path)
    return path if path.is_absolute() or path.exists() else REPO_ROOT / path


def model_variant(name: str, adapters_path: str | None) -> str:
    """The `${model_variant:…}` resolver (out_dir): the model's name, or `<name>+exits-<digest8>` with adapters, so
    adapter runs get their own directories (and retrained adapters at the same path new ones)."""
    if not adapters_path:
        return name
    return f"{name}+exits-{digest(resolve(adapters_path))[:8]}"


def attach(stack, model_cfg) -> None:
    """Load `model.exit_adapters` (if set) into the stack, after checking they were trained for this model."""
    path = model_cfg.get("exit_adapters")
    if not path:
        return
    adapters = load(resolve(path))
    dim = stack.norm_weight.shape[0]
    if adapters.weight.shape[-1] != dim or max(adapters.layers) >= stack.num_layers:
        raise ValueError(f"exit adapters at {path} (D={adapters.weight.shape[-1]}, layers up to "
                         f"{max(adapters.layers)}) do not fit model {model_cfg.name} (D={dim}, L={stack.num_layers})")
    base = (adapters.record or {}).get("model", {})
    if base.get("name") not in (None, model_cfg.name):
        raise ValueError(f"exit adapters at {path} were trained on model {base.get('name')!r}, not {model_cfg.name!r}")
    stack.set_adapters(adapters)
