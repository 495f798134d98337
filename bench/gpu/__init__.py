"""What only a GPU runs: ``make gpu-check`` (gpu_check) and the staging path's costs
(staging)."""
