"""Attention operators on sequences and measures, local Lipschitz constants, bounds and dynamics."""
