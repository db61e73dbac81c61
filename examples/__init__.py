"""Example training scripts, installed as ``trainguard.examples`` so ``trainguard demo`` runs from a wheel."""
