"""One place for each OS concern the features share: ``procs`` (``/proc`` readers, reaping),
``ptrace`` (can py-spy read a process: Yama, CAP_SYS_PTRACE, PR_SET_PTRACER, finding py-spy),
``pyspy`` (running and parsing py-spy and faulthandler dumps) and ``threads`` (a thread the
interpreter may refuse at its exit). Nothing here imports a feature."""
