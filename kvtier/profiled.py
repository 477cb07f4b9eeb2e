"""kvtier's hooks by name in a torch profile (vLLM's ``--profiler-config``, or ``kvtier-bench
engine --profile``): each runs in a ``kvtier.<hook>`` range of the trace, so a profile shows
what each hook costs in a step. Asks torch whether a profiler runs through its private
``torch.autograd._profiler_enabled`` (torch has no public way; ``record_function`` itself costs
~8 us)."""

from __future__ import annotations

import functools

import torch


def named(hook):
    """``hook``, run in a ``kvtier.<name>`` range while a profiler runs; 0.1 us when none does (a
    ``record_function`` itself costs ~8 us, too much for every hook of every step)."""
    label = f"kvtier.{hook.__name__}"

    @functools.wraps(hook)
    def run(*args, **kwargs):
        if not torch.autograd._profiler_enabled():
            return hook(*args, **kwargs)
        with torch.profiler.record_function(label):
            return hook(*args, **kwargs)

    return run


def name_hooks(cls: type, names: tuple[str, ...]) -> None:
    """Have ``cls``'s methods ``names`` show by name in a profile (:func:`named`)."""
    for name in names:
        setattr(cls, name, named(getattr(cls, name)))
