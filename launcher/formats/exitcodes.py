"""Exit codes that cross process boundaries: the trainer sets them, launchers and Slurm read them."""

#: Bad input from a person: one line on stderr, nothing half-done.
USER_ERROR = 2
#: The trainer after a preemption checkpoint (EX_TEMPFAIL): "run me again to resume".
PREEMPT_EXIT_CODE = 75
