"""The README's recipes, done as a user would: a new method and a new task, each one Python class plus one YAML
(here in a config directory of the test's own, added to Hydra's search path), reached only through the public
seams — the Method protocol, the Task base class and the run config. Nothing else in del_bench changes, and the
new method is lossless and accounted like every other."""

from __future__ import annotations

import json

from hydra import compose, initialize_config_dir

from del_bench import runner
from del_bench.config import CONFIG_DIR
from del_bench.methods.base import Method, Plan, check_exit_layer
from del_bench.report.collect import load_runs
from del_bench.tasks.base import Sample, Task


class Alternating(Method):
    """A toy policy: draft γ tokens at layer E every other round, none in between."""

    name = "alternating"

    def __init__(self, exit_layer: int, gamma: int, **_):
        self.exit_layer, self.gamma = exit_layer, gamma

    def validate(self, num_layers: int) -> None:
        check_exit_layer(self.exit_layer, num_layers)

    def start(self, num_layers: int) -> None:
        super().start(num_layers)
        self.rounds = 0

    def plan(self) -> Plan:
        self.rounds += 1
        return Plan(exit_layer=self.exit_layer if self.rounds % 2 else None, max_draft=self.gamma)

    def describe(self) -> dict:
        return {"exit_layer": self.exit_layer, "gamma": self.gamma}


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
exit_layer: 1
gamma: 3
tag: alternating-E${{.exit_layer}}-g${{.gamma}}
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


def test_add_a_method_and_a_task_through_the_public_seams(tmp_path):
    configs = tmp_path / "my_configs"
    (configs / "method").mkdir(parents=True)
    (configs / "task").mkdir()
    (configs / "method" / "alternating.yaml").write_text(METHOD_YAML)
    (configs / "task" / "counting.yaml").write_text(TASK_YAML)
    runs = tmp_path / "runs"
    vanilla = runner.run(_compose(configs, "task=counting", "method=vanilla", f"out_dir={runs / 'vanilla'}"))
    mine = runner.run(_compose(configs, "task=counting", "method=alternating", f"out_dir={runs / 'mine'}"))

    assert mine["method_tag"] == "alternating-E1-g3" and mine["drafted"] > 0
    assert set(mine["quality"]) == {"next"}
    outputs = {tag: [json.loads(line)["output_ids"] for line in (runs / tag / "samples.jsonl").read_text().splitlines()]
               for tag in ("vanilla", "mine")}
    assert outputs["mine"] == outputs["vanilla"]  # lossless: the engine verifies whatever the policy drafts
    rounds = [json.loads(line) for line in (runs / "mine" / "rounds.jsonl").read_text().splitlines()]
    L = vanilla["config"]["model"]["num_layers"]
    assert all(r["loaded_layers"] == r["drafted"] * (r["exit_layer"] or 0) + L for r in rounds)
    first = [r["exit_layer"] for r in rounds if r["round"] and r["sample_id"] == "n0"][:2]
    assert first == [1, None]  # the policy's plan reached the engine: drafting every other round
    df = load_runs([runs]).set_index("method")
    assert df.loc["alternating", "has_vanilla"] and df.loc["alternating", "outputs_equal"] == 3
