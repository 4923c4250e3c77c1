"""One torch intra-op thread for a test module's tiny tensors (much faster on a shared CPU than
torch's default; restored after the module). Import it into a test module to apply it there:
``from _threads import _one_thread  # noqa: F401``."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
