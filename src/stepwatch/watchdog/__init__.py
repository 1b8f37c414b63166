"""The hang watchdog: a sidecar process per rank (``sidecar.py``) outside the trainer's GIL, and the
cross-rank verdict on a hang (``verdict.py``). Started by the capture feature (``capture/``)."""
