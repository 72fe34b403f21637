"""Named ranges of a step for torch.profiler (`kvserve bench step --profile` splits a step by them).

torch's `record_function` costs ~18 us to enter even with no profiler running, and a step
enters six or seven: a range is opened only while a profiler runs.
"""

from __future__ import annotations

import contextlib

import torch.autograd.profiler
from torch.profiler import record_function

_NONE = contextlib.nullcontext()


def named_range(name: str) -> contextlib.AbstractContextManager:
    # torch's own flag (private: where a torch lacks it, every range is opened as before)
    profiling = getattr(torch.autograd.profiler, "_is_profiler_enabled", True)
    return record_function(name) if profiling else _NONE
