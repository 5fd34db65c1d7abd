"""Shared fixtures."""

import pytest
import torch


@pytest.fixture(scope="module")
def one_thread():
    """Pin torch to one thread for a module of many small problems (threads only contend there)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
