"""A run's settings, validated before TensorFlow starts.

  * schema: the dataclasses, each setting written once (`Config`, `ConfigError`);
  * flags: the absl flags, defined from the schema's fields (and the planner's and
    the Kubernetes renderer's own);
  * config: `from_flags`, parsed flags to a frozen, validated `Config`;
  * rules: the pure validation rules (`validate`, `check_batch`, `check_model_split`),
    with each task's own in tfpar.tasks.specs;
  * rundir: a run's config.json (`read_saved`, `from_saved`, `load`) and what the
    flags meet there (`check_run`);
  * cluster: the job's TF_CONFIG against the flags (`check_cluster`).

What can only be found while reading (a TFRecord whose records are not
tf.train.Example) fails later, with the same one line and exit status 2.
"""
