"""Prints the scheduler state machine's step counts in the terminal summary (also without ``-s``)."""

from __future__ import annotations


def pytest_terminal_summary(terminalreporter):
    module = __import__("sys").modules.get("test_scheduler_machine")
    totals = getattr(module, "TOTALS", None)
    if totals:
        terminalreporter.section("kvtier scheduler state machine")
        terminalreporter.write_line(
            f"{totals['rule_steps']} rule steps over {totals['examples']} examples, "
            f"{totals['engine_steps']} engine steps, {totals['requests']} requests"
        )
        terminalreporter.write_line(", ".join(f"{k}={v}" for k, v in sorted(totals.items())
                                              if k not in ("rule_steps", "examples", "engine_steps", "requests")))
