"""``stepwatch doctor``: node checks (GPUs, GPM, timing backend, py-spy, nsys, NCCL and torchrun
environment) and an optional storage benchmark. See docs/telemetry.md, "stepwatch doctor"."""
