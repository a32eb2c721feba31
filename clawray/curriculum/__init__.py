"""Curricula over environment tasks: ALP-GMM over continuous task parameters."""

from clawray.curriculum.alp_gmm import ALPGMM, ALPGMMConfig

__all__ = ["ALPGMM", "ALPGMMConfig"]
