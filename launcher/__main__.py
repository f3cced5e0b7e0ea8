"""`python -m launcher ...` is `launch ...` (for a checkout or an environment without the console script)."""

from launcher.cli import main

main()
