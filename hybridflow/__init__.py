"""hybridflow: reinforcement-learning post-training of language models.

One controller process writes the RL dataflow as plain Python; each model role (actor, rollout,
reference, critic, reward model) runs as an SPMD worker group. See docs/ for the architecture.
"""

__version__ = "0.1.0"
