"""`python -m trainer`: the reference RL loop without going through the `wsync` command."""
import sys

from .cli import main

sys.exit(main())
