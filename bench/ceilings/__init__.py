"""What this machine allows, beside what the library reaches: one command each
(udp_ceiling, switch_ceiling, host_path, quantization_error; loadgen_build builds their
load generator), with loads.py's load processes and common options."""
