"""Planning and estimation: what a run will cost, worked out on the host before it runs.

* :mod:`~lopd_jax.planning.length_model` -- the bucket plan of a length-aware training step
  (:func:`~lopd_jax.planning.length_model.plan_passes`) and episode lengths drawn from the
  ``lengths`` section's distribution;
* :mod:`~lopd_jax.planning.pack_plan` -- whole trajectories packed into rows of a few bucket
  lengths;
* :mod:`~lopd_jax.planning.length_estimate` -- the compile check's step estimate on drawn
  lengths (padded, bucketed, packed);
* :mod:`~lopd_jax.planning.collective_estimate` -- the bytes each chip moves over ICI in one
  training pass;
* :mod:`~lopd_jax.planning.engine_schedule` -- the schedule simulation of the rollout engine and
  of the static sampler, in decode steps (sizes the page pool);
* :mod:`~lopd_jax.planning.rl_schedule` -- the whole RL step in seconds, synchronous or
  asynchronous.

Pure Python and NumPy: the floor reads its settings (``lopd_jax.settings``) and imports
nothing that runs a model. The trainer (its bucket and packing plans) and the compile checks
(their estimates and simulations) use it.
"""
