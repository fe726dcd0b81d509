"""Vanilla: plain autoregressive decoding (every token through all L layers)."""

from del_bench.methods.base import BASELINE, Method, Plan


class Vanilla(Method):
    name = "vanilla"
    label, family, order = "Vanilla", BASELINE, 0

    def plan(self) -> Plan:
        return Plan(exit_layer=None, max_draft=0)
