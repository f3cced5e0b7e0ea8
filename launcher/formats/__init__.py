"""Torch-free formats: the files that cross process boundaries and how they are read and written.

`files` (bounded reads of user files, create-temp-then-rename writes that never go through or over
a symlink or device, paths proven inside their parent), `shell` (the one quoting function for
anything that reaches a script), `rundir` (the run directory's layout and its exclusive lock), `bwmap`
(the BandwidthMap preflight writes and the planner, diagnose and drain read), `jobs` (the one record
of a submitted job), `requests` (the kinds of job that are not a planned training job).
Imports nothing from the rest of launch4d but errors, so checks, the CLI and the trainer can use it.
"""
