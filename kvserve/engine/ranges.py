"""Named ranges of a step for torch.profiler (`kvserve bench step --profile` splits a step by them).

torch's `record_function` costs ~18 us to enter even with no profiler running, and a step
enters six or seven: a range is opened only while a profiler runs.
"""

from __future__ import annotations

import contextlib
from contextlib import AbstractContextManager

import torch.autograd.profiler
from torch.profiler import record_function

_NONE = contextlib.nullcontext()


def named_range(name: str) -> AbstractContextManager:
    return record_function(name) if torch.autograd.profiler._is_profiler_enabled else _NONE
