"""Small modules the TP-style tests parallelize."""

import torch
from torch import nn


class LinearPair(nn.Module):
    """colwise -> relu -> rowwise, with biases: the simplest TP MLP."""

    def __init__(self, d: int, hidden: int, dtype):
        super().__init__()
        self.up = nn.Linear(d, hidden, dtype=dtype)
        self.down = nn.Linear(hidden, d, dtype=dtype)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))
