"""The `segments` agreement profile of a synthetic model (`model.agreement_profile=segments`): early exits that agree
with the last layer at two levels by context — segments of a generation where the exit at default_exit_layer agrees
`agreement_high` of the time (0.95) and segments where it agrees `agreement_low` (0.3), `segment_tokens` long on
average — so a method that adapts to the context (DEL) has something to adapt to. Weights only: the model stays a
plain LlamaForCausalLM.

How (u: a seeded unit direction of the residual stream; the vocabulary split at random into halves, "high" and
"low"; a position's kind is the half its input token is in):
- the mode is written into the stream: every token's embedding gets ±c·u (+ for the low half), and u is projected
  out of every matrix that reads the stream (q, k, v, gate, up and the head), so no layer sees the mode and the
  model is the random one it was, except where the two mechanisms below read it;
- the low kind's late layers write: in every layer above the exit, `mode_neurons` MLP neurons get gate row g·u —
  silu(g·⟨x̂, u⟩) ≈ g·|⟨x̂, u⟩| at a low-kind position, ≈ 0 at a high-kind one — and a random down column ⟂ u, so at a
  low-kind position the late layers add a large vector that depends on the context (through the neurons' random up
  rows) and the exit's token rarely survives it, while at a high-kind position they barely write;
- the kind persists: each head row gets ±s·|row|·u (+ for the low half), so the next token tends to stay in the half
  of the current one; a segment ends when the random part of the logits outweighs it.
The residual writes are scaled by rⁱ as in the uniform profile, r calibrated (writers off) so that the exit agrees
`agreement_high`; then the writers' scale is bisected until low-kind positions agree `agreement_low`, then s until
the half switches once every `segment_tokens` tokens — all along greedy continuations of the calibration prompts.
The constants are cached beside r (models/synthetic.py); the agreement reached per kind and layer, the positions and
the mean segment length per kind are measured once more on the final weights and kept in `model.synthetic`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from del_bench.errors import ConfigError

VERSION = 1  # in the cache key: a change of the mechanism re-calibrates
SEED_OFFSET = 53  # u, the halves, the neurons and the writers' columns: drawn apart from the weights' stream
MODE_SHARE = 1.0  # c = MODE_SHARE × the norm of layer 1's write: large enough that ⟨x̂, u⟩'s sign is the mode's
FLATTEN = 0.0  # the low half's w component, in units of c (model.flatten overrides)
GATE_ON = 10.0  # g·median|⟨x̂, u⟩| at the exit layer: silu(10) ≈ 10 (low kind), silu(−10) ≈ −5e-4 (high kind)
WRITER_RANGE = (1e-3, 1e3)  # the writers' column norm, in units of c
PERSIST_RANGE = (1e-3, 1e2)  # s: the head rows' u component, in units of the row's norm
KINDS = ("high", "low")  # the kinds, by the half of a position's input token (low: the sign +1)


@dataclass
class Modes:
    """The profile's random draws (seeded) and the head before persistence."""

    u: torch.Tensor  # [D] unit
    w: torch.Tensor  # [D] unit ⟂ u: the direction low-kind embeddings flatten along (`flatten`)
    sign: torch.Tensor  # [V] −1: the high half, +1: the low half
    neurons: torch.Tensor  # [k] MLP neurons repurposed in every layer above the exit
    columns: list[torch.Tensor]  # per layer above the exit: [D, k] unit down columns ⟂ u
    head: torch.Tensor | None = None  # [V, D] the head's rows with u projected out
    row_norms: torch.Tensor | None = None  # [V, 1] their norms


def draw(model, exit_layer: int, neurons: int, seed: int) -> Modes:
    """The profile's draws for `model`, from a generator of their own (the weights' stream is left as it was)."""
    cfg = model.config
    D, V, width = cfg.hidden_size, cfg.vocab_size, cfg.intermediate_size
    if neurons > width:
        raise ConfigError(f"model.mode_neurons={neurons}: a layer of this shape has {width} MLP neurons")
    if cfg.tie_word_embeddings:
        raise ConfigError("model.agreement_profile=segments needs an untied head: its embedding and head rows get "
                          "different u components")
    gen = torch.Generator().manual_seed(seed + SEED_OFFSET)
    u = torch.randn(D, generator=gen, dtype=torch.float64)
    u /= u.norm()
    w = _without(torch.randn(1, D, generator=gen, dtype=torch.float64), [u])[0]
    w /= w.norm()
    sign = torch.full((V,), -1.0, dtype=torch.float64)
    sign[torch.randperm(V, generator=gen)[: V // 2]] = 1.0
    chosen = torch.randperm(width, generator=gen)[:neurons]
    columns = []
    for _ in range(exit_layer, cfg.num_hidden_layers):
        cols = _without(torch.randn(neurons, D, generator=gen, dtype=torch.float64), [u, w])  # [k, D]
        columns.append((cols / cols.norm(dim=1, keepdim=True)).T)  # [D, k]
    device, dtype = model.lm_head.weight.device, model.lm_head.weight.dtype
    return Modes(u.to(device, dtype), w.to(device, dtype), sign.to(device, dtype), chosen.to(device),
                 [c.to(device, dtype) for c in columns])


def _without(rows: torch.Tensor, units: list[torch.Tensor]) -> torch.Tensor:
    """rows [n, D] with their components along the orthonormal `units` removed (what reads the stream no longer
    reads them), computed in at least float32 (a bf16 product would leave a component of its rounding's size)."""
    wide = torch.promote_types(rows.dtype, torch.float32)
    out = rows.to(wide)
    for unit in units:
        unit = unit.to(wide)
        out = out - (out @ unit)[:, None] * unit[None, :]
    return out.to(rows.dtype)


@torch.no_grad()
def layer_one_write(model, prompts: torch.Tensor) -> float:
    """The mean norm of what layer 1 adds to the stream at the prompts' positions: the scale c is set in (r⁰ = 1,
    and its input is normed, so the embedding's scale does not change it)."""
    states = model(prompts, output_hidden_states=True).hidden_states
    return (states[1] - states[0]).norm(dim=-1).mean().item()


@torch.no_grad()
def install(model, modes: Modes, c: float, flatten: float, exit_layer: int) -> None:
    """The mode in the stream and nothing reading it yet: embeddings = λ·e⊥ ± c·u (token part of norm c on average,
    so token identity and mode weigh alike), + flatten·c·w for the low half; u and w out of every matrix that reads
    the stream (the layers' norms' weights are ones, so a row ⟂ u reads nothing of u), the head's rows kept without
    them (persistence: `persist`), the repurposed neurons silent (gate rows and down columns 0: `write`). w is read
    by nothing but the RMSNorms: at a low-kind position it takes a share of the normed state, so every layer's
    distribution is flatter there (a confidence that tells the kinds apart, as a trained model's is lower where its
    exits disagree) and the layers read a smaller token part."""
    u, units = modes.u, [modes.u, modes.w]
    low = (modes.sign > 0).to(u.dtype)[:, None]  # [V, 1]
    embed = model.model.embed_tokens.weight  # [V, D]
    tokens = _without(embed, units)
    embed.copy_(tokens * (c / tokens.norm(dim=1).mean()) + modes.sign[:, None] * c * u[None, :]
                + low * flatten * c * modes.w[None, :])
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        for proj in (attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj, mlp.up_proj):
            proj.weight.copy_(_without(proj.weight, units))
    modes.head = _without(model.lm_head.weight, units)
    modes.row_norms = modes.head.norm(dim=1, keepdim=True)
    model.lm_head.weight.copy_(modes.head)
    write(model, modes, exit_layer, gain=0.0, scale=0.0)


@torch.no_grad()
def write(model, modes: Modes, exit_layer: int, gain: float, scale: float) -> None:
    """The writers: in every layer above the exit, the repurposed neurons' gate rows = gain·u, down columns =
    scale·(unit random columns ⟂ u) — after rⁱ is in the weights (the writers are not scaled by it)."""
    for layer, cols in zip(model.model.layers[exit_layer:], modes.columns):
        layer.mlp.gate_proj.weight[modes.neurons] = gain * modes.u
        layer.mlp.down_proj.weight[:, modes.neurons] = scale * cols


@torch.no_grad()
def persist(model, modes: Modes, s: float) -> None:
    """The head rows: each (u projected out) + sign·s·|row|·u: a token of the current half gains 2·s·|row|·|⟨x̂, u⟩|
    over one of the other half."""
    model.lm_head.weight.copy_(modes.head + s * modes.row_norms * modes.sign[:, None] * modes.u[None, :])


@torch.no_grad()
def mode_margin(model, prompts: torch.Tensor, exit_layer: int, u: torch.Tensor) -> float:
    """The median |⟨x̂, u⟩| (x̂ = x·√D/|x|, what RMSNorm gives a layer) at the exit layer's output over the prompts'
    positions: the size of the mode's signal the gates read."""
    x = model(prompts, output_hidden_states=True).hidden_states[exit_layer]  # [B, P, D]
    m = (x @ u) * x.shape[-1] ** 0.5 / x.norm(dim=-1)  # [B, P]
    return m.abs().median().item()


@torch.inference_mode()
def confidence_by_kind(model, inputs: torch.Tensor, prompts: torch.Tensor, exit_layer: int, sign: torch.Tensor) -> dict:
    """{kind: the mean top probability of the head on the exit layer's normed state} at the positions exit_matches
    scored (inputs [B, T]: their input tokens; the sequence is the prompts' and the inputs after the first)."""
    sequences = torch.cat([prompts[:, :-1], inputs], 1)  # [B, P − 1 + T]: position P − 1 + t reads inputs[:, t]
    state = model(sequences, output_hidden_states=True).hidden_states[exit_layer][:, prompts.shape[1] - 1:]
    top = torch.softmax(model.lm_head(model.model.norm(state)).float(), -1).amax(-1)  # [B, T]
    low = kinds_of(inputs, sign)
    return {kind: top[mask].mean().item() if mask.any() else None for kind, mask in zip(KINDS, (~low, low))}


def kinds_of(tokens: torch.Tensor, sign: torch.Tensor) -> torch.Tensor:
    """[…] ids → […] bool: True where the token is of the low half."""
    return sign[tokens] > 0


def agreement_by_kind(matches: torch.Tensor, inputs: torch.Tensor, sign: torch.Tensor) -> dict:
    """matches [L−1, B, T] (exit token = last layer's, per layer and position), inputs [B, T] (each position's input
    token) → {kind: [agreement per layer (1-based: index i − 1), 1.0 for the last]} and {kind: positions}."""
    low = kinds_of(inputs, sign)  # [B, T]
    out, counts = {}, {}
    for kind, mask in zip(KINDS, (~low, low)):
        counts[kind] = int(mask.sum())
        out[kind] = [m[mask].double().mean().item() if counts[kind] else None for m in matches] + [1.0]
    return out, counts


def switch_rate(generated: torch.Tensor, sign: torch.Tensor) -> float:
    """[B, T] ids → the fraction of consecutive pairs whose halves differ (1 / the mean segment length)."""
    low = kinds_of(generated, sign)
    return (low[:, 1:] != low[:, :-1]).double().mean().item()


def segment_lengths(generated: torch.Tensor, sign: torch.Tensor) -> dict:
    """[B, T] ids → {kind: mean length of its runs} (a run cut by the end of a sequence counted as it is)."""
    runs = {kind: [] for kind in KINDS}
    for row in kinds_of(generated, sign).tolist():
        start = 0
        for t in range(1, len(row) + 1):
            if t == len(row) or row[t] != row[start]:
                runs[KINDS[row[start]]].append(t - start)
                start = t
    return {kind: round(sum(r) / len(r), 2) if r else None for kind, r in runs.items()}


def bisect(measure, bounds: tuple[float, float], target: float, steps: int) -> float:
    """x in bounds (geometric bisection) whose measure(x) — falling as x grows — is nearest `target`."""
    lo, hi = bounds
    best = (float("inf"), lo)
    for _ in range(steps):
        mid = (lo * hi) ** 0.5
        value = measure(mid)
        best = min(best, (abs(value - target), mid))
        lo, hi = (mid, hi) if value > target else (lo, mid)
    return best[1]
