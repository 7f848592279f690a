"""RL algorithms in pure torch (no Megatron import): policy losses (policy_loss.py), advantages
(advantages.py), KL estimators (kl.py), the loss statistics (loss_stats.py), the train-vs-rollout
mismatch corrections (TIS, MIS, IcePop: mismatch.py), and the algorithm's config (config.py).

Import each from its module: this file imports nothing, so the run config, which imports
algo/config.py, loads no torch (the launch checks run before any node starts)."""
