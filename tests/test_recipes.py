"""The README's recipes, done as a user would: a new method and a new task, each one Python class plus one YAML
(here in a config directory of the test's own, added to Hydra's search path), reached only through the public
seams — the Method protocol, the Task base class and the run config. Nothing else in del_bench changes, and the
new method is lossless and accounted like every other: it names itself in `show` and the report (its label, family
and place among the rows) and gets its compiled graphs from the shape it declares, none of which touches
records/, report/tables.py or engine/compiled.py."""

from __future__ import annotations

import json
import re
from dataclasses import MISSING, dataclass
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from torch._dynamo.testing import CompileCounterWithBackend

from del_bench import runner
from del_bench.__main__ import cmd_show
from del_bench.config import CONFIG_DIR, validate
from del_bench.engine import path_choice
from del_bench.errors import ConfigError
from del_bench.methods.base import EARLY_EXIT, Method, MethodConfig, Plan, StaticShape
from del_bench.models.layer_stack import LayerStack
from del_bench.report import tables
from del_bench.report.collect import load_runs
from del_bench.schema import LAYERS, key
from del_bench.tasks.base import Sample, Task
from tests.conftest import tiny_model


@dataclass(kw_only=True)
class AlternatingConfig(MethodConfig):
    """The toy method's keys, typed and ranged: its config is checked against them before any weights load."""

    exit_layer: int = key(MISSING, "E: the draft runs layers 1..E", ge=1, lt=LAYERS)
    drafts: int = key(MISSING, "draft tokens every other round", ge=1)


class Alternating(Method):
    """A toy policy: draft `drafts` tokens at layer E every other round, none in between."""

    name = "alternating"
    label, family, order = "Alternating", EARLY_EXIT, 5  # between Vanilla (0) and LS (10)
    label_hyperparameters = (("exit_layer", "E"), ("drafts", "γ"))
    config = AlternatingConfig

    def __init__(self, exit_layer: int, drafts: int, **_):
        self.exit_layer, self.gamma = exit_layer, drafts

    def start(self, num_layers: int) -> None:
        super().start(num_layers)
        self.rounds = 0

    def plan(self) -> Plan:
        self.rounds += 1
        return Plan(exit_layer=self.exit_layer if self.rounds % 2 else None, max_draft=self.gamma)

    def describe(self) -> dict:
        return {"exit_layer": self.exit_layer, "drafts": self.gamma}

    def static_shape(self) -> StaticShape:
        return StaticShape(self.exit_layer, self.gamma)


class Counting(Task):
    """A toy task: count upwards; scored by whether the output contains the next number."""

    name = "counting"
    version = "1"

    def load(self) -> list[Sample]:
        return [Sample(id=f"n{i}", prompt=" ".join(map(str, range(i, i + 5))), reference=str(i + 5))
                for i in range(4)]

    def score(self, sample: Sample, output_text: str) -> dict[str, float]:
        return {"next": float(sample.reference in output_text)}


METHOD_YAML = f"""# Alternating(E, γ): a toy method from tests/test_recipes.py
_target_: {__name__}.Alternating
name: alternating
exit_layer: 2
drafts: 3
tag: alternating-E${{.exit_layer}}-g${{.drafts}}
"""
TASK_YAML = f"""# Counting: a toy task from tests/test_recipes.py
_target_: {__name__}.Counting
name: counting
stop_strings: []
"""


def _compose(extra_dir, *overrides):
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        return compose(config_name="run", overrides=[f"hydra.searchpath=[file://{extra_dir}]", "model=tiny-random",
                                                     "limit=3", "max_new_tokens=12", "warmup_tokens=0", "threads=1",
                                                     *overrides])


@pytest.fixture(scope="module")
def recipe_runs(tmp_path_factory) -> Path:
    """Runs of the toy task (its YAML and the toy method's in a config directory of the test's own): Vanilla, LS and
    the toy method, each in <runs>/<method>."""
    root = tmp_path_factory.mktemp("recipes")
    configs = root / "my_configs"
    (configs / "method").mkdir(parents=True)
    (configs / "task").mkdir()
    (configs / "method" / "alternating.yaml").write_text(METHOD_YAML)
    (configs / "task" / "counting.yaml").write_text(TASK_YAML)
    runs = root / "runs"
    for method in ("vanilla", "ls", "alternating"):
        runner.run(_compose(configs, "task=counting", f"method={method}", f"out_dir={runs / method}"))
    return runs


def test_add_a_method_and_a_task_through_the_public_seams(recipe_runs):
    runs = recipe_runs
    vanilla, mine = (json.loads((runs / m / "summary.json").read_text()) for m in ("vanilla", "alternating"))

    assert mine["method_tag"] == "alternating-E2-g3" and mine["drafted"] > 0
    assert set(mine["quality"]) == {"next"}
    outputs = {m: [json.loads(line)["output_ids"] for line in (runs / m / "samples.jsonl").read_text().splitlines()]
               for m in ("vanilla", "alternating")}
    assert outputs["alternating"] == outputs["vanilla"]  # lossless: the engine verifies whatever the policy drafts
    rounds = [json.loads(line) for line in (runs / "alternating" / "rounds.jsonl").read_text().splitlines()]
    L = vanilla["config"]["model"]["num_layers"]
    assert all(r["loaded_layers"] == r["drafted"] * (r["exit_layer"] or 0) + L for r in rounds)
    first = [r["exit_layer"] for r in rounds if r["round"] and r["sample_id"] == "n0"][:2]
    assert first == [2, None]  # the policy's plan reached the engine: drafting every other round
    df = load_runs([runs]).set_index("method")
    assert df.loc["alternating", "has_vanilla"] and df.loc["alternating", "outputs_equal"] == 3
    configs = runs.parent / "my_configs"  # its keys are checked as declared beside them, on the model's depth
    for bad, message in (("method.drafts=0", "method.drafts=0: must be an integer ≥ 1"),
                         ("method.exit_layer=4", r"method.exit_layer=4: must be an integer in [1, L − 1], here [1, 3]"),
                         ("+method.draft=2", "method.draft: not a key of method alternating. Did you mean 'drafts'")):
        with pytest.raises(ConfigError, match=re.escape(message)):
            validate(_compose(configs, "task=counting", "method=alternating", bad))


def test_a_new_method_names_itself_in_show_and_the_report_and_shapes_its_compiled_graphs(recipe_runs, capsys):
    """What the toy method declares on its class — label with its hyperparameters, family, order, static shape —
    comes out in `show`, in the report's rows (between Vanilla and LS, as its order says, though its E sorts after
    LS's) and in the graphs the compiled steps prepare for it."""
    runs = recipe_runs
    assert cmd_show([str(runs / m) for m in ("vanilla", "alternating")]) == 0
    assert " Alternating(E2-γ3) " in capsys.readouterr().out
    df = load_runs([runs]).set_index("method")
    assert (df.loc["alternating", "label"], df.loc["alternating", "family"]) == ("Alternating(E2-γ3)", EARLY_EXIT)
    table = tables.wide_table(load_runs([runs]), 3, [tables.Col("counting:speedup", "Speedup", "counting", "speedup")],
                              "counting")
    assert [r.label.split(" ")[0] for r in table.rows] == ["Vanilla", "Alternating(E2-γ3)", "LS(E1-γ3)"]  # no ‡

    stack = LayerStack(tiny_model()[0])  # 4 layers
    _, info = path_choice.choose_graphs(stack, "on", Alternating(2, 3), 24, backend=CompileCounterWithBackend("eager"))
    # Vanilla's step (all 4 layers), the draft (layers 1..2) and the verify widths 1, 2, 4 (≤ γ + 1 = 4) after it
    assert info["compiled"] and info["graphs"] == 5
