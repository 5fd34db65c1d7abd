"""Optimal transport between measures: W2, entropic W2 and the conditional W2 of masked measures."""
