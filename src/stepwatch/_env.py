"""stepwatch's own environment variables between its processes (not user settings: those are
declared with their ``Config`` field in ``config.py``). One place, so a writer and its reader
cannot drift apart. ``runner/shim/sitecustomize.py`` spells them out itself (it runs in every
Python process of a job before anything else, and must not import the package); a test holds
it to these."""

# ``stepwatch run`` sets it for every process of the job.
RUN = "STEPWATCH_RUN"
# "ranks" under torchrun (instrument the processes with RANK set), else "top".
RUN_MODE = "STEPWATCH_RUN_MODE"
# The pid of the process the shim started stepwatch in: its children are not ranks.
RUN_ACTIVE = "STEPWATCH_RUN_ACTIVE"
# Where ``stepwatch run``'s own package is (the folder that holds ``stepwatch``): the shim appends it
# to ``sys.path`` only where the job's Python cannot import stepwatch itself. On PYTHONPATH it came
# before the standard library and the job's site-packages: a job run with another venv's Python
# imported that folder's packages (torch included, for an installed stepwatch) instead of its own.
PKG_PATH = "STEPWATCH_RUN_PKG_PATH"
# ``stepwatch run --nsys``: captures open cudaProfilerStart/Stop ranges.
NSYS = "STEPWATCH_NSYS"
# In the watchdog sidecar process: never instrument it.
SIDECAR = "STEPWATCH_SIDECAR"
# Config's on/off switch, which stepwatch also sets to "0" for processes it starts (the sidecar,
# a trace analysis) so that the shim does not instrument them.
ENABLED = "STEPWATCH_ENABLED"
# Set (to the trainer's pid) while a DataLoader starts its worker processes. A worker started
# with 'spawn' or 'forkserver' imports the script's main module again, and with it
# ``import stepwatch.auto``: there, ``init()`` starts nothing.
DATALOADER_WORKER = "STEPWATCH_DATALOADER_WORKER"
