"""Curricula over environment tasks: ALP-GMM over continuous task parameters, task samplers
(uniform, ALP-GMM, learnability, accuracy band) and the curriculum actor (``actor.py``)."""

from clawray.curriculum.alp_gmm import ALPGMM, ALPGMMConfig
from clawray.curriculum.samplers import (SAMPLERS, AccuracyBandSampler, ALPGMMSampler,
                                         LearnabilitySampler, TaskSampler, UniformSampler,
                                         difficulty_histogram, make_sampler, sampler_from_state)

__all__ = ["ALPGMM", "ALPGMMConfig", "ALPGMMSampler", "AccuracyBandSampler",
           "LearnabilitySampler", "SAMPLERS", "TaskSampler", "UniformSampler",
           "difficulty_histogram", "make_sampler", "sampler_from_state"]
