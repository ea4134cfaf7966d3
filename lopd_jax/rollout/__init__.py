"""The inference floor: the rollout engine (continuous batching over a paged KV cache),
its device calls, sampling, the inference mesh layout and chat episodes.

Tasks and a policy in, token trajectories out (:func:`lopd_jax.rollout.episodes.rollout`);
new weights in between RL steps (:meth:`lopd_jax.rollout.engine.Engine.run`).
"""
