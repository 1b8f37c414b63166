"""One place for each OS concern the features share: ``procs`` (``/proc`` readers, reaping),
``ptrace`` (can py-spy read a process: Yama, CAP_SYS_PTRACE, PR_SET_PTRACER, finding py-spy) and
``pyspy`` (running and parsing py-spy and faulthandler dumps). Nothing here imports a feature."""
