"""The tools around training: plan and recommend, the dry run, calibration, DeepSpeed import,
checkpoint inspection and corpus preparation. Each reaches the library through its public faces."""
