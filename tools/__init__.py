"""Tools around the pipeline that are not part of the library: `offline_gpu`, a runner for GPU hosts
without internet under a job time limit."""
