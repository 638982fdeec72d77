"""Cluster planning across accelerator types: Gavel (dissertation ch. 5-6) fed by the planner.

* ``fleet``: heterogeneous fleets (``conf/fleet/``: types = ``conf/cluster`` presets + counts + prices)
  and jobs (a jobs file);
* ``throughput``: the matrix T, each job's steps/s on each type from the planner's best plan;
* ``policies``: max-min fairness (LAS, and by water filling), FIFO, makespan, finish-time fairness,
  minimum cost (with SLOs) and maximum throughput as linear programs over the allocation X (HiGHS),
  shortest job first as a greedy baseline, each with a heterogeneity-agnostic variant;
* ``problem`` / ``lp``: what a policy allocates (X, its validity) and the LP over X it solves;
  ``water_filling``: max-min fairness raised level by level;
* ``colocation``: space sharing's job pairs and their co-located throughputs;
* ``mechanism``: the round-based mechanism that realises X with priorities;
* ``simulator`` / ``trace``: a discrete-event simulator of a job trace and a synthetic trace generator;
* ``report`` / ``__main__``: ``python -m planner.cluster`` (conf/gavel.yaml). See docs/cluster.md.
"""
