"""Vanilla: plain autoregressive decoding (every token through all L layers)."""

from del_bench.methods.base import Method, Plan


class Vanilla(Method):
    name = "vanilla"

    def plan(self) -> Plan:
        return Plan(exit_layer=None, max_draft=0)
